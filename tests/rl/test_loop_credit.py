"""Per-loop credit (algo.loop_credit): `last` is today's update, bit for bit; uniform and
progressive losses equal sum_t w_t loss_t built by hand from the model's per-loop logits
(forward(return_loops=True)) and the registered loss (<= 1e-6 fp32, loss and SGD step); exit_pdf
weights are Ouro's exit distribution and train nothing; every algorithm runs with uniform; the
chunked vocabulary path and sequence packing equal the whole / padded path (<= 1e-6)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxloop.models import LoopedConfig, LoopedLM, tiny_hf_config
from jaxloop.rl.losses import POLICY_LOSSES, LossInputs, reduce_loss
from jaxloop.train.cli import main
from tests.rl.test_learner import CFG, _arrays, _Run
from tests.rl.test_packing import PACK
from tests.rl.test_packing import _batch as _long_tailed_batch
from tests.train.helpers import TINY, read_rows

TEMPERATURE = 0.8  # _Run's
OURO = LoopedConfig.from_hf_dict(
    tiny_hf_config("ouro", num_hidden_layers=1, total_ut_steps=3, hidden_size=16, head_dim=8)
)


def _max_diff(a, b) -> float:
    return max(jax.tree.leaves(jax.tree.map(lambda x, y: float(jnp.abs(x - y).max()), a, b)))


def _copy(tree):
    return jax.tree.map(lambda x: jnp.array(x, copy=True), tree)


def _run_update(run: _Run, arrays, perturb=0.05):
    """One update with per-loop old log-probs moved off the current policy (so every loop's
    ratio differs from 1). Returns (batch with the [N, L, T] old log-probs, the state's actor,
    reference and critic parameters before it, metrics)."""
    batch = run.learner.place_batch(arrays.train_batch())
    old = run.learner.old_logprobs(run.state, batch)
    if run.learner.per_loop:
        n, loops, t = old.shape  # the noise drawn loop-major, as it always was
        noise = np.random.default_rng(1).normal(size=(loops, n, t)).astype(np.float32)
        old = old + perturb * np.moveaxis(noise, 0, 1) * arrays.response_mask[:, None]
    batch = batch.replace(old_logprobs=old)
    s = run.state
    before = _copy((s.actor_params, s.ref_params, s.critic_params))
    run.state, metrics = run.learner.update(run.state, batch)
    return batch, before, {k: float(v) for k, v in metrics.items()}


def _program(run: _Run, arrays) -> str:
    """The jaxpr of the learner's fused update on `arrays` (traced, not compiled)."""
    batch = run.learner.place_batch(arrays.train_batch())
    n, t = batch.response_mask.shape
    shape = (n, CFG.num_loops, t) if run.learner.per_loop else (n, t)
    batch = batch.replace(old_logprobs=jnp.zeros(shape))
    return str(jax.make_jaxpr(run.learner._update_impl)(run.state, batch))


def test_last_is_todays_update_bitwise():
    arrays = _arrays()
    today, last = _Run("grpo", 4, 0.1), _Run("grpo", 4, 0.1, loop_credit="last")
    assert _program(today, arrays) == _program(last, arrays)
    # the comparison above can fail: per-loop credit is another program
    assert _program(_Run("grpo", 4, 0.1, loop_credit="uniform"), arrays) != _program(last, arrays)
    m_today, m_last = _run_update(today, arrays)[2], _run_update(last, arrays)[2]
    assert m_today == m_last
    assert _max_diff(today.state.actor_params, last.state.actor_params) == 0.0
    assert not any(k.startswith("loop") for k in m_last)


