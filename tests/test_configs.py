"""Every file in configs/ loads and validates; the real-shape ones build the Nanbeige4.2-3B
shape (by shape only: no weights) and plan a mesh on one device."""

from pathlib import Path

import jax
import pytest

from jaxloop.config import CONFIGS_DIR, load_config_file, validate, validate_mesh
from jaxloop.io.hf import abstract_model
from jaxloop.train.build import actor_config

CONFIG_FILES = sorted(p.name for p in Path(CONFIGS_DIR).glob("*.py"))


def test_there_are_configs():
    assert {"ppo.py", "grpo.py", "dppo.py", "flow_dppo.py"} <= set(CONFIG_FILES)
    assert {f"nanbeige_3b_{a}.py" for a in ("ppo", "grpo", "dppo", "flow_dppo")} <= set(
        CONFIG_FILES
    )


@pytest.mark.parametrize("name", CONFIG_FILES)
def test_config_loads_and_validates(name):
    cfg = load_config_file(name)
    validate(cfg)
    model_cfg = actor_config(cfg)
    with cfg.unlocked():
        cfg.mesh.fsdp = 1  # one device: the mesh must fit whatever the file says of the batch
    validate_mesh(cfg, 1, model_cfg)
    if name.startswith("nanbeige_3b_"):
        model = abstract_model(model_cfg)
        params = sum(x.size for x in jax.tree.leaves(model))
        assert params == 4_169_800_704  # shared/fixtures/nanbeige4.2-3b/tensors.json
        assert (model_cfg.head_dim, model_cfg.num_loops) == (128, 2)
        assert cfg.offload.critic and (cfg.model.logits_chunk or 0) > 0
