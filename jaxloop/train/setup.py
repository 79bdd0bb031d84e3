"""From the config to the training components: loss and learner settings, the TrainState's
shardings and builders (`TrainSetup`), the producer settings and the rollout source. The one
place that maps config keys onto components, and the one that knows the engines by name."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import jax
from flax import nnx

from jaxloop.config import UsageError, default_logprob_diff, parse_loop_budget, run_config
from jaxloop.io.hf import abstract_model
from jaxloop.io.run_dir import CONFIG_FILE, TOKENIZER_DIR
from jaxloop.models import LoopedConfig, LoopedLM
from jaxloop.parallel import mesh as shd
from jaxloop.rl.advantages import AdvantageHParams
from jaxloop.rl.algorithms import get_algorithm
from jaxloop.rl.learner import Learner, LearnerConfig
from jaxloop.rl.losses import LossHParams
from jaxloop.rl.offload import OffloadConfig
from jaxloop.rl.optim import make_optimizer
from jaxloop.rl.state import (
    TrainState,
    abstract_params,
    abstract_train_state,
    build_train_state,
    state_shardings,
)
from jaxloop.rollout.api import RolloutSource
from jaxloop.rollout.producer import ProducerSettings, RolloutProducer, derive_seed
from jaxloop.rollout.types import SamplingConfig
from jaxloop.train.build import critic_from_actor, init_actor_params

ACTOR_SEED, CRITIC_SEED = 0xA, 0xC  # tags of the random inits' seeds (derive_seed)


def actor_seed(cfg) -> int:
    """The seed of a fresh actor's random init (the trainer's, tests', scripts')."""
    return derive_seed(cfg.seed, ACTOR_SEED)


def loss_hparams(cfg) -> LossHParams:
    a = cfg.algo
    opt = lambda v: None if v is None else float(v)
    return LossHParams(
        clip_eps=a.clip_eps,
        clip_eps_high=opt(a.clip_eps_high),
        dual_clip=opt(a.dual_clip),
        kl_coef=a.kl_coef,
        kl_estimator=a.kl_estimator,
        behav_weight_min=a.behav_weight_min,
        behav_weight_max=a.behav_weight_max,
        behav_drop_cap=opt(a.behav_drop_cap),
        flow_delta=a.flow_delta,
        value_clip=opt(a.value_clip),
        reduction=a.reduction,
        value_loss_scale=cfg.critic.loss_scale,
        entropy_coef=a.entropy_coef,
    )


def checked_loss_hparams(cfg) -> LossHParams:
    """loss_hparams, a bad value a UsageError (one line, exit 2)."""
    try:
        return loss_hparams(cfg)
    except ValueError as err:
        raise UsageError(f"algo: {err}") from None


def uses_reference(cfg) -> bool:
    """A KL-to-reference term is on: in the loss (GRPO) or in the rewards (the critic family)."""
    return cfg.algo.kl_coef > 0


def logprob_bound(cfg) -> float:
    """The engine-vs-trainer log-prob bound: rollout.max_logprob_diff, or the engine's and
    dtype's default."""
    rollout = cfg.rollout
    if rollout.max_logprob_diff is not None:
        return rollout.max_logprob_diff
    return default_logprob_diff(rollout.engine, cfg.model.compute_dtype)


def updates_per_rollout(cfg) -> int:
    """Optimizer steps per rollout batch: updates_per_rollout, or the algorithm's default."""
    if cfg.updates_per_rollout is not None:
        return cfg.updates_per_rollout
    return get_algorithm(cfg.algorithm).default_updates_per_rollout


def learner_config(cfg, steps: int) -> LearnerConfig:
    return LearnerConfig(
        micro_batch_size=cfg.micro_batch_size,
        temperature=cfg.rollout.temperature,
        updates_per_rollout=steps,
        critic_steps=cfg.critic.steps_per_rollout,
        logits_chunk=cfg.model.logits_chunk,
        pack_tokens=cfg.learner.pack_tokens,
        step_split=cfg.learner.step_split,
        loop_credit=cfg.algo.loop_credit,
        advantage=AdvantageHParams(
            gamma=cfg.algo.gamma,
            lam=cfg.algo.lam,
            kl_coef=cfg.algo.kl_coef,
            whiten=cfg.algo.whiten_advantages,
            grpo_use_std=cfg.algo.grpo_use_std,
        ),
    )


