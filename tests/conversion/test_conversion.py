"""Orbax model checkpoints (jaxloop.io.orbax) and the conversion CLIs.

HF -> from_hf -> to_hf -> HF must give back the same tensors byte for byte (names, shapes,
dtypes, bytes, read with hf_io.read_safetensors), and the orbax run dir must restore to a model
whose outputs equal those of the model loaded straight from HF. Bad inputs: exit code 2, one
"error: ..." line on stderr naming the problem, and no output directory left behind.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import orbax.checkpoint as ocp
import pytest
from flax import nnx

from conversion import from_hf, to_hf
from jaxloop.families import hf_tensor_shapes
from jaxloop.io.hf import (
    INDEX_FILE,
    abstract_model,
    load_hf,
    read_safetensors,
    save_hf,
    write_safetensors,
)
from jaxloop.io.orbax import (
    CHECKPOINT_DIR,
    TOKENIZER_DIR,
    RunDirError,
    config_file,
    latest_step,
    params_item,
    read_config,
    restore_model,
    save_model,
)
from jaxloop.models import LoopedConfig, LoopedLM, tiny_hf_config
from jaxloop.parallel.mesh import logical_to_spec, make_mesh

REPO = Path(__file__).resolve().parents[2]
PYTHON = str(REPO / ".venv" / "bin" / "python")
if not Path(PYTHON).exists():
    PYTHON = sys.executable
NP_DTYPES = {"bfloat16": np.dtype(ml_dtypes.bfloat16), "float32": np.dtype(np.float32)}


def _tokenizer_json() -> str:
    """A real (two-word) tokenizer.json: to_hf loads the run's tokenizer for its EOS ids."""
    from tokenizers import Tokenizer, models

    return Tokenizer(models.WordLevel({"a": 0, "</s>": 1}, unk_token="a")).to_str()


TOKENIZER = {
    "tokenizer.json": _tokenizer_json(),
    "tokenizer_config.json": (
        '{"chat_template": "{{ messages }}", "eos_token": "</s>", '
        '"tokenizer_class": "PreTrainedTokenizerFast"}'
    ),
}
IDS = np.array([[3, 17, 5, 60, 2, 9, 33, 1], [8, 8, 41, 0, 12, 63, 7, 4]], np.int32)


# ---- fixtures --------------------------------------------------------------------------------
def write_hf_dir(
    path: Path, family: str, role: str, dtype: str, seed: int = 0, n_shards: int = 3, **hf
) -> dict[str, np.ndarray]:
    """An HF checkpoint written directly with write_safetensors (random values for every tensor,
    norms included), split over `n_shards` files with an index, plus tokenizer files."""
    path.mkdir(parents=True)
    config = tiny_hf_config(family, torch_dtype=dtype, **hf)
    if role == "critic":
        config["jaxloop_role"] = "critic"
    (path / "config.json").write_text(json.dumps(config, indent=2))
    shapes = hf_tensor_shapes(LoopedConfig.from_hf_dict(config), role)
    rng = np.random.default_rng(seed)
    tensors = {
        name: rng.normal(0.0, 0.5, shape).astype(NP_DTYPES[dtype]) for name, shape in shapes.items()
    }
    names = list(tensors)
    groups = [names[i::n_shards] for i in range(n_shards)]
    files = [f"model-{i + 1:05d}-of-{n_shards:05d}.safetensors" for i in range(n_shards)]
    for file, group in zip(files, groups, strict=True):
        write_safetensors(path / file, {n: tensors[n] for n in group})
    weight_map = {n: f for f, group in zip(files, groups, strict=True) for n in group}
    (path / INDEX_FILE).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    for name, text in TOKENIZER.items():
        (path / name).write_text(text)
    return tensors


def read_hf_tensors(path: Path) -> dict[str, np.ndarray]:
    out = {}
    for file in sorted(path.glob("*.safetensors")):
        for name, arr in read_safetensors(file):
            assert name not in out, f"{name} appears twice"
            out[name] = np.array(arr)
    return out


