"""jaxloop.families: jax-free family modules, the discovering registry, and a throwaway third
family added as one file."""

from __future__ import annotations

import functools
import subprocess
import sys
import textwrap

import pytest

from jaxloop import families
from jaxloop.families.tables import expand
from jaxloop.io.hf import abstract_model
from jaxloop.io.hf_walk import expected_hf_shape, hf_entries
from jaxloop.models import LoopedConfig


def test_families_import_without_jax_or_torch():
    code = (
        "import sys, jaxloop.families as f; f.hf_tensor_shapes; "
        "print(sorted(m for m in ('jax', 'flax', 'torch') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize("family", ["nanbeige", "ouro"])
@pytest.mark.parametrize("role", ["actor", "critic"])
def test_table_shapes_equal_model_shapes(family, role):
    """The tables' config-dimension shapes (what the vLLM plugin loads) equal the HF shapes of
    the JAX model's parameters, name for name."""
    cfg = LoopedConfig.from_hf_dict(families.tiny_hf_config(family, num_key_value_heads=1))
    assert families.hf_tensor_shapes(cfg, role) == model_hf_shapes(cfg, role)


def model_hf_shapes(cfg, role):
    """HF name -> shape from the abstract JAX model's parameter shapes (not the table's dims)."""
    model = abstract_model(cfg, role)
    shape = lambda path: functools.reduce(getattr, path, model).shape  # noqa: E731
    return {t.name: expected_hf_shape(shape(t.path), t) for t in hf_entries(cfg, role)}


_EXTRA_NORM_FAMILY = '''
"""Throwaway family for a test: Nanbeige with one extra norm per layer."""
from jaxloop.families import nanbeige
from jaxloop.families.tables import TensorMap

FAMILY = "nanbeige_extra_norm"
LOOP_KEY = "num_loops"
SANDWICH_NORM = False
EARLY_EXIT_GATE = False
BACKBONE_TABLE = nanbeige.BACKBONE_TABLE + [
    TensorMap("model.layers.{layer}.extra_norm.weight", ("blocks", "extra_norm"), "copy",
              ("e",), True),
]


def _read(hf):
    fields = nanbeige.read_nanbeige(hf)
    fields["family"] = FAMILY
    return fields


HF_READERS = {"nanbeige_extra_norm": _read}


def hf_keys(cfg):
    keys = nanbeige.hf_keys(cfg)
    keys.update(architectures=["NanbeigeExtraNormForCausalLM"], model_type=FAMILY)
    return keys


TINY_HF_KEYS = {**nanbeige.TINY_HF_KEYS, "model_type": FAMILY, "num_loops": 3}
'''


@pytest.fixture
def extra_family(tmp_path, monkeypatch):
    """The throwaway family as one file in a directory added to the package's path."""
    (tmp_path / "nanbeige_extra_norm.py").write_text(textwrap.dedent(_EXTRA_NORM_FAMILY))
    monkeypatch.setattr(families, "__path__", [*families.__path__, str(tmp_path)])
    families.discover()
    yield "nanbeige_extra_norm"
    monkeypatch.undo()
    sys.modules.pop("jaxloop.families.nanbeige_extra_norm", None)
    families.discover()


def test_third_family_is_one_file(extra_family):
    assert families.names() == ["nanbeige", "nanbeige_extra_norm", "ouro"]
    hf = families.tiny_hf_config(extra_family)
    cfg = LoopedConfig.from_hf_dict(hf)
    assert (cfg.family, cfg.num_loops, cfg.num_layers) == (extra_family, 3, 2)

    names = [t.name for t in expand(families.hf_table(extra_family), cfg)]
    base = [t.name for t in expand(families.hf_table("nanbeige"), cfg)]
    extra = [f"model.layers.{i}.extra_norm.weight" for i in range(cfg.num_layers)]
    assert sorted(names) == sorted(base + extra)
    shapes = families.hf_tensor_shapes(cfg)
    assert shapes["model.layers.1.extra_norm.weight"] == (cfg.hidden_size,)
    assert shapes["model.layers.0.self_attn.k_proj.weight"] == (2 * 16, 32)

    # config.json round trip: kept keys, and the family's writer for a config built in code
    assert cfg.to_hf_dict() == {**hf, "head_dim": cfg.head_dim}
    written = cfg.replace(hf_config={}).to_hf_dict()
    assert written["model_type"] == extra_family
    assert LoopedConfig.from_hf_dict(written) == cfg


def test_unknown_family_and_model_type_are_refused():
    with pytest.raises(families.ConfigError, match="unknown family 'mistral'"):
        families.tiny_hf_config("mistral")
    with pytest.raises(families.ConfigError, match="model_type='mistral' is not supported"):
        LoopedConfig.from_hf_dict({**families.tiny_hf_config("nanbeige"), "model_type": "mistral"})