class TrainSetup:
    """The learner and the shardings of its state, built from the config on a mesh."""

    def __init__(self, cfg, model_cfg: LoopedConfig, mesh):
        algo = get_algorithm(cfg.algorithm)
        hparams = checked_loss_hparams(cfg)
        self.cfg, self.model_cfg, self.mesh = cfg, model_cfg, mesh
        steps = updates_per_rollout(cfg)
        o = cfg.optim
        total = cfg.total_updates * steps
        self.actor_tx = make_optimizer(
            o.name, o.lr, o.schedule, o.warmup_steps, total, o.weight_decay, o.b1, o.b2, o.grad_clip
        )
        self.actor_abstract = abstract_model(model_cfg, "actor")
        actor_graphdef = nnx.split(self.actor_abstract)[0]
        self.critic_abstract = self.critic_tx = critic_graphdef = None
        if algo.uses_critic:
            self.critic_abstract = abstract_model(model_cfg, "critic")
            critic_graphdef = nnx.split(self.critic_abstract)[0]
            self.critic_tx = make_optimizer(
                o.name, cfg.critic.lr, "constant", 0, total, 0.0, o.b1, o.b2, o.grad_clip
            )
        critic = self.critic_abstract
        self.shardings = state_shardings(
            mesh,
            shd.shardings_for(self.actor_abstract, mesh),
            abstract_params(self.actor_abstract),
            self.actor_tx,
            None if critic is None else shd.shardings_for(critic, mesh),
            None if critic is None else abstract_params(critic),
            self.critic_tx,
            with_reference=uses_reference(cfg),
        )
        # one learner for every loop budget: K is a static argument of its entries
        self.learner = Learner(
            actor_graphdef,
            critic_graphdef,
            algo,
            hparams,
            learner_config(cfg, steps),
            self.actor_tx,
            self.critic_tx,
            mesh=mesh,
            state_shardings=self.shardings,
            offload=OffloadConfig(
                critic=cfg.offload.critic,
                optimizer=cfg.offload.optimizer,
                reference=cfg.offload.reference,
            ),
        )

    def fresh_state(self, actor: dict | None = None) -> TrainState:
        """A new TrainState around `actor` (default: the configured initial weights); the
        critic copies its backbone, the reference its parameters, optimizer states are fresh."""
        cfg = self.cfg
        if actor is None:
            actor = self.initial_actor()
        critic = None
        if self.critic_abstract is not None:
            seed = derive_seed(cfg.seed, CRITIC_SEED)
            critic = jax.jit(
                lambda a: critic_from_actor(a, self.model_cfg, seed),
                out_shardings=self.shardings.critic_params,
            )(actor)
        return build_train_state(
            actor, self.actor_tx, critic, self.critic_tx, shardings=self.shardings, seed=cfg.seed
        )

    def abstract_state(self) -> TrainState:
        return abstract_train_state(
            abstract_params(self.actor_abstract),
            self.actor_tx,
            None if self.critic_abstract is None else abstract_params(self.critic_abstract),
            self.critic_tx,
            with_reference=uses_reference(self.cfg),
        )

    def initial_actor(self) -> dict:
        """The configured initial actor parameters on their shardings."""
        shardings = self.shardings.actor_params
        return init_actor_params(
            self.cfg, self.model_cfg, self.mesh, shardings, actor_seed(self.cfg)
        )

    def policy(self, state: TrainState) -> nnx.State:
        """The actor parameters of `state` as the nnx.State engines take (no copy)."""
        return self.policy_of(state.actor_params)

    def policy_of(self, actor_params: dict) -> nnx.State:
        policy = nnx.state(self.actor_abstract)
        nnx.replace_by_pure_dict(policy, actor_params)
        return policy

    def actor_model(self, state: TrainState) -> LoopedLM:
        return nnx.merge(nnx.graphdef(self.actor_abstract), self.policy(state))


# a directory holds an HF tokenizer when it has one of these (AutoTokenizer reads them)
_TOKENIZER_MARKERS = ("tokenizer.json", "tokenizer_config.json")


def has_hf_tokenizer(path: str | Path) -> bool:
    return any((Path(path) / name).is_file() for name in _TOKENIZER_MARKERS)


def tokenizer_spec(cfg) -> str:
    """data.tokenizer resolved: `auto` (the default) is the tokenizer of the model the run starts
    from, when that has one: model.hf_dir's, or model.init_checkpoint's (run_tokenizer); else
    `char`. `char` or a directory are taken as given."""
    spec = cfg.data.tokenizer
    if spec != "auto":
        return spec
    m = cfg.model
    if m.hf_dir and has_hf_tokenizer(m.hf_dir):
        return str(m.hf_dir)
    if m.init_checkpoint:
        return run_tokenizer(m.init_checkpoint)
    return "char"


def run_tokenizer(run_dir: str | Path, _depth: int = 0) -> str:
    """The tokenizer a run dir was made with: its tokenizer/ (conversion.from_hf's copy), else
    its config.json's data.tokenizer (`auto` resolved against that run's own model source, so an
    RL run started from an SFT run finds the SFT run's tokenizer); `char` when neither names an
    HF tokenizer."""
    run_dir = Path(run_dir)
    own = run_dir / TOKENIZER_DIR
    if has_hf_tokenizer(own):
        return str(own)
    config = run_dir / CONFIG_FILE
    if not config.is_file() or _depth > 8:
        return "char"
    try:
        stored = json.loads(config.read_text())
        spec = stored["data"].get("tokenizer", "char")
        model = stored["model"]
        hf_dir, init = model.get("hf_dir") or "", model.get("init_checkpoint") or ""
    except (ValueError, KeyError, TypeError, AttributeError) as err:
        raise UsageError(f"{config}: not a jaxloop run config ({err})") from None
    if spec != "auto":
        return spec
    if hf_dir and has_hf_tokenizer(hf_dir):
        return str(hf_dir)
    return run_tokenizer(init, _depth + 1) if init else "char"


