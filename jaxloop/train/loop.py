"""The training loop: rollout -> rewards -> update -> publish, with metrics, evaluation and
checkpoints. A run dir that holds a checkpoint resumes from it automatically."""

from __future__ import annotations

import contextlib
import sys
import time
from pathlib import Path

import jax

from jaxloop.config import loop_budget_at, parse_loop_budget, validate_mesh
from jaxloop.data.datasets import DataError
from jaxloop.draft_features import DraftFeatureWriter, config_digest
from jaxloop.io.orbax import write_text_atomic
from jaxloop.io.run_dir import CONFIG_FILE, checkpoint_steps
from jaxloop.metrics import MetricsWriter, progress
from jaxloop.parallel import distributed
from jaxloop.parallel import mesh as shd
from jaxloop.rl.algorithms import get_algorithm
from jaxloop.rl.batch import RolloutBatch
from jaxloop.rl.group_stats import reward_group_stats
from jaxloop.rollout.api import Policy, RolloutSource
from jaxloop.rollout.pipeline import RolloutPipeline
from jaxloop.rollout.producer import RolloutProducer, build_tokenizer
from jaxloop.train.build import actor_config
from jaxloop.train.checkpoint import (
    TrainCheckpointer,
    best_checkpoint,
    check_fresh_start,
    check_resume,
    discard_newer_steps,
    write_best_checkpoint,
)
from jaxloop.train.consistency import (
    check_engine_logprobs,
    check_loop_budget,
    check_skips,
    depth_metrics,
    staleness,
)
from jaxloop.train.hooks import Hook, Hooks, Step
from jaxloop.train.samples import SamplesWriter
from jaxloop.train.setup import (
    TrainSetup,
    build_producer,
    engine_model,
    logprob_bound,
    run_producer_settings,
)


def device_memory(phase: str) -> dict[str, float]:
    """GB in use on this process's first device after `phase`, and the process's peak so far
    (from `device.memory_stats()`; empty where the backend has none, e.g. CPU)."""
    stats = jax.local_devices()[0].memory_stats() or {}
    out = {}
    if "bytes_in_use" in stats:
        out[f"device_gb_after_{phase}"] = stats["bytes_in_use"] / 1e9
    if "peak_bytes_in_use" in stats:
        out["device_peak_gb"] = stats["peak_bytes_in_use"] / 1e9
    return out


class _NoMetrics:
    """Metrics sink of processes other than 0 (only process 0 writes metrics)."""

    def write(self, update, metrics) -> None:
        pass

    def close(self) -> None:
        pass