def assert_same_tensors(got: dict[str, np.ndarray], want: dict[str, np.ndarray]) -> None:
    assert sorted(got) == sorted(want)
    for name, arr in want.items():
        assert got[name].dtype == arr.dtype, name
        assert got[name].shape == arr.shape, name
        assert got[name].tobytes() == arr.tobytes(), name


@nnx.jit
def _forward(model: LoopedLM, ids: jax.Array) -> jax.Array:
    return model(ids)


def outputs(model: LoopedLM) -> np.ndarray:
    """Logits (actor) or values (critic), float32, from one jitted forward (cached per config)."""
    return np.asarray(_forward(model, jnp.asarray(IDS)))


def only_entries(parent: Path) -> list[str]:
    return sorted(p.name for p in parent.iterdir())


# ---- round trip ------------------------------------------------------------------------------
CASES = [
    ("nanbeige", "actor", "bfloat16"),
    ("ouro", "actor", "float32"),
    ("nanbeige", "critic", "float32"),
    ("ouro", "critic", "bfloat16"),
]


@pytest.mark.parametrize("family,role,dtype", CASES)
def test_round_trip_is_bit_exact(tmp_path, capsys, family, role, dtype):
    hf_in, run, hf_out = tmp_path / "hf_in", tmp_path / "run", tmp_path / "hf_out"
    tensors = write_hf_dir(hf_in, family, role, dtype)

    assert from_hf.main(["--hf-dir", str(hf_in), "--out", str(run)]) == 0
    assert sorted(only_entries(run)) == sorted([CHECKPOINT_DIR, config_file(role), TOKENIZER_DIR])
    assert (run / CHECKPOINT_DIR / "0" / params_item(role)).is_dir()
    assert latest_step(run) == 0
    for name, text in TOKENIZER.items():
        assert (run / TOKENIZER_DIR / name).read_text() == text
    # no temp dir left beside the output
    assert only_entries(tmp_path) == ["hf_in", "run"]

    # the run dir restores to the same model, dtype kept (auto never upcasts)
    restored = restore_model(run, role=role)
    reference = load_hf(hf_in, dtype=None)
    assert restored.role == role and restored.config.param_dtype == dtype
    assert restored.embed[...].dtype == jnp.dtype(dtype)
    for a, b in zip(
        jax.tree.leaves(nnx.state(restored, nnx.Param)),
        jax.tree.leaves(nnx.state(reference, nnx.Param)),
        strict=True,
    ):
        assert a.dtype == b.dtype and np.array_equal(np.asarray(a), np.asarray(b))
    np.testing.assert_array_equal(outputs(restored), outputs(reference))

    argv = ["--checkpoint", str(run), "--out", str(hf_out), "--role", role]
    assert to_hf.main([*argv, "--max-shard-size", "20KB"]) == 0
    assert len(list(hf_out.glob("*.safetensors"))) > 1
    weight_map = json.loads((hf_out / INDEX_FILE).read_text())["weight_map"]
    assert sorted(weight_map) == sorted(tensors)
    assert_same_tensors(read_hf_tensors(hf_out), tensors)
    assert json.loads((hf_out / "config.json").read_text()) == json.loads(
        (hf_in / "config.json").read_text()
    )
    for name, text in TOKENIZER.items():
        assert (hf_out / name).read_text() == text
    out = capsys.readouterr()
    assert out.err == ""
    assert f"{family} {role}" in out.out


def test_dtype_changes_are_exact_casts(tmp_path):
    """bf16 HF -> from_hf --dtype float32 (exact upcast) -> to_hf --dtype bfloat16 == input."""
    hf_in, run = tmp_path / "hf_in", tmp_path / "run"
    tensors = write_hf_dir(hf_in, "ouro", "actor", "bfloat16", seed=1)
    assert from_hf.main(["--hf-dir", str(hf_in), "--out", str(run), "--dtype", "float32"]) == 0
    model = restore_model(run)
    assert model.config.param_dtype == "float32"
    assert model.embed[...].dtype == jnp.float32
    assert np.array_equal(
        np.asarray(model.embed[...]), tensors["model.embed_tokens.weight"].astype(np.float32)
    )
    assert to_hf.main(["--checkpoint", str(run), "--out", str(tmp_path / "f32")]) == 0
    f32 = read_hf_tensors(tmp_path / "f32")
    assert_same_tensors(f32, {n: t.astype(np.float32) for n, t in tensors.items()})
    argv = ["--checkpoint", str(run), "--out", str(tmp_path / "bf16"), "--dtype", "bfloat16"]
    assert to_hf.main(argv) == 0
    assert_same_tensors(read_hf_tensors(tmp_path / "bf16"), tensors)
    # restore_model casts while reading: a float32 run read back as bf16
    bf16 = restore_model(run, dtype="bfloat16")
    assert bf16.config.param_dtype == bf16.config.compute_dtype == "bfloat16"
    assert np.asarray(bf16.embed[...]).tobytes() == tensors["model.embed_tokens.weight"].tobytes()