def check_tokenizer_fits(spec: str, tokenizer, vocab_size: int) -> None:
    """A tokenizer larger than the model's vocabulary is refused (its ids would index past the
    embedding): one line, exit code 2, before anything is built."""
    if tokenizer.vocab_size > vocab_size:
        raise UsageError(
            f"data.tokenizer={spec!r} has {tokenizer.vocab_size} tokens, more than the model's "
            f"vocabulary of {vocab_size}: its ids would index past the embedding"
        )


def producer_settings(cfg, requires_groups: bool) -> ProducerSettings:
    return ProducerSettings(
        seed=cfg.seed,
        data={
            "source": cfg.data.source,
            "eval_source": cfg.data.eval_source,
            "task": cfg.data.task,
            "num_digits": cfg.data.num_digits,
            "seed": cfg.seed,
            "prompt_key": cfg.data.prompt_key,
            "label_key": cfg.data.label_key,
            "prompt_template": cfg.data.prompt_template,
            "label_extract": cfg.data.label_extract,
        },
        tokenizer=tokenizer_spec(cfg),
        vocab_size=cfg.model.vocab_size,
        reward=cfg.data.reward,
        prompts_per_update=cfg.prompts_per_update,
        n_samples_per_prompt=cfg.n_samples_per_prompt,
        max_prompt_tokens=cfg.data.max_prompt_tokens,
        eval_prompts=cfg.eval_prompts,
        requires_groups=requires_groups,
        sampling=SamplingConfig(
            temperature=cfg.rollout.temperature,
            top_p=cfg.rollout.top_p,
            top_k=cfg.rollout.top_k,
            max_new_tokens=cfg.rollout.max_new_tokens,
            early_exit=cfg.rollout.early_exit,
            exit_threshold=cfg.rollout.exit_threshold,
            # per-loop credit: the embedded sampler's per-loop log-probs, checked per loop
            # (vLLM engines have none)
            loop_logprobs=cfg.algo.loop_credit != "last" and cfg.rollout.engine == "jax",
        ),
        loop_budget=parse_loop_budget(cfg.model.loop_budget),
        dynamic_sampling_rounds=cfg.rollout.dynamic_sampling_rounds,
    )


def run_producer_settings(cfg, requires_groups: bool, vocab_size: int) -> ProducerSettings:
    """producer_settings for a run on a model of `vocab_size` tokens (the char tokenizer spans
    the model's vocabulary)."""
    settings = producer_settings(cfg, requires_groups)
    if settings.tokenizer == "char":
        settings = dataclasses.replace(settings, vocab_size=vocab_size)
    return settings


def engine_log_level(cfg) -> str:
    """The engine actors' log level: rollout.engine_log_level, or INFO with verbose=True."""
    level = cfg.rollout.engine_log_level.upper()
    return "INFO" if cfg.verbose and level != "DEBUG" else level


def build_producer(cfg, actor: LoopedLM, settings: ProducerSettings, mesh=None) -> RolloutSource:
    """In-process producer around the embedded engine, or the Ray client in front of engine
    actors (vLLM, or the JAX sampler: rollout.engine=ray_jax)."""
    if cfg.rollout.engine == "jax":
        from jaxloop.rollout.jax_sampler import JaxSamplerEngine

        return RolloutProducer(settings, JaxSamplerEngine(actor, mesh=mesh))
    from jaxloop.rollout.ray.client import RayRolloutClient

    def start() -> RayRolloutClient:
        return RayRolloutClient(
            run_config(cfg).rollout, actor.config, settings, log_level=engine_log_level(cfg)
        )

    if jax.process_count() == 1:
        return start()
    # several trainer processes: process 0 alone starts and talks to the engines (replicated.py)
    from jaxloop.parallel.distributed import LeaderChannel
    from jaxloop.rollout.replicated import ReplicatedSource, publication_layout

    channel, client = LeaderChannel(), None

    def start_on_process_0() -> dict:
        nonlocal client
        client = start()
        return publication_layout(client)

    layout = channel.share("rollout/start", start_on_process_0)  # its error stops every process
    return ReplicatedSource(client, channel, layout, RayRolloutClient)


def engine_model(cfg, setup: TrainSetup, state: TrainState) -> LoopedLM:
    """The model a source is built around: the abstract actor. The weights reach every engine
    by publication only (zero-copy for the embedded sampler; Ray engines boot from its config)."""
    return setup.actor_abstract
