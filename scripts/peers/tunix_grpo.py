"""Run with the Tunix venv (scripts/bench_peers.py does). Tunix (google-tunix 0.1.7) GRPO on
CPU, matched to jaxloop's grpo.py benchmark workload.

Runs N GRPO updates of a random-init Tunix Llama3 (RMSNorm, RoPE, GQA, SwiGLU) with Tunix's own
RLCluster + GRPOLearner + vanilla rollout (its KV-cache sampler) on the prompts jaxloop's run
draws (the JSONL scripts/peers/jaxloop_prep.py writes). One JSON line per update to --out, then
a summary line.

Matched with jaxloop's benchmark run: hidden 256, MLP 512, 8 heads / 4 KV heads x 32, vocab 64,
fp32, untied LM head, every matrix ~N(0, 0.02) (Tunix's own init zeroes the MLP kernels), 4
layers (jaxloop: 2 layers x 2 loops or 4 x 1; the same FLOPs per token); jaxloop's character
tokenizer ids (pad 0, bos 1, eos 2); 8 prompts x 8 samples, temperature 1.0, no top-p/top-k, up
to 32 new tokens stopping at EOS; jaxloop's `format` reward (--reward); one optimizer step per
rollout batch over one micro-batch of all 64 samples (num_iterations=1: no old-log-prob forward),
beta 0 (no reference model), AdamW lr 1e-3, betas (0.9, 0.99), no weight decay, global-norm clip
1.0, PPO clip 0.2, sequence-mean-token-mean. Not matched: prompts are left-padded to
--max-prompt-length (10, the prompts' length; jaxloop buckets to 16), learner rows are 10 + 32
(jaxloop pads to 48), the sampler's seed stream.

--max-new-tokens, --prompts-per-update and --lr follow the benchmark's workload (bench_peers.py
passes them: --workload long, --curve). Per update also the response lengths as jaxloop's
producer reports them (EOS included): generated_tokens, len_min / len_median / len_max, at_cap
(the share of rows that reached --max-new-tokens without EOS).

Timing (what each key covers, all wall seconds, time.perf_counter):
  time_generate    RLCluster.generate: tokenize + prefill + decode while-loop + device_get of
                   the token buffer + detokenize (the sampler returns host arrays: synchronous).
  time_gen_and_adv GRPOLearner._generate_and_compute_advantage: time_generate + padding, masks,
                   reward fn, group advantages (what jaxloop's time_generate also covers).
  time_rewards_adv time_gen_and_adv - time_generate.
  time_update      RLCluster.update_actor (Tunix's jitted train step: forward + backward +
                   optax update) followed by jax.block_until_ready on the actor's parameters
                   (Tunix dispatches the step asynchronously; the next rollout would wait for the
                   same buffers, so the block moves that wait into this bucket).
  time_total       one whole GRPOLearner global step (RLLearner._run_global_step) + the block.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import sys
import time

T_START = time.perf_counter()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402
from tunix.models.llama3 import model as llama_lib  # noqa: E402
from tunix.rl import rl_cluster as rl_cluster_lib  # noqa: E402
from tunix.rl.grpo import grpo_learner  # noqa: E402
from tunix.rl.rollout import base_rollout  # noqa: E402

# ---- the char tokenizer jaxloop's built-in tasks use (jaxloop/data/tokenizer.py) ----
CHAR_ALPHABET = "0123456789abcdefghijklmnopqrstuvwxyz +-=*/<>?:,.()!'_"
UNUSED_CHAR = "\N{REPLACEMENT CHARACTER}"


class CharTokenizer:
    """pad=0, bos=1, eos=2, then CHAR_ALPHABET from id 3; ids above the alphabet decode to
    UNUSED_CHAR. The interface Tunix's TokenizerAdapter accepts for a plain object:
    encode, decode, bos_id(), eos_id(), pad_id()."""

    def __init__(self, vocab_size: int = 64):
        self.vocab_size = vocab_size
        self._to_id = {c: i + 3 for i, c in enumerate(CHAR_ALPHABET)}
        self._to_char = {i: c for c, i in self._to_id.items()}

    def encode(self, text: str, **_) -> list[int]:
        return [self._to_id[c] for c in text]

    def decode(self, ids, **_) -> str:
        return "".join(
            self._to_char.get(int(i), UNUSED_CHAR) for i in ids if int(i) not in (0, 1, 2)
        )

    def bos_id(self) -> int:
        return 1

    def eos_id(self) -> int:
        return 2

    def pad_id(self) -> int:
        return 0


def exact_match_reward(prompts, completions, answer, **_):
    """jaxloop's 'exact_match': 1.0 iff response.strip() == label.strip()."""
    pairs = zip(completions, answer, strict=True)
    return [1.0 if c.strip() == a.strip() else 0.0 for c, a in pairs]