# ---- orbax_io --------------------------------------------------------------------------------
def _model(family: str, role: str, seed: int, dtype: str = "float32") -> LoopedLM:
    """A tiny model with random values in every parameter (numpy: no per-shape compiles)."""
    cfg = LoopedConfig.from_hf_dict(tiny_hf_config(family))
    cfg = cfg.replace(param_dtype=dtype, compute_dtype=dtype)
    graphdef, params, rest = nnx.split(abstract_model(cfg, role), nnx.Param, ...)
    rng = np.random.default_rng(seed)
    values = jax.tree.map(
        lambda x: jnp.asarray(rng.normal(0.0, 0.5, x.shape).astype(x.dtype)),
        nnx.to_pure_dict(params),
    )
    nnx.replace_by_pure_dict(params, values)
    return nnx.merge(graphdef, params, rest)


def _pure(model: LoopedLM) -> dict:
    return nnx.to_pure_dict(nnx.state(model, nnx.Param))


def test_restore_reads_only_the_params_item_among_trainer_items(tmp_path):
    """A step written like the trainer writes it (params + opt state + train state, several
    steps) restores one role's params alone, at the latest or a chosen step."""
    actor0, actor5 = _model("nanbeige", "actor", 0), _model("nanbeige", "actor", 5)
    critic5 = _model("nanbeige", "critic", 6)
    run = tmp_path / "run"
    save_model(run, actor0, step=0)
    save_model(run, critic5, step=1)  # writes critic_config.json (a critic-only step)
    opt = {"mu": jnp.ones((3, 4)), "count": jnp.array(7, jnp.int32)}
    with ocp.CheckpointManager(run / CHECKPOINT_DIR) as mngr:
        items = {
            "actor_params": ocp.args.StandardSave(_pure(actor5)),
            "actor_opt": ocp.args.StandardSave(opt),
            "critic_params": ocp.args.StandardSave(_pure(critic5)),
            "critic_opt": ocp.args.StandardSave(opt),
            "train_state": ocp.args.JsonSave({"update": 5}),
        }
        mngr.save(5, args=ocp.args.Composite(**items))
        mngr.wait_until_finished()
    assert latest_step(run) == 5

    cfg_json = json.loads((run / config_file("critic")).read_text())
    assert cfg_json["jaxloop_role"] == "critic"
    assert "jaxloop_role" not in json.loads((run / config_file("actor")).read_text())

    np.testing.assert_array_equal(outputs(restore_model(run)), outputs(actor5))
    np.testing.assert_array_equal(outputs(restore_model(run, step=0)), outputs(actor0))
    np.testing.assert_array_equal(outputs(restore_model(run, "critic")), outputs(critic5))
    assert not np.array_equal(outputs(actor0), outputs(actor5))  # the steps really differ

    with pytest.raises(RunDirError, match="step 1 .* has no actor_params item"):
        restore_model(run, step=1)
    with pytest.raises(RunDirError, match="no step 3"):
        restore_model(run, step=3)


