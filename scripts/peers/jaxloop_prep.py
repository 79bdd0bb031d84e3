"""Run with jaxloop's python (scripts/bench_peers.py does). For one jaxloop GRPO command line it
exports what the peers need to do the same work:

  OUT/model/          the actor jaxloop initialises for that command line (same seed, same init
                      code path: models.build.build_actor) as an HF fp32 checkpoint (save_hf);
                      TRL trains exactly this function from exactly these weights
  OUT/prompts.json    the prompts (and labels, token ids) jaxloop's data source hands out, in
                      order, for `--updates` updates of `prompts_per_update` prompts
  OUT/prompts.jsonl   the same prompts as {prompt, label} lines (Tunix reads these)
  OUT/tokenizer.json  jaxloop's char tokenizer ids (pad, bos, eos, alphabet, vocab size)
  OUT/reference.npz   jaxloop's fp32 logits for 4 sequences (4 prompts of one length and 32
                      random ids each): trl_grpo.py refuses
                      to train unless its model reproduces them
  OUT/eval.json       the `eval_prompts` held-out prompts jaxloop's greedy eval scores (the
                      producer's make_eval_examples), in order, with labels and token ids
  OUT/warm_start.json with --warm: the warm start's metrics (steps, eval before and after)

--warm: OUT/model/ is the actor after jaxloop's warm start for that command line (the same
Trainer code path as a training run: train/loop.py run_warm_start), not the actor at init; a
jaxloop run started from it (--config.model.hf_dir=OUT/model, warm start off) and the peers then
start from one model.

Matched: model function and initial weights (TRL), prompt strings and order, token ids.

    python scripts/peers/jaxloop_prep.py OUT --updates 14 -- --config grpo.py --config.model...
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def tokenizer_record(tok) -> dict:
    """What OUT/tokenizer.json holds of jaxloop's CharTokenizer `tok` (the peers rebuild it)."""
    from jaxloop.data.tokenizer import _CHAR_SPECIALS, CHAR_ALPHABET

    return {
        "specials": list(_CHAR_SPECIALS),
        "pad_id": tok.pad_id,
        "bos_id": tok.bos_id,
        "eos_id": tok.eos_id,
        "alphabet": CHAR_ALPHABET,
        "vocab_size": tok.vocab_size,
    }


def warm_started_actor(cfg, out: Path):
    """The actor after jaxloop's warm start for `cfg` (a Trainer in OUT/warm_run: the same
    fresh state, producer and warm_start call as a training run); its metrics go to
    OUT/warm_start.json."""
    import shutil

    from jaxloop.train.loop import Trainer

    run_dir = out / "warm_run"
    shutil.rmtree(run_dir, ignore_errors=True)
    cfg = cfg.copy_and_resolve_references()
    with cfg.unlocked():
        cfg.run_dir = str(run_dir)
        cfg.progress = False
    trainer = Trainer(cfg)
    try:
        model = trainer.setup.actor_model(trainer.state)
    finally:
        trainer.pipeline.close()
        trainer.producer.close()
        trainer.checkpointer.close()
        trainer.metrics.close()
    (out / "warm_start.json").write_text(json.dumps(trainer.warm_start))
    return model


def main() -> int:
    argv = sys.argv[1:]
    if "--" not in argv:
        raise SystemExit("usage: jaxloop_prep.py OUT --updates N -- <jaxloop.train arguments>")
    split = argv.index("--")
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--updates", type=int, required=True)
    ap.add_argument("--warm", action="store_true", help="export the actor after the warm start")
    args = ap.parse_args(argv[:split])
    train_argv = argv[split + 1 :]

    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxloop.config import parse_args
    from jaxloop.data.datasets import make_eval_examples, make_source
    from jaxloop.data.tokenizer import CharTokenizer
    from jaxloop.io.hf import save_hf
    from jaxloop.train.build import build_actor
    from jaxloop.train.setup import actor_seed, producer_settings

    cfg = parse_args(train_argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    if args.warm:
        model = warm_started_actor(cfg, out)
    else:
        model = build_actor(cfg, actor_seed(cfg))  # the same init as a training run's fresh state
    save_hf(model, out / "model", dtype="float32", overwrite=True)

    source = make_source(producer_settings(cfg, True).data)
    tok = CharTokenizer(cfg.model.vocab_size)
    prompts = []
    for update in range(args.updates):
        for ex in source.next_batch(cfg.prompts_per_update):
            ids = tok.encode_prompt(ex.prompt)
            prompts.append({"update": update, "prompt": ex.prompt, "label": ex.label, "ids": ids})
    (out / "prompts.json").write_text(json.dumps(prompts, indent=0))
    with open(out / "prompts.jsonl", "w") as f:
        for p in prompts:
            f.write(json.dumps({"prompt": p["prompt"], "label": p["label"]}) + "\n")
    (out / "tokenizer.json").write_text(json.dumps(tokenizer_record(tok)))
    held_out = make_eval_examples(producer_settings(cfg, True).data, cfg.eval_prompts)
    evals = [
        {
            "prompt": ex.prompt,
            "label": ex.label,
            "ids": tok.encode_prompt(ex.prompt),
        }
        for ex in held_out
    ]
    (out / "eval.json").write_text(json.dumps(evals, indent=0))

    # reference logits: 4 sequences of a prompt and 32 random continuation ids
    rng = np.random.default_rng(0)
    vocab = cfg.model.vocab_size
    # (prompts of one length: a task's prompts may differ in length)
    same = [p for p in prompts if len(p["ids"]) == len(prompts[0]["ids"])][:4]
    ids = np.stack(
        [np.array(p["ids"] + rng.integers(3, vocab, 32).tolist(), np.int32) for p in same]
    )
    logits = model(jnp.asarray(ids))
    np.savez(out / "reference.npz", ids=ids, logits=np.asarray(jax.device_get(logits), np.float32))
    summary = {
        "out": str(out),
        "prompts": len(prompts),
        "prompt_tokens": sorted({len(p["ids"]) for p in prompts}),
        "config": json.loads((out / "model" / "config.json").read_text()),
    }
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
