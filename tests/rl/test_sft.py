"""Supervised fine-tuning: rows hold prompt + answer + EOS with the loss on the answer and EOS
targets only; the loss equals a float64 reference cross-entropy over exactly those targets
(fp32: 1e-5 relative); micro-batches sum to the whole batch's step; a non-finite step is not
applied."""

from __future__ import annotations

import jax
import numpy as np
import optax
import torch
from flax import nnx

from jaxloop.data.datasets import Example
from jaxloop.data.tokenizer import CharTokenizer
from jaxloop.io.hf import load_hf
from jaxloop.rl.sft import SFTStepper, sft_batch, sft_loss, sft_sequences
from tests.models.torch_reference import reference_forward, write_random_checkpoint

EXAMPLES = [
    Example("12:", "21"),
    Example("7294:", "4927"),
    Example("5+38=", "43"),
    Example("9:", "9"),
]
SEQ = 12


def _arrays():
    tok = CharTokenizer(vocab_size=64)
    prompts, answers = sft_sequences(tok, EXAMPLES)
    return tok, prompts, answers, sft_batch(prompts, answers, SEQ)


def test_rows_mask_the_answer_and_eos_only():
    tok, prompts, answers, arrays = _arrays()
    assert arrays.tokens.shape == (len(EXAMPLES), SEQ)
    assert arrays.loss_mask.shape == (len(EXAMPLES), SEQ - 1)
    for i, (p, a) in enumerate(zip(prompts, answers, strict=True)):
        assert a[-1] == tok.eos_id and tok.decode(a[:-1]) == EXAMPLES[i].label
        where = np.flatnonzero(arrays.loss_mask[i])
        # target j + 1 is predicted at j: the first answer token at the prompt's last position
        assert where.tolist() == list(range(len(p) - 1, len(p) - 1 + len(a)))
        assert arrays.tokens[i, 1:][where].tolist() == a
        assert arrays.tokens[i, : len(p)].tolist() == p
        assert int(arrays.attention_mask[i].sum()) == len(p) + len(a)


def _model(tmp_path):
    hf, tensors = write_random_checkpoint(
        tmp_path, "nanbeige", seed=3, vocab_size=64, num_loops=2, rope_theta=300.0
    )
    model = load_hf(tmp_path, dtype="float32")
    graphdef, state = nnx.split(model)
    return hf, tensors, graphdef, state.to_pure_dict()


def test_loss_equals_float64_reference(tmp_path):
    hf, tensors, graphdef, params = _model(tmp_path)
    _, _, _, arrays = _arrays()
    mask = arrays.loss_mask
    loss, sums = jax.jit(lambda p, x: sft_loss(graphdef, p, x, mask.sum()))(params, arrays)

    ref = reference_forward(
        tensors, hf, arrays.tokens[:, :-1], attention_mask=arrays.attention_mask[:, :-1]
    )
    logp = torch.log_softmax(ref["logits"], dim=-1).numpy()
    targets = arrays.tokens[:, 1:]
    nll = -np.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
    want = float((nll * mask).sum() / mask.sum())
    assert abs(float(loss) - want) <= 1e-5 * abs(want), (float(loss), want)
    argmax_right = (ref["logits"].numpy().argmax(-1) == targets) * mask
    assert float(sums["correct"]) == float(argmax_right.sum())


def test_micro_batches_give_the_whole_batch_step(tmp_path):
    _, _, graphdef, params = _model(tmp_path)
    _, _, _, arrays = _arrays()
    tx = optax.sgd(0.1)
    out = {}
    for micro in (4, 2, 1):
        stepper = SFTStepper(graphdef, tx, micro)
        p = jax.tree.map(np.copy, params)
        new, _, metrics = stepper.step(p, stepper.init(p), arrays)
        out[micro] = (jax.tree.map(np.asarray, new), {k: float(v) for k, v in metrics.items()})
    for micro in (2, 1):
        assert abs(out[micro][1]["sft_loss"] - out[4][1]["sft_loss"]) <= 1e-6
        jax.tree.map(
            lambda a, b: np.testing.assert_allclose(a, b, rtol=0, atol=1e-6),
            out[micro][0],
            out[4][0],
        )
    moved = jax.tree.map(lambda a, b: float(np.abs(a - b).max()), out[4][0], params)
    assert max(jax.tree.leaves(moved)) > 0


def test_non_finite_step_is_not_applied(tmp_path):
    _, _, graphdef, params = _model(tmp_path)
    _, _, _, arrays = _arrays()
    stepper = SFTStepper(graphdef, optax.adam(1e-2), 4)
    bad = jax.tree.map(np.copy, params)
    bad["lm_head"][0, 0] = np.nan
    before = jax.tree.map(np.copy, bad)
    new, _, metrics = stepper.step(bad, stepper.init(bad), arrays)
    assert float(metrics["skipped"]) == 1.0
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), b), new, before)