def test_from_hf_output_restores_like_the_trainer_does(tmp_path):
    """from_hf writes numpy arrays through its own handler: a plain CheckpointManager with
    StandardRestore (what the trainer calls) must read them as jax arrays."""
    hf_in, run = tmp_path / "hf_in", tmp_path / "run"
    write_hf_dir(hf_in, "nanbeige", "actor", "bfloat16", seed=2)
    assert from_hf.main(["--hf-dir", str(hf_in), "--out", str(run)]) == 0
    reference = load_hf(hf_in, dtype=None)
    target = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), _pure(reference)
    )
    with ocp.CheckpointManager(run / CHECKPOINT_DIR) as mngr:
        got = mngr.restore(
            0, args=ocp.args.Composite(actor_params=ocp.args.StandardRestore(target))
        )["actor_params"]
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(_pure(reference)), strict=True):
        assert isinstance(a, jax.Array) and a.dtype == b.dtype
        assert np.array_equal(np.asarray(a), np.asarray(b))


def test_save_model_keeps_the_model_usable_without_donate(tmp_path):
    model = _model("nanbeige", "actor", 3, "bfloat16")
    before = outputs(model)
    save_model(tmp_path / "run", model, step=2)
    np.testing.assert_array_equal(outputs(model), before)
    restored = restore_model(tmp_path / "run", compute_dtype="float32", remat="full")
    assert restored.config.param_dtype == "bfloat16"
    assert restored.config.compute_dtype == "float32" and restored.config.remat == "full"
    assert not (tmp_path / "run" / TOKENIZER_DIR).exists()


def test_restore_places_parameters_on_the_given_sharding(tmp_path, capsys):
    """Parameters are restored one at a time, each onto `sharding`, cast to `dtype`."""
    model = _model("ouro", "critic", 8)
    save_model(tmp_path / "run", model, step=1)
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]), ("x",))
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    restored = restore_model(
        tmp_path / "run", "critic", dtype="bfloat16", sharding=sharding, progress=True
    )
    err = capsys.readouterr().err
    assert "restoring" in err and "\n" not in err  # the bar, erased when done
    want = jax.tree.leaves(_pure(model))
    got = jax.tree.leaves(_pure(restored))
    assert len(got) == len(want) > 10
    for a, b in zip(got, want, strict=True):
        assert a.sharding == sharding and a.dtype == jnp.bfloat16
        assert np.asarray(a).tobytes() == np.asarray(b).astype(NP_DTYPES["bfloat16"]).tobytes()


def test_restore_streams_parameters_larger_than_the_budget(tmp_path, monkeypatch):
    """A read budget smaller than the stacked parameters (like 1 GB against the real model's
    1.45 GB MLP weights) still restores, one parameter at a time: orbax's limiter never holds
    more than the largest parameter (what failed before: "Requested more bytes than we reserved
    space for")."""
    from orbax.checkpoint._src.serialization import limits

    model = _model("nanbeige", "actor", 11, "bfloat16")
    save_model(tmp_path / "run", model, step=0)
    sizes = [x.nbytes for x in jax.tree.leaves(_pure(model))]
    budget = 1000
    assert sum(s > budget for s in sizes) >= 5  # the stacked blocks (and embed, lm_head)

    requests, in_flight = [], [0, 0]  # [now, max]
    wait, release = (
        limits.LimitInFlightBytes.wait_for_bytes,
        limits.LimitInFlightBytes.release_bytes,
    )

    async def spy_wait(self, n):
        await wait(self, n)
        requests.append(n)
        in_flight[0] += n
        in_flight[1] = max(in_flight)

    async def spy_release(self, n):
        in_flight[0] -= n
        await release(self, n)

    monkeypatch.setattr(limits.LimitInFlightBytes, "wait_for_bytes", spy_wait)
    monkeypatch.setattr(limits.LimitInFlightBytes, "release_bytes", spy_release)
    restored = restore_model(tmp_path / "run", budget_bytes=budget)
    assert max(requests) > budget and len(requests) == len(sizes)
    assert in_flight == [0, max(sizes)]  # one parameter at a time, never the whole model
    for a, b in zip(jax.tree.leaves(_pure(restored)), jax.tree.leaves(_pure(model)), strict=True):
        assert a.dtype == b.dtype and np.asarray(a).tobytes() == np.asarray(b).tobytes()

    # sharded over 8 devices (one read per shard, each of the whole stored chunk): same values;
    # in flight, the largest parameter and a quarter at most
    in_flight[1] = 0
    sharded = restore_model(tmp_path / "run", budget_bytes=budget, mesh=make_mesh(fsdp=8))
    assert in_flight[0] == 0 and max(sizes) <= in_flight[1] <= 1.25 * max(sizes)
    for a, b in zip(jax.tree.leaves(_pure(sharded)), jax.tree.leaves(_pure(model)), strict=True):
        assert len(a.sharding.device_set) == 8
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes()