def _hand_loss(run: _Run, params, ref_params, batch, advantages, weights):
    """sum_t w_t reduce(loss_t) from separate per-loop logits of forward(return_loops=True)."""
    tokens, attn, mask = batch.tokens, batch.attention_mask, batch.response_mask
    graphdef = run.learner.actor_graphdef

    def per_loop_logprobs(p):
        out = nnx.merge(graphdef, p).forward(
            tokens[:, :-1], attention_mask=attn[:, :-1], return_loops=True
        )
        logp = jax.nn.log_softmax(out.loop_logits / TEMPERATURE, axis=-1)
        return jnp.take_along_axis(logp, tokens[None, :, 1:, None], axis=-1)[..., 0]

    lp = per_loop_logprobs(params)
    ref = None if ref_params is None else per_loop_logprobs(ref_params)
    loss_fn, hp = POLICY_LOSSES[run.learner.algorithm.policy_loss], run.learner.hp
    total = 0.0
    for t, w in enumerate(weights):
        inputs = LossInputs(
            logprobs=lp[t],
            old_logprobs=batch.old_logprobs[:, t],
            behav_logprobs=batch.behav_logprobs,
            advantages=advantages,
            mask=mask,
            ref_logprobs=None if ref is None else ref[t],
        )
        per_token = loss_fn(inputs, hp)[0]
        total = total + w * reduce_loss(
            per_token, mask, hp.reduction, jnp.sum(batch.sample_mask), jnp.sum(mask)
        )
    return total


@pytest.mark.parametrize(
    "name, credit, kl, weights",
    [("grpo", "uniform", 0.1, (0.5, 0.5)), ("dppo", "progressive", 0.0, (1 / 3, 2 / 3))],
)
def test_loss_is_the_weighted_sum_of_per_loop_losses(name, credit, kl, weights):
    assert CFG.num_loops == len(weights)
    arrays = _arrays()
    run = _Run(name, 8, kl, loop_credit=credit)
    behav = np.asarray(run.old_logprobs(arrays))[:, -1]
    arrays.behav_logprobs = behav - 0.01 * arrays.response_mask
    batch, (params, ref, critic), metrics = _run_update(run, arrays)
    # the advantages do not depend on the loop credit: the learner's own estimator
    prepared, _ = run.learner._prepare(ref, critic, batch)
    adv = prepared.advantages

    @jax.jit
    @jax.value_and_grad
    def hand(p, w):
        return _hand_loss(run, p, ref, batch, adv, w)

    loss, grads = hand(params, jnp.asarray(weights))
    assert abs(metrics["policy_loss"] - float(loss)) <= 1e-6 * max(1.0, abs(float(loss)))
    _, last_only = hand(params, jnp.asarray([0.0, 1.0]))
    assert _max_diff(grads, last_only) > 1e-4  # the earlier loop counts
    stepped = jax.tree.map(lambda p, g: p - 0.5 * g, params, grads)  # _Run's SGD(0.5)
    assert _max_diff(run.state.actor_params, stepped) <= 1e-6
    assert _max_diff(run.state.actor_params, params) > 1e-4
    for t in range(len(weights)):
        assert metrics[f"loop{t + 1}_weight"] == pytest.approx(weights[t], abs=1e-6)
    assert metrics["loop1_kl_to_last"] > 0.0 and metrics["loop2_kl_to_last"] == 0.0


def test_exit_pdf_weights_are_the_exit_distribution_and_train_no_gate():
    arrays = _arrays()
    run = _Run("grpo", 8, loop_credit="exit_pdf", model_cfg=OURO)
    batch, (params, _, _), metrics = _run_update(run, arrays)
    out = nnx.merge(run.learner.actor_graphdef, params).forward(
        batch.tokens[:, :-1], attention_mask=batch.attention_mask[:, :-1], return_loops=True
    )
    mask = batch.response_mask
    exit_means = jnp.sum(out.exit_probs * mask, axis=(1, 2)) / jnp.sum(mask)
    assert OURO.num_loops == 3 and float(jnp.abs(exit_means.sum() - 1.0)) <= 1e-6
    for t in range(3):
        assert metrics[f"loop{t + 1}_weight"] == pytest.approx(float(exit_means[t]), abs=1e-6)
    assert float(jnp.std(out.exit_probs[0] * mask)) > 1e-4  # the weights vary per token
    new = run.state.actor_params
    for gate in ("exit_gate", "exit_bias"):  # the weights are stop-gradient: no step reaches it
        assert bool(jnp.array_equal(new[gate], params[gate])), gate
    assert _max_diff(new["lm_head"], params["lm_head"]) > 1e-4


# grpo runs with uniform in the hand computation, flow_dppo in the chunked-vocabulary test
@pytest.mark.parametrize("name", ["ppo", "dppo"])
def test_every_algorithm_runs_one_update_with_uniform(name):
    arrays = _arrays()
    run = _Run(name, 4, loop_credit="uniform")
    _, (params, _, _), metrics = _run_update(run, arrays)
    assert np.isfinite(metrics["policy_loss"]) and np.isfinite(metrics["grad_norm"])
    assert _max_diff(run.state.actor_params, params) > 1e-4
    assert metrics["loop1_entropy"] > 0.0 and metrics["loop1_kl_to_last"] > 0.0


