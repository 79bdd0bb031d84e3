"""HF safetensors import/export: bit-exact round trips, sharding, config keys, tokenizer files,
the critic role, rejection of bad checkpoints/configs, and full-size shapes from the fixtures.

Tensors are read back with the `safetensors` package (not jaxloop's own reader) and compared by
name, shape, dtype and raw bytes.
"""

from __future__ import annotations

import json
import tracemalloc
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from safetensors.torch import load_file, save_file

from jaxloop.families import hf_tensor_shapes
from jaxloop.io import safetensors as st
from jaxloop.io.hf import CheckpointError, abstract_model, load_hf, save_hf
from jaxloop.io.hf_walk import iter_hf
from jaxloop.models import ConfigError, LoopedConfig, LoopedLM, tiny_hf_config
from tests.models.helpers import FP32_REL_TOL, check_rel, random_ids
from tests.models.torch_reference import (
    random_hf_tensors,
    reference_forward,
    write_random_checkpoint,
)

REPO_ROOT = Path(__file__).resolve().parents[2]
SHARED = (REPO_ROOT / ".." / "shared").resolve()
INDEX = "model.safetensors.index.json"
TORCH_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


# ---- helpers -------------------------------------------------------------------------------------
def read_dir(path: Path) -> tuple[dict[str, torch.Tensor], list[str]]:
    """All tensors of an HF dir (sharded or single file) and the safetensors file names.

    For a sharded dir, also checks that the index maps every tensor to the file holding it."""
    path = Path(path)
    if (path / INDEX).is_file():
        index = json.loads((path / INDEX).read_text())
        weight_map = index["weight_map"]
        files = sorted(set(weight_map.values()))
        tensors: dict[str, torch.Tensor] = {}
        for f in files:
            shard = load_file(str(path / f))
            assert sorted(shard) == sorted(n for n, g in weight_map.items() if g == f), f
            assert not set(shard) & set(tensors)
            tensors.update(shard)
        assert sorted(tensors) == sorted(weight_map)
        return tensors, files
    return load_file(str(path / "model.safetensors")), ["model.safetensors"]


def assert_bit_exact(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want), set(got) ^ set(want)
    for name, w in want.items():
        g = got[name]
        assert g.dtype == w.dtype, (name, g.dtype, w.dtype)
        assert tuple(g.shape) == tuple(w.shape), (name, g.shape, w.shape)
        gb = g.contiguous().view(torch.uint8)
        wb = w.contiguous().view(torch.uint8)
        assert torch.equal(gb, wb), f"{name}: bytes differ"


def write_dir(path: Path, hf: dict, tensors: dict[str, torch.Tensor]) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(hf))
    return path


def params_of(model) -> dict:
    return {k: np.asarray(v[...]) for k, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}