@pytest.mark.parametrize("role,dtype", [("actor", None), ("critic", "bfloat16")])
def test_export_hf_equals_save_hf_of_the_restored_model(tmp_path, monkeypatch, role, dtype):
    """export_hf (what to_hf runs) writes the files save_hf(restore_model(...)) writes, from a
    step holding jax arrays and other items (as the trainer writes it), restoring one parameter
    at a time to host memory and freeing each before the next is read."""
    import gc
    import weakref

    from jaxloop.io import orbax as orbax_io

    model = _model("ouro", role, 13)
    run = tmp_path / "run"
    save_model(run, model, step=0)
    opt = {"mu": jnp.ones((3, 4))}
    with ocp.CheckpointManager(run / CHECKPOINT_DIR) as mngr:
        items = {params_item(role): ocp.args.StandardSave(_pure(model)),
                 f"{role}_opt": ocp.args.StandardSave(opt)}  # fmt: skip
        mngr.save(7, args=ocp.args.Composite(**items))
        mngr.wait_until_finished()
    want = save_hf(restore_model(run, role), tmp_path / "want", dtype=dtype or "float32",
                   max_shard_size="20KB")  # fmt: skip

    alive = []
    restore_host = orbax_io._restore_host

    def spy(*args):
        # orbax's own garbage cycles hold restored arrays too (export_hf collects them itself
        # after a large parameter), and its threads may still drop theirs (seen in CI under
        # load); what must not hold one is export_hf's writer, which waits here meanwhile
        deadline = time.monotonic() + 10
        while [r for r in alive if r() is not None] and time.monotonic() < deadline:
            gc.collect()
            time.sleep(0.01)
        assert not [r for r in alive if r() is not None], "a parameter outlived its export"
        array = restore_host(*args)
        assert isinstance(array, np.ndarray)
        alive.append(weakref.ref(array))
        return array

    monkeypatch.setattr(orbax_io, "_restore_host", spy)
    got, cfg = orbax_io.export_hf(run, tmp_path / "got", role, dtype=dtype,
                                  max_shard_size="20KB", budget_bytes=1000)  # fmt: skip
    assert got == tmp_path / "got" and cfg.param_dtype == "float32"
    assert len(alive) == len(jax.tree.leaves(_pure(model)))  # each parameter read once
    files = sorted(p.name for p in want.iterdir())
    assert len(files) > 3 and files == sorted(p.name for p in got.iterdir())
    for name in files:
        assert (got / name).read_bytes() == (want / name).read_bytes(), name
    with pytest.raises(RunDirError, match="no step 3"):
        orbax_io.export_hf(run, tmp_path / "never", role, step=3)
    assert not (tmp_path / "never").exists()


def _expected_shardings(model: LoopedLM, mesh) -> dict:
    return {
        path: jax.sharding.NamedSharding(mesh, logical_to_spec(var.logical_axes, var.shape, mesh))
        for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param))
    }


def test_restore_with_a_mesh_places_each_parameter_by_its_logical_axes(tmp_path):
    model = _model("ouro", "actor", 12)
    save_model(tmp_path / "run", model, step=3)
    mesh = make_mesh(fsdp=8)
    plain = restore_model(tmp_path / "run")
    sharded = restore_model(tmp_path / "run", mesh=mesh, dtype="bfloat16")
    want = _expected_shardings(sharded, mesh)
    got = dict(nnx.to_flat_state(nnx.state(sharded, nnx.Param)))
    assert sorted(got) == sorted(want)
    specs = set()
    for path, var in got.items():
        array = var[...]
        assert array.sharding == want[path], path
        assert array.sharding.is_equivalent_to(want[path], array.ndim)
        specs.add(tuple(array.sharding.spec))
        ref = np.asarray(dict(nnx.to_flat_state(nnx.state(plain, nnx.Param)))[path][...])
        assert np.asarray(array).tobytes() == ref.astype(NP_DTYPES["bfloat16"]).tobytes(), path
    assert (None, "fsdp") in specs  # embed [V, E]: the embed axis over fsdp
    assert (None, "fsdp", None) in specs  # stacked gate/up [L, E, M]
    assert () in specs  # exit_bias: replicated
    with pytest.raises(ValueError, match="sharding or mesh"):
        restore_model(tmp_path / "run", mesh=mesh, sharding=array.sharding)


