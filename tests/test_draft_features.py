"""Draft-feature collection: hidden states at response positions equal the model's LM-head
input, with a manifest that matches the rollout, within the token budget."""

import json

import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from jaxloop.draft_features import DraftFeatureWriter
from jaxloop.io.hf import read_safetensors
from jaxloop.models import LoopedConfig, LoopedLM, tiny_hf_config
from jaxloop.rl.algorithms import get_algorithm
from jaxloop.rl.batch import RolloutBatch
from jaxloop.rl.learner import Learner, LearnerConfig
from jaxloop.rl.losses import LossHParams
from jaxloop.rl.state import build_train_state
from jaxloop.rollout.api import Policy
from jaxloop.rollout.jax_sampler import JaxSamplerEngine
from jaxloop.rollout.types import PromptRequest, SamplingConfig
from tests.train.helpers import UNIT, run_train


def test_features_written_and_correct(tmp_path):
    run_dir = tmp_path / "run"
    run_train(
        run_dir,
        "grpo.py",
        *UNIT,
        "--config.total_updates=2",
        "--config.prompts_per_update=4",
        "--config.n_samples_per_prompt=2",
        "--config.rollout.max_new_tokens=3",
        "--config.progress=false",
        "--config.curves=false",  # no test here reads curves.png
        "--config.draft_features.enabled=true",
        "--config.draft_features.max_tokens_per_update=20",
    )
    fdir = run_dir / "draft_features"
    assert sorted(p.name for p in fdir.iterdir()) == [
        "update_000000.json",
        "update_000000.safetensors",
        "update_000001.json",
        "update_000001.safetensors",
    ]
    tensors = dict(read_safetensors(fdir / "update_000001.safetensors"))
    manifest = json.loads((fdir / "update_000001.json").read_text())
    n = len(manifest["records"])
    assert n == 20 == tensors["hidden"].shape[0]  # 8 samples x 3 tokens, capped at 20
    assert tensors["hidden"].shape[1] == manifest["hidden_size"] == 64
    assert manifest["policy_version"] == 1 and len(manifest["tokenizer_digest"]) == 64
    rec = manifest["records"]
    assert [r["target_token"] for r in rec] == tensors["target_token"].tolist()
    assert [r["position"] for r in rec] == tensors["position"].tolist()


def test_features_equal_lm_head_input(tmp_path):
    cfg = LoopedConfig.from_hf_dict(tiny_hf_config("nanbeige"))
    model = LoopedLM(cfg, rngs=nnx.Rngs(0))
    engine = JaxSamplerEngine(model)
    engine.publish(Policy(nnx.state(model), 4, model.config))
    reqs = [
        PromptRequest((1, 5, 6, 7)[: 2 + k % 3], seed=k, group_id=k // 2, sample_index=k)
        for k in range(6)
    ]
    samples = engine.generate(reqs, SamplingConfig(max_new_tokens=3))
    arrays = RolloutBatch.from_samples(samples, [0.0] * 6)
    tx = optax.sgd(0.1)
    learner = Learner(
        nnx.graphdef(model),
        None,
        get_algorithm("grpo"),
        LossHParams(),
        LearnerConfig(4, 1.0, 1, 1),
        tx,
    )
    state = build_train_state(nnx.state(model).to_pure_dict(), tx)
    lp, hidden = learner.old_logprobs(state, learner.place_batch(arrays.train_batch()), True)
    writer = DraftFeatureWriter(tmp_path, 100, 10**6, "c" * 64, "t" * 64)
    assert writer.write(3, 4, samples, arrays, hidden) == 18
    tensors = dict(read_safetensors(tmp_path / "draft_features" / "update_000003.safetensors"))
    manifest = json.loads((tmp_path / "draft_features" / "update_000003.json").read_text())
    for row, rec in enumerate(manifest["records"]):
        s = samples[rec["sample"]]
        seq = list(s.prompt_ids) + list(s.response_ids)
        pos = rec["position"]  # index of the target token in seq
        assert seq[pos] == rec["target_token"] == tensors["target_token"][row]
        assert pos >= len(s.prompt_ids) and rec["policy_version"] == 4
        # independent recompute: the forward's LM-head input at the predicting position
        ref = model.forward(jnp.asarray([seq[:pos]])).hidden[0, -1]
        np.testing.assert_allclose(tensors["hidden"][row], np.asarray(ref), rtol=1e-5, atol=1e-6)
    # byte budget: a second writer with no room writes nothing
    small = DraftFeatureWriter(tmp_path, 100, 10, "c" * 64, "t" * 64)
    assert small.write(4, 4, samples, arrays, hidden) == 0