def _format_score(response: str, label: str) -> float:
    """jaxloop's `format` reward (jaxloop/data/rewards.py), the same arithmetic."""
    response, label = response.strip(), label.strip()
    if response == label:
        return 1.0
    prefix = 0
    for a, b in zip(response, label, strict=False):
        if a != b:
            break
        prefix += 1
    return 0.5 * prefix / max(len(label), 1)


def format_reward(prompts, completions, answer, **_):
    return [_format_score(c, a) for c, a in zip(completions, answer, strict=True)]


REWARDS = {"format": format_reward, "exact_match": exact_match_reward}


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def build_model(args, key: int) -> llama_lib.Llama3:
    cfg = llama_lib.ModelConfig(
        num_layers=args.num_layers,
        vocab_size=args.vocab_size,
        embed_dim=args.hidden_size,
        hidden_dim=args.intermediate_size,
        num_heads=args.num_heads,
        head_dim=args.head_dim,
        num_kv_heads=args.num_kv_heads,
        rope_theta=10_000,
        norm_eps=1e-6,
        weight_tying=False,  # jaxloop's tiny model has its own lm_head too
    )
    model = llama_lib.Llama3(cfg, rngs=nnx.Rngs(params=key))
    # Tunix initialises the MLP kernels to zeros and the rest ~N(0, 0.01); re-initialise every
    # matrix ~N(0, 0.02) like jaxloop (norm scales stay 1), so neither model is degenerate.
    state = nnx.state(model, nnx.Param)
    leaves, treedef = jax.tree.flatten(state)
    keys = jax.random.split(jax.random.key(key + 1), len(leaves))
    new = [
        (0.02 * jax.random.normal(k, x.shape, jnp.float32)).astype(x.dtype) if x.ndim >= 2 else x
        for k, x in zip(keys, leaves, strict=True)
    ]
    nnx.update(model, jax.tree.unflatten(treedef, new))
    return model


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument(
        "--prompts", required=True, help="JSONL of {prompt, label} (update u: lines 8u..)"
    )
    p.add_argument("--out", required=True, help="metrics JSONL to write")
    p.add_argument("--updates", type=int, default=12)
    p.add_argument("--prompts-per-update", type=int, default=8)
    p.add_argument("--samples-per-prompt", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--max-prompt-length", type=int, default=10, help="left-pad prompts to this")
    p.add_argument("--num-layers", type=int, default=4)
    p.add_argument("--hidden-size", type=int, default=256)
    p.add_argument("--intermediate-size", type=int, default=512)
    p.add_argument("--num-heads", type=int, default=8)
    p.add_argument("--num-kv-heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=32)
    p.add_argument("--vocab-size", type=int, default=64)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--reward", choices=sorted(REWARDS), default="format")
    args = p.parse_args()

    t_import = time.perf_counter() - T_START
    rows = [json.loads(line) for line in open(args.prompts)]
    n = args.prompts_per_update
    if len(rows) < n * args.updates:
        raise SystemExit(f"{args.prompts}: {len(rows)} prompts, need {n * args.updates}")
    # numpy arrays, not lists: Tunix repeats every leaf with np.repeat(x, G, axis=0), and a list
    # of strings is a pytree whose leaves are the single strings
    train_ds = [
        {
            "prompts": np.array([r["prompt"] for r in rows[u * n : (u + 1) * n]]),
            "answer": np.array([r["label"] for r in rows[u * n : (u + 1) * n]]),
        }
        for u in range(args.updates)
    ]

    t0 = time.perf_counter()
    model = build_model(args, args.seed)
    n_params = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    # Auto axes: with jax.make_mesh's default (Explicit) axis types, Tunix's Llama3 embedding
    # gather fails (ShardingTypeError: "Use .at[...].get(out_sharding=)")
    mesh = jax.make_mesh((1, 1), ("fsdp", "tp"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    cache_size = args.max_prompt_length + args.max_new_tokens
    rollout_cfg = base_rollout.RolloutConfig(
        max_tokens_to_generate=args.max_new_tokens,
        max_prompt_length=args.max_prompt_length,
        kv_cache_size=cache_size,
        temperature=1.0,
        top_p=1.0,
        top_k=None,
        # an int, not a PRNGKey array: the sampler donates its whole state (seed included) to
        # the jitted prefill, so a key array in the config is deleted after the first generate
        # ("RuntimeError: Array has been deleted with shape=uint32[2]" on the second update)
        seed=args.seed,
    )
    # jaxloop's optimizer: global-norm clip 1.0, AdamW(lr, b1=0.9, b2=0.99, wd=0), constant lr
    optimizer = optax.chain(
        optax.clip_by_global_norm(1.0),
        optax.adamw(args.lr, b1=0.9, b2=0.99, weight_decay=0.0),
    )
    cluster_cfg = rl_cluster_lib.ClusterConfig(
        role_to_mesh={
            rl_cluster_lib.Role.ACTOR: mesh,
            rl_cluster_lib.Role.REFERENCE: mesh,
            rl_cluster_lib.Role.ROLLOUT: mesh,
        },
        rollout_engine="vanilla",
        offload_to_cpu=False,
        training_config=rl_cluster_lib.RLTrainingConfig(
            actor_optimizer=optimizer,
            eval_every_n_steps=10**9,
            max_steps=args.updates,
            mini_batch_size=n,  # one optimizer step per rollout batch
            train_micro_batch_size=n,  # one forward/backward over all n x G samples
            rollout_micro_batch_size=n,  # one generate call of n x G rows
            compute_logps_micro_batch_size=n,
            checkpoint_root_directory=None,
            metrics_logging_options=None,
        ),
        rollout_config=rollout_cfg,
    )
    cluster = rl_cluster_lib.RLCluster(
        actor=model,
        reference=None,
        tokenizer=CharTokenizer(args.vocab_size),
        cluster_config=cluster_cfg,
    )
    algo_cfg = grpo_learner.GRPOConfig(
        num_generations=args.samples_per_prompt,
        num_iterations=1,  # one optimizer step per batch: no old-policy forward in Tunix
        beta=0.0,  # no KL, no reference model
        epsilon=0.2,
        loss_agg_mode="sequence-mean-token-mean",  # jaxloop's default reduction
    )
    cur: dict = {}
    records: list[dict] = []

    def reward(prompts, completions, answer, **kw):
        r = REWARDS[args.reward](prompts, completions, answer, **kw)
        cur["reward_mean"] = float(np.mean(r))
        return r

    learner = grpo_learner.GRPOLearner(rl_cluster=cluster, algo_config=algo_cfg, reward_fns=reward)
    t_setup = time.perf_counter() - t0

    # ---- timing wrappers (instance attributes shadow the methods) ----

    gen_orig = cluster.generate

    def generate(*a, **kw):
        s = time.perf_counter()
        out = gen_orig(*a, **kw)
        cur["time_generate"] = cur.get("time_generate", 0.0) + time.perf_counter() - s
        lens = [len(t) for t in out.tokens]
        cur["response_length"] = float(np.mean(lens))  # tokens before the first EOS
        # tokens the sampler produced: each row up to and including its EOS (as jaxloop counts)
        cur["generated_tokens"] = float(sum(min(n_ + 1, args.max_new_tokens) for n_ in lens))
        cur["rows_hit_eos"] = float(sum(n_ < args.max_new_tokens for n_ in lens))
        with_eos = [min(n_ + 1, args.max_new_tokens) for n_ in lens]  # jaxloop's lengths
        cur["len_min"], cur["len_max"] = float(min(with_eos)), float(max(with_eos))
        cur["len_median"] = float(np.median(with_eos))
        cur["at_cap"] = 1.0 - cur["rows_hit_eos"] / len(lens)
        cur["num_samples"] = float(len(lens))
        return out

    cluster.generate = generate

    adv_orig = learner._generate_and_compute_advantage

    def gen_adv(*a, **kw):
        s = time.perf_counter()
        ex = adv_orig(*a, **kw)
        jax.block_until_ready(ex.advantages)
        cur["time_gen_and_adv"] = time.perf_counter() - s
        cur["train_rows"] = int(ex.completion_ids.shape[0])
        cur["completion_len_padded"] = int(ex.completion_ids.shape[1])
        cur["prompt_len_padded"] = int(ex.prompt_ids.shape[1])
        return ex

    learner._generate_and_compute_advantage = gen_adv

    upd_orig = cluster.update_actor

    def update_actor(*a, **kw):
        s = time.perf_counter()
        upd_orig(*a, **kw)
        jax.block_until_ready(nnx.state(cluster.actor_trainer.model))
        cur["time_update"] = cur.get("time_update", 0.0) + time.perf_counter() - s

    cluster.update_actor = update_actor

    step_orig = learner._run_global_step

    def run_global_step(*a, **kw):
        cur.clear()
        s = time.perf_counter()
        step_orig(*a, **kw)
        jax.block_until_ready(nnx.state(cluster.actor_trainer.model))
        cur["time_total"] = time.perf_counter() - s
        cur["update"] = len(records)
        cur["time_rewards_adv"] = cur["time_gen_and_adv"] - cur["time_generate"]
        cur["response_length_incl_eos"] = cur["generated_tokens"] / cur["num_samples"]
        records.append(dict(cur))
        out_file.write(json.dumps(records[-1]) + "\n")  # one line per update, as it ends
        out_file.flush()

    learner._run_global_step = run_global_step

    out_file = open(args.out, "w")
    t1 = time.perf_counter()
    learner.train(train_ds)
    t_train = time.perf_counter() - t1

    # Tunix's own metrics (completions/mean_length, rewards) from its logger, for cross-checking
    logged = {}
    try:
        m = cluster._rl_metrics_logger._metrics  # prefix -> mode -> name -> [values]
        for prefix, modes in m.items():
            for mode, names in modes.items():
                for name, vals in names.items():
                    logged[f"{prefix}/{mode}/{name}"] = [float(np.asarray(v)) for v in vals]
    except Exception as err:  # noqa: BLE001 - diagnostics only
        logged["error"] = repr(err)

    with out_file as f:
        f.write(
            json.dumps(
                {
                    "summary": True,
                    "framework": "tunix",
                    "n_params": int(n_params),
                    "jax": jax.__version__,
                    "tunix": _version("google-tunix"),
                    "flax": _version("flax"),
                    "optax": _version("optax"),
                    "devices": [str(d) for d in jax.devices()],
                    "time_import": t_import,
                    "time_setup": t_setup,
                    "time_train_loop": t_train,
                    "tunix_logged": {
                        k: v
                        for k, v in logged.items()
                        if any(s in k for s in ("mean_length", "score/mean", "grad_norm", "loss"))
                    },
                }
            )
            + "\n"
        )
    print(f"tunix: {len(records)} updates, train loop {t_train:.1f}s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
