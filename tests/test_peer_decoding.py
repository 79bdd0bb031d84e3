"""The TRL runners (scripts/peers/trl_grpo.py, trl_learning.py) score completions as jaxloop does:
the ids decoded by jaxloop's CharTokenizer rule, then jaxloop's `format` reward. TRL's own text is
the HF tokenizer's decode with skip_special_tokens, which drops the ids past the alphabet (marked
special there): a "3<unused>2" read as "32" was a right answer in TRL and a wrong one in jaxloop."""

import random
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts" / "peers"))

import trl_grpo  # noqa: E402
from jaxloop_prep import tokenizer_record as _prep_tokenizer  # noqa: E402

from jaxloop.data.rewards import format_reward  # noqa: E402
from jaxloop.data.tokenizer import CharTokenizer  # noqa: E402


def test_the_peer_decoder_is_jaxloops_on_every_id():
    tok = CharTokenizer(64)
    decode = trl_grpo.char_decoder(_prep_tokenizer(tok))
    for i in range(tok.vocab_size):
        assert decode([i]) == tok.decode([i]), i
    rng = random.Random(0)
    for _ in range(500):
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randrange(1, 9))]
        assert decode(ids) == tok.decode(ids), ids


def test_an_unused_id_is_a_wrong_answer_for_both(tmp_path):
    import json

    tok = CharTokenizer(64)
    (tmp_path / "tokenizer.json").write_text(json.dumps(_prep_tokenizer(tok)))
    reward = trl_grpo.reward_format_for(tmp_path)
    three, two, unused = tok.encode("3")[-1], tok.encode("2")[-1], tok.vocab_size - 1
    rows = [[three, unused, two, tok.eos_id], [three, two, tok.eos_id], [unused, three, two]]
    got = reward(prompts=None, completions=None, label=["32"] * 3, completion_ids=rows)
    want = [format_reward(tok.decode(r), "32") for r in rows]
    assert got == want and got[1] == 1.0 and got[0] < 1.0 and got[2] == 0.0
    # the reward's arithmetic is jaxloop's on any text
    for response, label in [("32", "32"), ("3", "32"), ("x32", "32"), (" 32 ", "32"), ("", "1")]:
        assert trl_grpo.format_reward(response, label) == format_reward(response, label)