class Trainer:
    """Runs updates: each takes a rollout batch, computes the old log-probs, makes the optimizer
    steps and publishes the new policy; the rest runs as hooks (hooks.py)."""

    def __init__(self, cfg):
        self.cfg = cfg
        self.run_dir = Path(cfg.run_dir).resolve()
        self.algo = get_algorithm(cfg.algorithm)
        distributed.initialize(cfg.dist)
        self.is_main = distributed.is_main_process()
        model_cfg = actor_config(cfg)
        self.mesh = shd.make_mesh(**validate_mesh(cfg, jax.device_count(), model_cfg))
        self.setup = TrainSetup(cfg, model_cfg, self.mesh)
        check_resume(cfg, self.run_dir, self.setup)  # before anything is written or restored
        discard_newer_steps(cfg, self.run_dir)  # resume_step: the newer steps moved aside
        check_fresh_start(cfg, self.run_dir)  # no checkpoint: refuse to overwrite another run
        self.learner = self.setup.learner
        settings = run_producer_settings(cfg, self.algo.requires_groups, model_cfg.vocab_size)
        # nothing is written before the state is built (a fresh one reads model.init_checkpoint or
        # model.hf_dir and may fail): the run dir and its checkpoints/ come after it
        cursor, ahead = self._restore_or_start()
        self.state = self.learner.rest(self.state)  # offloaded parts to host memory
        self.start_update = self.state.update_count
        model = engine_model(cfg, self.setup, self.state)
        self.producer: RolloutSource = build_producer(cfg, model, settings, self.mesh)
        if cursor is not None:
            self.producer.restore(cursor)
        elif cfg.warm_start.sft_steps > 0:
            self.run_warm_start(settings)
        # remote engines generate while the learner trains; a source on the learner's devices
        # generates its batch ahead in this thread (the same batches)
        self.pipeline = RolloutPipeline(
            self.producer,
            cfg.rollout.max_staleness,
            cfg.total_updates,
            background=not self.producer.shares_devices,
        )
        self.pipeline.restore(ahead)
        self._warn_off_policy()
        self.metrics = (
            MetricsWriter(self.run_dir, start_update=self.start_update)
            if self.is_main
            else _NoMetrics()
        )
        # what each evaluation asked and answered: samples/<update>.jsonl (process 0)
        self.samples = SamplesWriter(self.run_dir, self.start_update) if self.is_main else None
        self.warned_constant_values = False
        self.pending_best = None  # keep_best_checkpoint: the final eval's, saved at "saved"
        self.features = self._feature_writer(settings, model_cfg)
        self.logprob_bound = logprob_bound(cfg)
        self.hooks = Hooks(self._hooks())

    def _restore_or_start(self) -> tuple[dict | None, list]:
        """The state from the latest checkpoint (its data cursor and batches generated ahead),
        or a fresh one and a new run dir (its configs written)."""
        cfg = self.cfg
        step = (checkpoint_steps(self.run_dir) or [None])[-1]
        # warm start: recorded in every checkpoint, so a resume never repeats it
        self.warm_start: dict = {}
        if step is not None:
            self.checkpointer = TrainCheckpointer(self.run_dir, keep=cfg.keep_checkpoints)
            self.state, extra = self.checkpointer.restore(  # verified by check_resume
                step, self.setup.abstract_state(), self.setup.shardings, verify=False
            )
            self.warm_start = extra.get("warm_start", {})
            return extra["data_cursor"], extra.get("batches_ahead", [])
        self.state = self.setup.fresh_state()
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.checkpointer = TrainCheckpointer(self.run_dir, keep=cfg.keep_checkpoints)
        if self.is_main:
            self.checkpointer.write_configs(self.setup.actor_abstract, self.setup.critic_abstract)
            write_text_atomic(self.run_dir / CONFIG_FILE, cfg.to_json_best_effort(indent=2) + "\n")
        return None, []

    def _warn_off_policy(self) -> None:
        cfg = self.cfg
        if cfg.rollout.max_staleness and self.algo.policy_loss != "decoupled_ppo" and self.is_main:
            print(
                f"warning: rollout.max_staleness={cfg.rollout.max_staleness} with "
                f"{cfg.algorithm}: its ratio is taken to the recomputed log-probs of the current "
                "policy, so it is off-policy for batches generated by older versions; "
                "algorithm=dppo corrects for that",
                file=sys.stderr,
            )

    def _feature_writer(self, settings, model_cfg) -> DraftFeatureWriter | None:
        """The draft-feature writer (process 0 of a run with draft_features.enabled)."""
        if not (self.cfg.draft_features.enabled and self.is_main):
            return None
        tokenizer = build_tokenizer(settings.tokenizer, settings.vocab_size)
        return DraftFeatureWriter(
            self.run_dir,
            self.cfg.draft_features.max_tokens_per_update,
            self.cfg.draft_features.max_bytes,
            config_digest(model_cfg.to_hf_dict()),
            tokenizer.digest(),
        )

    def _hooks(self) -> list[Hook]:
        cfg = self.cfg
        return [
            Hook(self._evaluate, at="start", every=cfg.eval_every),
            Hook(self._write_features, at="forward"),
            Hook(self._check_logprobs, at="logprobs"),
            Hook(self._final_evaluate, at="end", every=None, last=cfg.total_updates),
            Hook(self._write_metrics, at="end"),
            Hook(self._save, at="saved", every=cfg.checkpoint_every, last=self.stop_at),
        ]

    @property
    def stop_at(self) -> int:
        """The update this process stops after: total_updates, or stop_after updates from here."""
        last, after = self.cfg.total_updates, self.cfg.stop_after
        return last if after is None else min(last, self.start_update + after)

    def run_warm_start(self, settings) -> None:
        """warm_start.sft_steps SFT steps on the fresh actor; the state is then built around
        the warm-started actor (critic backbone and reference copied from it, fresh optimizer
        states). Its metrics go into update 0's row. Engines apart from the learner's devices
        (Ray: vllm, ray_jax): the warm start evaluates and probes with the embedded sampler,
        beside them (docs/engines.md); they get its policy by the run's first publication."""
        from jaxloop.train.warm_start import warm_start

        probe = self.producer
        if not self.producer.shares_devices:
            from jaxloop.rollout.jax_sampler import JaxSamplerEngine

            engine = JaxSamplerEngine(self.setup.actor_abstract, mesh=self.mesh)
            probe = RolloutProducer(settings, engine)
        actor = self.state.actor_params
        self.state = self.state.replace(actor_params=None)
        try:
            actor, self.warm_start = warm_start(self.cfg, self.setup, probe, actor)
        finally:
            if probe is not self.producer:
                probe.close()  # its KV caches and its reference to the warm-start weights
        self.state = self.learner.rest(self.setup.fresh_state(actor))

    @property
    def version(self) -> int:
        return self.state.version

    def publish(self):
        params, config = self.setup.policy(self.state), self.setup.actor_abstract.config
        return self.producer.publish(Policy(params, self.state.version, config))

    def run(self) -> int:
        cfg = self.cfg
        self.publish()
        self.pipeline.fill(self.start_update)
        bar = progress(
            total=cfg.total_updates,
            initial=self.start_update,
            desc=cfg.algorithm,
            disable=None if cfg.progress and self.is_main else True,
        )
        finished = False
        try:
            for update in range(self.start_update, self.stop_at):
                self.one_update(update, cfg.total_updates, bar)
                self.hooks.run("saved", Step(update, {}))
            finished = True
        finally:
            self.pipeline.close()
            bar.close(summary=finished)  # a failed run: its error is the one line
            # a run failing on a refused write (a full disk): the metrics' last flush fails too;
            # the first error is the one reported
            with contextlib.suppress(OSError) if sys.exc_info()[1] else contextlib.nullcontext():
                self.metrics.close()
            self.checkpointer.close()
            self.producer.close()
        return 0

    def one_update(self, update: int, last: int, bar) -> None:
        step = Step(update, {"policy_version": float(self.version)}, bar)
        if update == 0:
            step.metrics.update(self.warm_start)
        t0 = time.perf_counter()
        self.hooks.run("start", step)
        step.samples = self.take_rollout(update, step.metrics)
        loops = self.loop_budget(update, step.samples, step.metrics)
        learner = self.learner
        step.batch = self.make_batch(step.samples, loops)
        device_batch = learner.place_batch(step.batch.train_batch())
        critic_only = update < self.cfg.critic.warmup_updates  # critic warm-up: the actor waits
        step.metrics["critic_warmup"] = float(critic_only)
        if self.fuses_old_logprobs(learner, critic_only):  # the update's own forward gives them
            step.metrics["time_old_logprobs"] = 0.0
            t_update = time.perf_counter()
            self.state, update_metrics, old_lp = learner.update_fused(
                self.state, device_batch, num_loops=loops
            )
            step.old_lp = old_lp
            self.hooks.run("logprobs", step)  # after the step, before any of it is saved
        else:
            old_lp = self.old_logprobs(learner, step, device_batch, loops)
            t_update = time.perf_counter()
            self.state, update_metrics = learner.update(
                self.state,
                device_batch.replace(old_logprobs=old_lp),
                critic_only=critic_only,
                num_loops=loops,
            )
        self.after_update(step, learner, update_metrics, t_update)
        self.pipeline.join()  # the next batch, generated with this update's policy
        self.publish_timed(step.metrics)
        self.finish_timings(step.metrics, step.batch, t0)
        self.hooks.run("end", step)

    # ---- the steps of an update ----
    def take_rollout(self, update: int, metrics: dict) -> list:
        t_generate = time.perf_counter()
        samples, stats = self.pipeline.take(update)
        metrics.update(stats)
        metrics["time_generate"] = time.perf_counter() - t_generate
        metrics.update(device_memory("generate"))
        if not samples:
            raise DataError(f"update {update}: every sample was dropped (non-finite rewards)")
        metrics.update(staleness(samples, self.version))
        if self.algo.requires_groups:  # the share of groups that carry no signal, and more
            rewards = [s.reward for s in samples]
            metrics.update(reward_group_stats(rewards, [s.group_id for s in samples]))
        return samples

    def loop_budget(self, update: int, samples, metrics: dict) -> int:
        """The loop budget K of this update: sampler, recompute, loss and critic all run K."""
        cfg = self.cfg
        loops = self.setup.model_cfg.num_loops
        loops = loop_budget_at(parse_loop_budget(cfg.model.loop_budget), update) or loops
        check_loop_budget(update, samples, loops)
        metrics["loop_budget"] = float(loops)
        if cfg.rollout.early_exit != "none":  # the trainer replays each token's depth
            metrics.update(depth_metrics(samples, loops))
        return loops

    def make_batch(self, samples, loops: int) -> RolloutBatch:
        cfg = self.cfg
        early_exit = cfg.rollout.early_exit != "none"
        batch = RolloutBatch.from_samples(
            samples,
            num_loops=loops if early_exit else 0,
            depth_as_action=cfg.algo.depth_as_action,
            seq_multiple=cfg.learner.seq_multiple,
            max_new_tokens=cfg.rollout.max_new_tokens,
        ).pad_to(shd.data_parallel_size(self.mesh))
        if cfg.learner.pack_tokens is not None:  # one length: the packed learner's shapes are fixed
            batch = batch.with_length(cfg.learner.pack_tokens + 1)
        return batch

    def fuses_old_logprobs(self, learner, critic_only: bool) -> bool:
        """One optimizer step whose own forward can give the old log-probs (no separate one)."""
        return (
            learner.fuses_old_logprobs
            and not critic_only
            and not self.cfg.draft_features.enabled
            and self.state.ref_params is None
        )

    def old_logprobs(self, learner, step: Step, device_batch, loops: int):
        """The separate old-log-prob forward (several optimizer steps per rollout, per-loop
        credit, a reference, draft features, critic warm-up) at the loop budget `loops`; its
        time goes to metrics."""
        t1 = time.perf_counter()
        with_hidden = self.cfg.draft_features.enabled  # the forward also gives draft features
        out = learner.old_logprobs(self.state, device_batch, with_hidden, num_loops=loops)
        old_lp = out
        if with_hidden:
            old_lp, step.hidden = out
            self.hooks.run("forward", step)
        # per-loop credit: [N, L, T]; the engine sampled from the last loop
        step.old_lp = shd.to_host(old_lp[:, -1] if learner.per_loop else old_lp)
        step.metrics["time_old_logprobs"] = time.perf_counter() - t1
        if learner.per_loop and self.producer.loop_logprobs:  # every loop is checked
            step.loop_old_lp = old_lp
        self.hooks.run("logprobs", step)
        return old_lp

    def after_update(self, step: Step, learner, update_metrics, t_update: float) -> None:
        """The update's metrics, and the stop after too many skipped (non-finite) updates."""
        metrics = step.metrics
        metrics.update(shd.metrics_to_host(update_metrics))
        self.warn_constant_values(step.update, metrics)
        metrics["skipped_updates"] = float(self.state.skipped_updates)
        check_skips(  # nothing of this update is saved then: the last checkpoint stays good
            step.update,
            int(self.state.consecutive_skips),
            self.cfg.optim.max_skipped_updates,
            self.checkpointer.latest_step(),
        )
        metrics["time_update"] = time.perf_counter() - t_update
        metrics.update(device_memory("update"))

    def publish_timed(self, metrics: dict) -> None:
        t2 = time.perf_counter()
        publish = self.publish()
        metrics["time_publish"] = time.perf_counter() - t2
        metrics["publish_gb_per_s"] = float(publish.gb_per_s)
        metrics["publish_bytes"] = float(publish.sent_bytes)  # shipped to the engines
        metrics["publish_full_bytes"] = float(publish.num_bytes)  # the whole version
        metrics["publish_fallback"] = float(publish.fell_back)  # a refused delta, sent in full

    def finish_timings(self, metrics: dict, batch, t0: float) -> None:
        metrics["tokens_per_s"] = float(
            batch.response_mask.sum() / max(time.perf_counter() - t0, 1e-9)
        )
        wall = max(time.perf_counter() - t0, 1e-9)
        engine_s, wait_s = self.pipeline.take_timings()
        metrics["engine_idle_fraction"] = max(0.0, 1.0 - engine_s / wall)
        metrics["learner_idle_fraction"] = min(1.0, wait_s / wall)
        metrics["time_total"] = wall

    def warn_constant_values(self, update: int, metrics: dict) -> None:
        """Once per process: the critic gave (nearly) the same value to every response token of a
        batch whose returns vary, so its advantages are the returns shifted by a constant."""
        if self.warned_constant_values or "value_std" not in metrics or not self.is_main:
            return
        if metrics["value_std"] < 1e-6 and metrics.get("reward_std", 0.0) > 0:
            self.warned_constant_values = True
            print(
                f"warning: update {update}: the critic's values are constant over the batch "
                f"(value_std {metrics['value_std']:.2g}, value_mean {metrics['value_mean']:.3g}) "
                "while the rewards vary: it has not learned yet (see critic.warmup_updates, "
                "critic.lr)",
                file=sys.stderr,
            )

    # ---- hooks ----
    def _evaluate(self, step: Step) -> None:
        step.metrics["eval_reward"] = self.evaluate_policy(step.update)
        self._note_best(step.update, step.metrics["eval_reward"], saved_next=False)

    def _final_evaluate(self, step: Step) -> None:
        step.metrics["final_eval_reward"] = self.evaluate_policy(step.update + 1)
        # the last update's checkpoint is saved right after ("saved" runs last=stop_at)
        self._note_best(step.update + 1, step.metrics["final_eval_reward"], saved_next=True)
        # an engine restarted during the final evaluation is counted in the last row too
        step.metrics.update(self.producer.stats())

    def evaluate_policy(self, at_step: int) -> float:
        """The mean eval reward of the policy after `at_step` updates; its responses go to
        samples/<at_step>.jsonl."""
        reward, rows = self.producer.evaluate_samples()
        if self.samples is not None:
            self.samples.write(at_step, rows)
        return reward

    def _note_best(self, at_step: int, reward: float, saved_next: bool) -> None:
        """keep_best_checkpoint: an eval of the policy after `at_step` updates that beats the
        recorded best is saved (unless it is already, or `saved_next`: the run's last save
        follows) and becomes the record (written once its checkpoint exists)."""
        if not self.cfg.keep_best_checkpoint or reward != reward:  # NaN: never the best
            return
        best = best_checkpoint(self.run_dir)
        if best is not None and reward <= best["eval_reward"]:
            return
        if saved_next:
            self.pending_best = (at_step, reward)
            return
        if at_step not in checkpoint_steps(self.run_dir):
            self._save(Step(at_step, {}))
        if self.is_main:
            write_best_checkpoint(self.run_dir, at_step, reward)

    def _write_features(self, step: Step) -> None:
        # every process runs the same programs (SPMD); only process 0 writes the features
        hidden = shd.to_host(step.hidden)
        if self.features is not None:
            written = self.features.write(
                step.update, self.version, step.samples, step.batch, hidden
            )
            step.metrics["draft_feature_tokens"] = float(written)

    def _check_logprobs(self, step: Step) -> None:
        """Engine vs trainer log-probs of the policy that sampled the batch: a batch of older
        versions cannot be checked."""
        if step.metrics["staleness_max"] != 0:
            return
        loop_old_lp = None if step.loop_old_lp is None else shd.to_host(step.loop_old_lp)
        step.metrics.update(
            check_engine_logprobs(
                step.update, step.batch, shd.to_host(step.old_lp), self.logprob_bound, loop_old_lp
            )
        )

    def _write_metrics(self, step: Step) -> None:
        self.metrics.write(step.update, step.metrics)
        step.bar.step(step.metrics)

    def _save(self, step: Step) -> None:
        self.checkpointer.save(
            self.state,
            {
                "data_cursor": self.producer.state(),
                "seed": self.cfg.seed,
                "batches_ahead": self.pipeline.state(),
                # the record, not its timing: a rerun computes the same record
                "warm_start": {
                    k: v for k, v in self.warm_start.items() if k != "warm_start_seconds"
                },
            },
        )
        pending, self.pending_best = self.pending_best, None
        if pending is not None and pending[0] == self.state.update_count and self.is_main:
            write_best_checkpoint(self.run_dir, *pending)