# ---- round trips ---------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("family", ["nanbeige", "ouro"])
def test_round_trip_bit_exact(tmp_path, family, dtype):
    src = tmp_path / "src"
    hf, tensors = write_random_checkpoint(src, family, seed=5, dtype=TORCH_DTYPES[dtype])
    model = load_hf(src, dtype=dtype)
    assert model.config.param_dtype == dtype
    written = load_file(str(src / "model.safetensors"))
    total_bytes = sum(t.numel() * t.element_size() for t in written.values())

    # single file
    single = save_hf(model, tmp_path / "single", dtype=dtype)
    assert sorted(p.name for p in single.iterdir()) == ["config.json", "model.safetensors"]
    got, _ = read_dir(single)
    assert_bit_exact(got, written)

    # sharded: a small limit gives several files, each within the limit (no tensor exceeds it)
    limit = 20_000
    sharded = save_hf(model, tmp_path / "sharded", dtype=dtype, max_shard_size="20KB")
    got, files = read_dir(sharded)
    assert_bit_exact(got, written)
    n = len(files)
    assert n >= 3, files
    assert files == [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    assert not (sharded / "model.safetensors").exists()
    for f in files:
        shard = load_file(str(sharded / f))
        assert sum(t.numel() * t.element_size() for t in shard.values()) <= limit, f
    index = json.loads((sharded / INDEX).read_text())
    assert index["metadata"]["total_size"] == total_bytes

    # the sharded export loads back to the same parameters (bit-exact)
    again = load_hf(sharded, dtype=dtype)
    want_params = params_of(model)
    for k, v in params_of(again).items():
        assert v.dtype == want_params[k].dtype
        np.testing.assert_array_equal(
            v.reshape(-1).view(np.uint8), want_params[k].reshape(-1).view(np.uint8), err_msg=str(k)
        )

    # config: every original key kept (same value), head_dim explicit, torch_dtype = export dtype
    out_cfg = json.loads((sharded / "config.json").read_text())
    for key, value in hf.items():
        assert key in out_cfg, key
        if key != "torch_dtype":
            assert out_cfg[key] == value, key
    assert out_cfg["torch_dtype"] == dtype
    assert out_cfg["head_dim"] == 16
    assert "jaxloop_role" not in out_cfg


def test_head_dim_written_explicitly(tmp_path):
    hf = tiny_hf_config("nanbeige", loop_loss_weights=[1.0, 0.5], custom_key={"a": [1, 2]})
    del hf["head_dim"]  # default: hidden / heads = 8
    write_random_checkpoint(tmp_path / "src", hf_config=hf, seed=1)
    model = load_hf(tmp_path / "src")
    assert model.config.head_dim == 8
    out = save_hf(model, tmp_path / "out", dtype="float32")
    out_cfg = json.loads((out / "config.json").read_text())
    assert out_cfg["head_dim"] == 8
    assert {k: v for k, v in out_cfg.items() if k != "head_dim"} == hf  # nothing else changed


@pytest.mark.parametrize("family", ["nanbeige", "ouro"])
def test_numerics_rebuild_the_config_from_its_hf_dict(family):
    """What a remote JAX engine builds from (to_hf_dict + numerics) is the trainer's config,
    every non-default numerics field included (a dropped scan_layers ran another program)."""
    cfg = LoopedConfig.from_hf_dict(tiny_hf_config(family)).replace(
        param_dtype="bfloat16",
        compute_dtype="float16",
        remat="dots",
        attention_impl="cudnn",
        scan_layers=False,
    )
    rebuilt = LoopedConfig.from_hf_dict(cfg.to_hf_dict()).replace(**cfg.numerics())
    assert rebuilt == cfg
    assert LoopedConfig.from_hf_dict(cfg.to_hf_dict()) != cfg  # the dict alone drops them


def test_fixture_config_keys_survive(tmp_path):
    """The released configs' keys (auto_map, kv_channels, ...) are all written back unchanged."""
    if not SHARED.is_dir():
        pytest.skip(f"shared fixtures dir {SHARED} (../shared from the repo root) is absent")
    for name in ("nanbeige4.2-3b", "ouro-1.4b"):
        original = json.loads((SHARED / "fixtures" / name / "config.json").read_text())
        out = LoopedConfig.from_hf_dir(SHARED / "fixtures" / name).to_hf_dict()
        for key, value in original.items():
            assert out[key] == value, (name, key)
        assert out["head_dim"] == original.get("head_dim", 2048 // 16)


def test_tokenizer_files_copied(tmp_path):
    write_random_checkpoint(tmp_path / "src", "nanbeige", seed=2)
    model = load_hf(tmp_path / "src")
    tok = tmp_path / "tok"
    tok.mkdir()
    contents = {
        "tokenizer.json": '{"model": {"type": "BPE"}}',
        "tokenizer_config.json": '{"chat_template": "{{ x }}"}',
        "special_tokens_map.json": '{"eos_token": "</s>"}',
        "generation_config.json": '{"eos_token_id": 2}',
    }
    for name, text in contents.items():
        (tok / name).write_text(text)
    (tok / "unrelated.bin").write_bytes(b"\0\1")
    out = save_hf(model, tmp_path / "out", tokenizer_dir=tok)
    for name, text in contents.items():
        assert (out / name).read_text() == text, name
    assert not (out / "unrelated.bin").exists()
    # no tokenizer_dir: no tokenizer files
    plain = save_hf(model, tmp_path / "plain")
    assert not (plain / "tokenizer.json").exists()


def test_save_refuses_non_empty_dir(tmp_path):
    write_random_checkpoint(tmp_path / "src", "nanbeige", seed=2)
    model = load_hf(tmp_path / "src")
    save_hf(model, tmp_path / "out")
    with pytest.raises(FileExistsError):
        save_hf(model, tmp_path / "out")
    save_hf(model, tmp_path / "out", overwrite=True)
    assert (tmp_path / "out" / "model.safetensors").is_file()


def _random_model(seed: int = 0, **hf) -> LoopedLM:
    """A float32 model with random values everywhere (numpy: no init compile)."""
    cfg = LoopedConfig.from_hf_dict(tiny_hf_config("nanbeige", **hf))
    graphdef, params, rest = nnx.split(abstract_model(cfg), nnx.Param, ...)
    rng = np.random.default_rng(seed)
    values = jax.tree.map(
        lambda x: jnp.asarray(rng.normal(0.0, 0.5, x.shape).astype(x.dtype)),
        nnx.to_pure_dict(params),
    )
    nnx.replace_by_pure_dict(params, values)
    return nnx.merge(graphdef, params, rest)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_streamed_shards_equal_whole_shard_writes(tmp_path, dtype):
    """save_hf streams each tensor into a header planned from shapes; every file must be the
    bytes that writing the shard's tensors at once (write_file, the old path) gives."""
    model = _random_model(seed=1)
    out = save_hf(model, tmp_path / "out", dtype=dtype, max_shard_size="20KB")
    weight_map = json.loads((out / INDEX).read_text())["weight_map"]
    np_dtype = np.dtype(jnp.dtype(dtype))
    shards: dict[str, dict[str, np.ndarray]] = {}
    for name, arr in iter_hf(model, model.config, "actor"):
        shards.setdefault(weight_map[name], {})[name] = arr.astype(np_dtype)
    assert len(shards) >= 3
    for file, tensors in shards.items():
        st.write_file(tmp_path / "want.safetensors", tensors)
        want = (tmp_path / "want.safetensors").read_bytes()
        assert (out / file).read_bytes() == want, file


def test_save_hf_holds_one_tensor_at_a_time(tmp_path):
    """Host memory that save_hf allocates (numpy buffers are traced by tracemalloc; the model's
    own arrays are not) stays near one tensor, not the shard: 5.1 MB of float32 tensors, the
    largest 0.5 MB; measured peak 0.8 MB (collecting the shard first: 5.6 MB)."""
    model = _random_model(
        hidden_size=64, intermediate_size=2048, num_hidden_layers=3, vocab_size=512
    )
    shapes = hf_tensor_shapes(model.config)
    total = 4 * sum(int(np.prod(s)) for s in shapes.values())
    assert total > 5_000_000
    tracemalloc.start()
    try:
        save_hf(model, tmp_path / "out", dtype="float32")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < total / 2, (peak, total)
    assert len(list((tmp_path / "out").glob("*.safetensors"))) == 1


def test_progress_bars_only_when_asked(tmp_path, capsys):
    model = _random_model(seed=2)
    save_hf(model, tmp_path / "quiet", max_shard_size="20KB")
    load_hf(tmp_path / "quiet")
    assert capsys.readouterr().err == ""
    save_hf(model, tmp_path / "loud", dtype="float32", max_shard_size="20KB", progress=True)
    err = capsys.readouterr().err
    assert "writing HF" in err and "\n" not in err  # erased when done: no line left behind
    again = load_hf(tmp_path / "loud", progress=True)
    err = capsys.readouterr().err
    assert "reading HF" in err and "\n" not in err
    for a, b in zip(
        jax.tree.leaves(nnx.state(again, nnx.Param)),
        jax.tree.leaves(nnx.state(model, nnx.Param)),
        strict=True,
    ):
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes()


@pytest.mark.parametrize("family", ["nanbeige", "ouro"])
def test_load_hf_reads_in_slices(tmp_path, monkeypatch, family):
    """Tensors read a few rows at a time (every layout: transposed, head-split, rows, scalars;
    bf16 -> f32 casts and f32 -> f32 straight reads) give the same parameters as whole reads."""
    from jaxloop.io import hf as hf_io

    src = tmp_path / "src"
    write_random_checkpoint(src, family, seed=8, dtype=torch.bfloat16)
    whole = {dtype: params_of(load_hf(src, dtype=dtype)) for dtype in ("float32", "bfloat16")}
    save_hf(load_hf(src, dtype="float32"), tmp_path / "f32", dtype="float32")
    reads = []
    fill = hf_io._fill
    monkeypatch.setattr(hf_io, "READ_CHUNK_BYTES", 100)
    monkeypatch.setattr(hf_io, "_fill", lambda f, *a: (reads.append(f), fill(f, *a))[1])
    for name, d in (("bf16", src), ("f32", tmp_path / "f32")):
        for dtype in ("float32", "bfloat16"):
            got = params_of(load_hf(d, dtype=dtype))
            assert got.keys() == whole[dtype].keys()
            for k, v in got.items():
                assert v.dtype == whole[dtype][k].dtype, (name, dtype, k)
                assert v.tobytes() == whole[dtype][k].tobytes(), (name, dtype, k)
    assert len(reads) == 4 * len(hf_tensor_shapes(LoopedConfig.from_hf_dir(src)))


def test_load_hf_on_a_mesh(tmp_path):
    """mesh=make_mesh(fsdp=8): each parameter straight onto the NamedSharding of its logical
    axes (8 fake CPU devices), values equal to the unsharded load."""
    from jaxloop.parallel.mesh import logical_to_spec, make_mesh

    write_random_checkpoint(tmp_path / "src", "ouro", seed=9, dtype=torch.bfloat16)
    mesh = make_mesh(fsdp=8)
    plain = dict(nnx.to_flat_state(nnx.state(load_hf(tmp_path / "src"), nnx.Param)))
    sharded = load_hf(tmp_path / "src", mesh=mesh)
    got = dict(nnx.to_flat_state(nnx.state(sharded, nnx.Param)))
    assert sorted(got) == sorted(plain)
    specs = set()
    for path, var in got.items():
        want = jax.sharding.NamedSharding(mesh, logical_to_spec(var.logical_axes, var.shape, mesh))
        array = var[...]
        assert array.sharding == want, path
        assert len(array.sharding.device_set) == 8
        specs.add(tuple(want.spec))
        assert np.asarray(array).tobytes() == np.asarray(plain[path][...]).tobytes(), path
    assert {(None, "fsdp"), ("fsdp", None), (None, "fsdp", None)} <= specs  # embed, lm_head, MLP
    assert sharded.config == load_hf(tmp_path / "src").config


def test_load_hf_uses_no_deprecated_variable_api(tmp_path):
    """flax 0.12 deprecates `variable.value = ...` (a DeprecationWarning on every parameter)."""
    save_hf(_random_model(seed=3), tmp_path / "m", dtype="float32")
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=r"'\.value'", category=DeprecationWarning)
        model = load_hf(tmp_path / "m")
    assert model.embed[...].dtype == jnp.float32


# ---- critic role ---------------------------------------------------------------------------------
def test_critic_export_import(tmp_path):
    src = tmp_path / "src"
    hf, tensors = write_random_checkpoint(src, "ouro", seed=7, role="critic")
    critic = load_hf(src, dtype="float32")
    assert critic.role == "critic" and not hasattr(critic, "lm_head")
    e = hf["hidden_size"]
    assert tuple(tensors["value_head.weight"].shape) == (1, e)
    assert tuple(tensors["value_head.bias"].shape) == (1,)

    ids = random_ids(hf["vocab_size"], (2, 6), 7)
    values = critic(ids)
    assert values.shape == (2, 6)
    ref = reference_forward(tensors, hf, ids)
    check_rel("hf_io critic values", values, ref["values"], FP32_REL_TOL)

    out = save_hf(critic, tmp_path / "out", dtype="float32", max_shard_size="30KB")
    got, files = read_dir(out)
    assert len(files) > 1
    assert "lm_head.weight" not in got
    assert tuple(got["value_head.weight"].shape) == (1, e)
    assert tuple(got["value_head.bias"].shape) == (1,)
    assert_bit_exact(got, load_file(str(src / "model.safetensors")))
    assert json.loads((out / "config.json").read_text())["jaxloop_role"] == "critic"
    assert load_hf(out).role == "critic"


def test_fresh_critic_export(tmp_path):
    """A critic built in jaxloop (not loaded) exports its value head and role, and loads back.
    (Actor exports dropping the role key are checked in test_round_trip_bit_exact.)"""
    cfg = LoopedConfig.from_hf_dict(tiny_hf_config("nanbeige"))
    critic = LoopedLM(cfg, rngs=nnx.Rngs(0), role="critic")
    critic.value_head[...] = jnp.arange(cfg.hidden_size, dtype=jnp.float32) / 10
    critic.value_bias[...] = jnp.float32(0.5)
    out = save_hf(critic, tmp_path / "critic", dtype="float32")
    assert json.loads((out / "config.json").read_text())["jaxloop_role"] == "critic"
    got, _ = read_dir(out)
    assert set(hf_tensor_shapes(cfg, "critic")) == set(got)
    back = load_hf(out)
    assert back.role == "critic"
    np.testing.assert_array_equal(
        np.asarray(back.value_head[...]), np.asarray(critic.value_head[...])
    )
    assert float(back.value_bias[...]) == 0.5


# ---- bad checkpoints -----------------------------------------------------------------------------
K_PROJ_1 = "model.layers.1.self_attn.k_proj.weight"  # HF shape [2 * 16, 32]


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    hf = tiny_hf_config("ouro")
    tensors = {k: v.float() for k, v in random_hf_tensors(hf, seed=3).items()}
    return hf, tensors, tmp_path_factory


def _variant(good, name, edit):
    hf, tensors, factory = good
    tensors = dict(tensors)
    edit(tensors)
    return write_dir(factory.mktemp(name), hf, tensors)


@pytest.mark.parametrize(
    "name,edit,bad_tensor",
    [
        ("unknown", lambda t: t.update({"model.layers.0.mlp.extra.weight": torch.ones(4)}),
         "model.layers.0.mlp.extra.weight"),
        ("missing", lambda t: t.pop("model.layers.1.post_attention_layernorm_2.weight"),
         "model.layers.1.post_attention_layernorm_2.weight"),
        ("missing_head", lambda t: t.pop("lm_head.weight"), "lm_head.weight"),
        ("shape", lambda t: t.update({K_PROJ_1: torch.ones(16, 32)}), K_PROJ_1),
        ("shape_t", lambda t: t.update({"lm_head.weight": torch.ones(32, 64)}), "lm_head.weight"),
        ("shape_gate", lambda t: t.update({"model.early_exit_gate.weight": torch.ones(32)}),
         "model.early_exit_gate.weight"),
        ("shape_norm", lambda t: t.update({"model.norm.weight": torch.ones(31)}),
         "model.norm.weight"),
    ],
)  # fmt: skip
def test_bad_checkpoint_names_the_tensor(good, name, edit, bad_tensor):
    path = _variant(good, name, edit)
    with pytest.raises(CheckpointError, match=bad_tensor.replace(".", r"\.")):
        load_hf(path)


def test_inv_freq_extras_ignored(good):
    hf, tensors, _ = good
    extras = {
        f"model.layers.{i}.self_attn.rotary_emb.inv_freq": torch.ones(hf["head_dim"] // 2)
        for i in range(hf["num_hidden_layers"])
    }
    path = _variant(good, "inv_freq", lambda t: t.update(extras))
    clean = _variant(good, "clean", lambda t: None)
    a, b = params_of(load_hf(path)), params_of(load_hf(clean))
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_array_equal(a[k], b[k])


# ---- bad configs ---------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "family,change,key",
    [
        ("nanbeige", {"enable_double_loop_split": True}, "enable_double_loop_split"),
        ("nanbeige", {"loop_share_kv": True}, "loop_share_kv"),
        ("nanbeige", {"rope_scaling": {"type": "linear", "factor": 2.0}}, "rope_scaling"),
        ("ouro", {"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "rope_scaling"),
        ("nanbeige", {"rope_parameters": {"rope_type": "yarn", "factor": 4.0}}, "rope_parameters"),
        ("nanbeige", {"tie_word_embeddings": True}, "tie_word_embeddings"),
        ("ouro", {"tie_word_embeddings": True}, "tie_word_embeddings"),
        ("nanbeige", {"model_type": "gpt2"}, "model_type"),
    ],
)
def test_config_errors(tmp_path, family, change, key):
    hf = tiny_hf_config(family)
    with pytest.raises(ConfigError, match=key):
        LoopedConfig.from_hf_dict({**hf, **change})
    # through load_hf too, with otherwise valid tensors
    tensors = {k: v.float() for k, v in random_hf_tensors(hf, seed=0).items()}
    path = write_dir(tmp_path / "bad", {**hf, **change}, tensors)
    with pytest.raises(ConfigError, match=key):
        load_hf(path)


def test_rope_parameters_theta_is_read():
    """transformers >= 5 writes rope_theta inside rope_parameters (default rope_type)."""
    hf = tiny_hf_config("nanbeige")
    del hf["rope_theta"]
    hf["rope_parameters"] = {"rope_type": "default", "rope_theta": 123.0}
    assert LoopedConfig.from_hf_dict(hf).rope_theta == 123.0


# ---- full-size models, by shape only -------------------------------------------------------------
FULL = {
    # fixture dir: (tensor count, parameter count, vocab, loops)
    "nanbeige4.2-3b": (201, 4_169_800_704, 166144, 2),
    "ouro-1.4b": (269, 1_434_652_673, 49152, 4),
}


@pytest.fixture(scope="module", params=sorted(FULL))
def full_size(request):
    if not SHARED.is_dir():
        pytest.skip(f"shared fixtures dir {SHARED} (../shared from the repo root) is absent")
    d = SHARED / "fixtures" / request.param
    fixture = json.loads((d / "tensors.json").read_text())
    return request.param, LoopedConfig.from_hf_dir(d), fixture


def test_full_size_tensor_shapes(full_size):
    name, cfg, fixture = full_size
    n_tensors, n_params, _, loops = FULL[name]
    assert cfg.num_loops == loops
    want = {k: tuple(v) for k, v in fixture["tensors"].items()}
    got = hf_tensor_shapes(cfg)
    assert got == want
    assert len(got) == n_tensors == fixture["num_tensors"]
    total = sum(int(np.prod(s)) for s in got.values())
    assert total == n_params == fixture["num_params"]
    assert 2 * total == fixture["total_bytes"]  # bf16
    # the critic swaps lm_head [V, E] for value_head [1, E] + bias [1]
    critic = hf_tensor_shapes(cfg, "critic")
    assert set(critic) == (set(want) - {"lm_head.weight"}) | {
        "value_head.weight",
        "value_head.bias",
    }
    assert critic["value_head.weight"] == (1, cfg.hidden_size)


def test_full_size_forward_shape(full_size):
    """jax.eval_shape of the full bf16 model's forward: no weights allocated."""
    name, cfg, _ = full_size
    _, _, vocab, loops = FULL[name]
    cfg = cfg.replace(param_dtype="bfloat16", compute_dtype="bfloat16")
    graphdef, state = nnx.split(abstract_model(cfg))

    def forward(state, ids):
        out = nnx.merge(graphdef, state).forward(ids, return_loops=True)
        return out.logits, out.loop_logits, out.exit_probs

    b, s = 2, 16
    logits, loop_logits, exit_probs = jax.eval_shape(
        forward, state, jax.ShapeDtypeStruct((b, s), jnp.int32)
    )
    assert logits.shape == (b, s, vocab) and logits.dtype == jnp.float32
    assert loop_logits.shape == (loops, b, s, vocab)
    if cfg.early_exit_gate:
        assert exit_probs.shape == (loops, b, s)
    else:
        assert exit_probs is None
    if name.startswith("nanbeige"):
        assert logits.shape == (b, s, 166144)