def test_flow_dppo_uniform_chunked_vocabulary_equals_whole():
    arrays = _arrays()
    whole = _Run("flow_dppo", 4, loop_credit="uniform")
    chunked = _Run("flow_dppo", 4, loop_credit="uniform", logits_chunk=4)
    (_, (params, _, _), m_whole), m_chunked = (
        _run_update(whole, arrays),
        _run_update(chunked, arrays)[2],
    )
    assert _max_diff(whole.state.actor_params, params) > 1e-4
    assert m_whole["old_kl"] > 0.0  # the second step's D_t of each loop against pi_old's loop
    assert _max_diff(whole.state.actor_params, chunked.state.actor_params) <= 1e-6
    for key, value in m_whole.items():
        assert abs(m_chunked[key] - value) <= 1e-6 * max(1.0, abs(value)), key


def test_packed_per_loop_update_equals_padded():
    arrays = _long_tailed_batch()
    padded = _Run("grpo", 4, 0.1, loop_credit="uniform")
    packed = _Run("grpo", 4, 0.1, loop_credit="uniform", pack_tokens=PACK)
    # no perturbation: the two layouts have different T, so no shared noise
    m_padded = _run_update(padded, arrays, perturb=0.0)[2]
    m_packed = _run_update(packed, arrays.with_length(PACK + 1), perturb=0.0)[2]
    assert _max_diff(padded.state.actor_params, packed.state.actor_params) <= 1e-6
    for key, value in m_padded.items():
        assert abs(m_packed[key] - value) <= 1e-6 * max(1.0, abs(value)), key


def test_trainer_uniform_run_on_the_mesh(tmp_path):
    """One update of the CLI on the 8-device mesh: the per-loop recompute is [L, N, T] and the
    engine-vs-trainer check reads its last loop (the numbers of loop_credit=last, whose rollout
    is the same, up to ~1 ulp: last takes its old log-probs from the fused update's forward,
    another XLA program), and the per-loop metrics are written."""
    args = ["--config", "grpo.py", *TINY, "--config.total_updates=1", "--config.eval_every=100"]
    for credit in ("last", "uniform"):
        run_dir = tmp_path / credit
        assert (
            main([*args, f"--config.run_dir={run_dir}", f"--config.algo.loop_credit={credit}"]) == 0
        )
    last, uniform = (read_rows(tmp_path / credit)[0] for credit in ("last", "uniform"))
    assert max(uniform["logprob_diff_max"], last["logprob_diff_max"]) <= 1e-5
    # fp32 log-probs near -4 are 4.8e-7 apart: the two programs may differ by one ulp
    assert abs(uniform["logprob_diff_max"] - last["logprob_diff_max"]) <= 1e-6
    assert abs(uniform["entropy"] - last["entropy"]) <= 1e-6  # the last loop's, same parameters
    assert uniform["loop2_entropy"] == uniform["entropy"] and uniform["loop1_weight"] == 0.5
    assert not any(key.startswith("loop1") for key in last)


@pytest.mark.parametrize("norm_between_loops", [True, False])
def test_loop_hidden_is_the_head_input_of_a_model_that_stops_there(norm_between_loops):
    """ModelOutput.loop_hidden[t] == the LM-head input of the (t + 1)-loop budget, also for a
    family without a norm between loops (<= 1e-6 fp32)."""
    cfg = LoopedConfig.from_hf_dict(
        tiny_hf_config("nanbeige", num_hidden_layers=1, skip_loop_final_norm=not norm_between_loops)
    )
    model = LoopedLM(cfg, rngs=nnx.Rngs(0))
    model.final_norm[...] = 1.7 * model.final_norm[...]  # a second norm would show
    ids = jnp.asarray(np.random.default_rng(0).integers(3, cfg.vocab_size, (2, 7)))
    loop_hidden = model.forward(ids, return_loops=True).loop_hidden
    for t in range(cfg.num_loops):
        budget = model.forward(ids, num_loops=t + 1).hidden
        assert float(jnp.abs(loop_hidden[t] - budget).max()) <= 1e-6, t