def test_relative_paths_everywhere(tmp_path, monkeypatch):
    """Run dirs and HF dirs given relative to the working directory (orbax wants absolute paths:
    'Checkpoint path should be absolute' before)."""
    hf_in = tmp_path / "hf_in"
    tensors = write_hf_dir(hf_in, "nanbeige", "actor", "bfloat16", seed=9)
    monkeypatch.chdir(tmp_path)
    model = load_hf("hf_in", dtype=None)
    save_model("run", model, step=2, tokenizer_dir="hf_in")
    assert latest_step("run") == 2 and read_config("run").num_layers == 2
    restored = restore_model("run")
    np.testing.assert_array_equal(outputs(restored), outputs(model))
    save_hf(restored, "hf_out", dtype="bfloat16", max_shard_size="20KB")
    assert_same_tensors(read_hf_tensors(tmp_path / "hf_out"), tensors)
    monkeypatch.chdir(tmp_path / "run")
    assert latest_step(".") == 2 and latest_step("../run") == 2


def test_restore_errors(tmp_path):
    with pytest.raises(RunDirError, match="does not exist"):
        restore_model(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(RunDirError, match="no checkpoints/"):
        restore_model(tmp_path / "empty")
    run = tmp_path / "run"
    save_model(run, _model("nanbeige", "actor", 0))
    with pytest.raises(RunDirError, match="no critic model"):
        restore_model(run, "critic")
    with pytest.raises(RunDirError, match="role='policy'"):
        restore_model(run, "policy")
    # a config that does not match the stored parameters
    hf = json.loads((run / config_file("actor")).read_text())
    hf["intermediate_size"] = 48
    (run / config_file("actor")).write_text(json.dumps(hf))
    with pytest.raises(RunDirError, match=r"parameter blocks\.down_proj has shape \(2, 64, 32\)"):
        restore_model(run)
    hf["model_type"] = "ouro"
    hf["total_ut_steps"] = 4
    (run / config_file("actor")).write_text(json.dumps(hf))
    with pytest.raises(RunDirError, match="has no parameter"):
        restore_model(run)


# ---- CLI errors ------------------------------------------------------------------------------
def _drop(tensors_dir: Path, name: str) -> None:
    """Rewrite the shard holding `name` without it."""
    for file in tensors_dir.glob("*.safetensors"):
        kept = {n: np.array(a) for n, a in read_safetensors(file)}
        if name in kept:
            del kept[name]
            write_safetensors(file, kept)


def _add(tensors_dir: Path, name: str, arr: np.ndarray) -> None:
    file = sorted(tensors_dir.glob("*.safetensors"))[-1]
    kept = {n: np.array(a) for n, a in read_safetensors(file)}
    kept[name] = arr
    write_safetensors(file, kept)


def _reshape(tensors_dir: Path, name: str) -> None:
    for file in tensors_dir.glob("*.safetensors"):
        kept = {n: np.array(a) for n, a in read_safetensors(file)}
        if name in kept:
            kept[name] = kept[name][:-1]
            write_safetensors(file, kept)


def _config(hf_dir: Path, **changes) -> None:
    hf = json.loads((hf_dir / "config.json").read_text())
    hf.update(changes)
    (hf_dir / "config.json").write_text(json.dumps(hf))


Q0 = "model.layers.0.self_attn.q_proj.weight"
FROM_HF_ERRORS = {
    "missing dir": (None, ["--hf-dir", "{tmp}/absent"], "absent is not a directory"),
    "unknown tensor": (
        lambda d: _add(d, "model.layers.0.mlp.extra.weight", np.zeros(4, np.float32)),
        [],
        "unexpected tensor model.layers.0.mlp.extra.weight",
    ),
    "missing tensor": (lambda d: _drop(d, Q0), [], f"missing tensor {Q0}"),
    "mis-shaped tensor": (lambda d: _reshape(d, Q0), [], f"tensor {Q0} has shape (63, 32)"),
    "bad config key": (
        lambda d: _config(d, rope_scaling={"type": "yarn", "factor": 4.0}),
        [],
        "rope_scaling",
    ),
    "unknown model_type": (lambda d: _config(d, model_type="gpt2"), [], "model_type='gpt2'"),
    "bad dtype": (None, ["--dtype", "float16"], "invalid choice: 'float16'"),
    "missing argument": (None, ["--hf-dir"], "expected one argument"),
}


@pytest.mark.parametrize("case", list(FROM_HF_ERRORS))
def test_from_hf_errors(tmp_path, capsys, case):
    mutate, extra, message = FROM_HF_ERRORS[case]
    hf_in = tmp_path / "hf_in"
    write_hf_dir(hf_in, "nanbeige", "actor", "float32")
    if mutate is not None:
        mutate(hf_in)
    out = tmp_path / "new" / "run"  # a missing parent too: must not be left behind either
    argv = ["--hf-dir", str(hf_in), "--out", str(out)]
    argv += [a.format(tmp=tmp_path) for a in extra]
    assert from_hf.main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: "), err
    assert message in err
    assert only_entries(tmp_path) == ["hf_in"]


def test_from_hf_refuses_a_non_empty_out(tmp_path, capsys):
    hf_in, out = tmp_path / "hf_in", tmp_path / "out"
    write_hf_dir(hf_in, "nanbeige", "actor", "float32")
    out.mkdir()
    (out / "keep.txt").write_text("x")
    assert from_hf.main(["--hf-dir", str(hf_in), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "exists and is not an empty directory" in err
    assert only_entries(out) == ["keep.txt"] and only_entries(tmp_path) == ["hf_in", "out"]
    # an existing empty dir is fine
    (out / "keep.txt").unlink()
    assert from_hf.main(["--hf-dir", str(hf_in), "--out", str(out)]) == 0
    assert (out / CHECKPOINT_DIR).is_dir()


@pytest.fixture(scope="module")
def actor_run(tmp_path_factory):
    run = tmp_path_factory.mktemp("actor") / "run"
    save_model(run, _model("nanbeige", "actor", 0), step=4)
    return run


TO_HF_ERRORS = {
    "missing run dir": (["--checkpoint", "{tmp}/absent"], "run dir {tmp}/absent does not exist"),
    "missing role": (["--role", "critic"], "has no critic model (critic_config.json missing)"),
    "missing step": (["--step", "3"], "has no step 3 (steps: [4])"),
    "bad step": (["--step", "x"], "invalid int value: 'x'"),
    "bad dtype": (["--dtype", "int8"], "invalid choice: 'int8'"),
    "bad shard size": (["--max-shard-size", "lots"], "--max-shard-size 'lots'"),
    "non-empty out": (["--out", "{tmp}/full"], "full exists and is not an empty directory"),
}


@pytest.mark.parametrize("case", list(TO_HF_ERRORS))
def test_to_hf_errors(tmp_path, capsys, actor_run, case):
    extra, message = TO_HF_ERRORS[case]
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    argv = ["--checkpoint", str(actor_run), "--out", str(tmp_path / "hf")]
    argv += [a.format(tmp=tmp_path) for a in extra]
    assert to_hf.main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: "), err
    assert message.format(tmp=tmp_path) in err
    assert only_entries(tmp_path) == ["full"]


def test_cli_progress_bars_on_a_terminal(tmp_path, capsys, monkeypatch):
    """With stderr a terminal (forced here), bars show and are erased; an error is still one
    line after them."""
    monkeypatch.setattr(from_hf, "show_progress", lambda: True)
    monkeypatch.setattr(to_hf, "show_progress", lambda: True)
    hf_in, run, hf_out = tmp_path / "hf_in", tmp_path / "run", tmp_path / "hf_out"
    tensors = write_hf_dir(hf_in, "nanbeige", "actor", "bfloat16", seed=5)
    assert from_hf.main(["--hf-dir", str(hf_in), "--out", str(run)]) == 0
    err = capsys.readouterr().err
    assert "reading HF" in err and "\n" not in err
    assert to_hf.main(["--checkpoint", str(run), "--out", str(hf_out)]) == 0
    err = capsys.readouterr().err
    assert "writing HF" in err and "\n" not in err  # export restores as it writes: one bar
    assert_same_tensors(read_hf_tensors(hf_out), tensors)

    _add(hf_in, "model.extra.weight", np.zeros(4, np.float32))
    assert from_hf.main(["--hf-dir", str(hf_in), "--out", str(tmp_path / "bad")]) == 2
    err = capsys.readouterr().err
    # the headers are checked before any data is read: the error comes before (or without) a bar
    assert err.count("\n") == 1
    assert err.split("\r")[-1].startswith("error: unexpected tensor model.extra.weight"), err


# ---- subprocess: what a user sees ------------------------------------------------------------
def _cli(module: str, *args: str, cwd: Path = REPO) -> subprocess.CompletedProcess:
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    return subprocess.run(
        [PYTHON, "-m", module, *args], cwd=cwd, env=env, capture_output=True, text=True
    )


def test_readme_conversion_commands_with_relative_paths(tmp_path):
    """The README's two commands, run from the directory holding the checkpoints, every path
    relative (to_hf failed with "Checkpoint path should be absolute" before)."""
    tensors = write_hf_dir(tmp_path / "hf", "nanbeige", "actor", "bfloat16", seed=10)
    r = _cli("conversion.from_hf", "--hf-dir", "hf", "--out", "ck", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert f"wrote {tmp_path / 'ck'}: nanbeige actor" in r.stdout
    r = _cli("conversion.to_hf", "--checkpoint", "ck", "--out", "sub/out", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert_same_tensors(read_hf_tensors(tmp_path / "sub" / "out"), tensors)
    for name, text in TOKENIZER.items():
        assert (tmp_path / "sub" / "out" / name).read_text() == text
    (tmp_path / "run").mkdir()
    r = _cli("conversion.to_hf", "--checkpoint", "../ck", "--out", "../again", cwd=tmp_path / "run")
    assert r.returncode == 0, r.stderr
    assert_same_tensors(read_hf_tensors(tmp_path / "again"), tensors)
    assert only_entries(tmp_path) == ["again", "ck", "hf", "run", "sub"]


def test_cli_subprocess_round_trip(tmp_path):
    hf_in, run, hf_out = tmp_path / "hf_in", tmp_path / "run", tmp_path / "hf_out"
    tensors = write_hf_dir(hf_in, "ouro", "critic", "bfloat16", seed=4)
    r = _cli("conversion.from_hf", "--hf-dir", str(hf_in), "--out", str(run))
    assert r.returncode == 0, r.stderr
    assert f"wrote {run}: ouro critic" in r.stdout
    r = _cli(
        "conversion.to_hf", "--checkpoint", str(run), "--out", str(hf_out),
        "--role", "critic", "--max-shard-size", "30KB",
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert len(list(hf_out.glob("*.safetensors"))) > 1
    assert_same_tensors(read_hf_tensors(hf_out), tensors)


def test_cli_subprocess_errors_are_one_line(tmp_path):
    hf_in = tmp_path / "hf_in"
    write_hf_dir(hf_in, "nanbeige", "actor", "bfloat16")
    _drop(hf_in, "lm_head.weight")
    r = _cli("conversion.from_hf", "--hf-dir", str(hf_in), "--out", str(tmp_path / "run"))
    assert r.returncode == 2
    assert r.stderr == f"error: missing tensor lm_head.weight in {hf_in}\n"
    assert r.stdout == ""
    r = _cli("conversion.to_hf", "--checkpoint", str(hf_in), "--out", str(tmp_path / "hf"))
    assert r.returncode == 2
    assert r.stderr == f"error: {hf_in} has no checkpoints/ directory\n"
    assert only_entries(tmp_path) == ["hf_in"]
