"""scripts/bench_model.py: its FLOP accounting and configs (the timing itself runs by hand)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import jax
import numpy as np
from flax import nnx

from jaxloop.io.hf import abstract_model
from jaxloop.models import LoopedConfig

_PATH = Path(__file__).resolve().parents[2] / "scripts" / "bench_model.py"
_spec = importlib.util.spec_from_file_location("bench_model", _PATH)
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)


def test_flops_match_the_shared_anchor_for_nanbeige_3b():
    # shared/bench/h200-2026-11-30.json (looped_anchor.py): batch 4 x seq 2048,
    # block_params 143,130,624, model_flops_per_step 361,846,699,720,704.
    cfg = LoopedConfig.from_hf_dict(bench.hf_config("nanbeige-3b"))
    flops, per_layer = bench.flops_per_step(cfg, batch=4, seq=2048)
    assert per_layer == 143_130_624
    assert flops == 361_846_699_720_704.0
    model = abstract_model(cfg)
    assert bench.matmul_params_per_layer(model) == per_layer
    # the released checkpoint's parameter count (shared/fixtures/nanbeige4.2-3b/tensors.json)
    n = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    assert n == 4_169_800_704


def test_ouro_flops_count_four_loops():
    cfg = LoopedConfig.from_hf_dict(bench.hf_config("ouro-1.4b"))
    assert (cfg.num_loops, cfg.head_dim, cfg.num_layers) == (4, 128, 24)
    one_loop, _ = bench.flops_per_step(cfg.replace(num_loops=1), 1, 128)
    four, per_layer = bench.flops_per_step(cfg, 1, 128)
    lm_head = 6 * 128 * cfg.hidden_size * cfg.vocab_size
    assert four - lm_head == 4 * (one_loop - lm_head)
    assert per_layer == bench.matmul_params_per_layer(abstract_model(cfg))


def test_bad_config_is_one_line_error(capsys):
    assert bench.main(["--config", "no-such-model"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no-such-model" in err


def test_packing_mode_reports_both_layouts_with_equal_losses(capsys):
    argv = ["--config", "tiny", "--packing", "--batch", "8", "--seq", "64", "--steps", "1"]
    assert bench.main([*argv, "--repeats", "1", "--dtype", "float32"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert abs(result["packed_loss"] - result["padded_loss"]) <= 1e-5  # the same tokens
    assert result["packed_fill"] > result["padded_fill"]
    assert result["padded_tokens_per_s"] > 0 and result["packed_tokens_per_s"] > 0
