"""The bad-input catalogue, part B: bad *files* given to every entry point (train, evaluate, plot,
launch, conversion.from_hf / to_hf). The contract is test_bad_inputs.py's: one stderr line
starting `error: `, exit code 2, nothing on stdout, nothing under the test's directory changed
(the inputs included) and no output left behind.

One parametrized test per kind, its cases generated:
  - HF config.json values: every numeric field the checked reader reads (families/common.py
    NUMERIC_FIELDS and the loop count) x {a string, null, negative, 0, huge, a list}, through
    train (--dry-run) and from_hf, and as a run dir's actor_config.json through to_hf;
  - safetensors headers with impossible shapes / offsets (train --dry-run, from_hf);
  - NaN / inf weights in an HF checkpoint (train, from_hf);
  - damaged run dirs (a truncated optimizer state, deleted parameter data, a same-size flipped
    byte, an emptied step, a garbage actor_config.json or digest file, non-UTF-8 metrics.jsonl)
    through resume, evaluate, to_hf and plot;
  - the smaller ones (plot --out a directory, launch's command line, non-UTF-8 eval data, an
    unverified step, a half-deleted step left in checkpoints/.deleted/).
"""

from __future__ import annotations

import json
import os
import shutil
import struct
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from conversion import from_hf, to_hf
from jaxloop.evaluate import main as evaluate_main
from jaxloop.families.common import NUMERIC_FIELDS, REQUIRED_FIELDS
from jaxloop.io.hf import read_safetensors, write_safetensors
from jaxloop.launch import main as launch_main
from jaxloop.models import LoopedConfig, tiny_hf_config
from jaxloop.models.digests import DIGEST_FILE, TRASH_DIR, verify_step
from jaxloop.plot import main as plot_main
from jaxloop.train.cli import main as train_main
from tests.test_bad_inputs import (
    ALGO,
    BASE,
    _snapshot,
    _truncate,
    base_run,
    hf_dirs,
    one_error_line,
)

__all__ = ["base_run", "hf_dirs"]  # module fixtures shared with test_bad_inputs.py


def _one_line(capsys, code: int, message: str) -> str:
    return one_error_line(capsys, code, message)


def _train(run_dir: Path, *extra: str, dry: bool = False) -> int:
    argv = ["--config", f"{ALGO}.py", *BASE, f"--config.run_dir={run_dir}", *extra]
    return train_main(argv + (["--dry-run"] if dry else []))


# ---- HF config.json: every numeric field x every kind of bad value ----------------------------
LOOP_KEYS = {"nanbeige": "num_loops", "ouro": "total_ut_steps"}
FIELDS = {**NUMERIC_FIELDS, "num_loops": "dim"}
BAD_VALUES = {
    "string": "7",
    "null": None,
    "negative": -1,
    "zero": 0,
    "huge": "HUGE",  # 10**30 for an integer field, inf (1e400) for a float field
    "list": [1],
}
# optional keys whose null transformers keeps as None (its RMSNorm then fails): refused, not
# defaulted (a missing key still takes the default)
NULL_REFUSED = {"rms_norm_eps"}
OPTIONAL = {f for f in FIELDS if f not in {*REQUIRED_FIELDS, *NULL_REFUSED}}  # null: the default


def _bad(field: str, kind: str):
    value = BAD_VALUES[kind]
    if value == "HUGE":
        return float("inf") if FIELDS[field] == "float" else 10**30
    return value


def _hf_dict(field: str, value) -> dict:
    hf = tiny_hf_config("nanbeige", num_hidden_layers=1, intermediate_size=64)
    if field == "kv_channels":  # read only when head_dim is absent
        hf.pop("head_dim")
    hf[field] = value
    return hf


REFUSED = [
    pytest.param(field, kind, id=f"{field}-{kind}")
    for field in FIELDS
    for kind in BAD_VALUES
    if not (kind == "null" and field in OPTIONAL)
]


def test_every_field_is_read_by_the_checked_reader():
    """The generated cases cover every numeric key the families read."""
    assert set(REQUIRED_FIELDS) <= set(FIELDS)
    assert {"num_key_value_heads", "head_dim", "rope_theta", "rms_norm_eps"} <= set(FIELDS)
    assert len(REFUSED) >= 60


@pytest.mark.parametrize(("field", "kind"), REFUSED)
def test_hf_config_value_refused_by_the_reader(field, kind):
    """LoopedConfig.from_hf_dict: a ConfigError naming the field (no TypeError,
    ZeroDivisionError or OverflowError)."""
    from jaxloop.models import ConfigError

    with pytest.raises(ConfigError, match=field):
        LoopedConfig.from_hf_dict(_hf_dict(field, _bad(field, kind)))


@pytest.mark.parametrize("field", sorted(OPTIONAL))
def test_hf_config_null_is_the_default(field):
    """HF writes null for "the default": an optional key set to null reads as if absent."""
    hf = _hf_dict(field, None)
    absent = {k: v for k, v in hf.items() if k != field}
    assert LoopedConfig.from_hf_dict(hf) == LoopedConfig.from_hf_dict(absent)


def _write_hf(dest: Path, src: Path, hf: dict) -> Path:
    shutil.copytree(src, dest)
    (dest / "config.json").write_text(json.dumps(hf))
    return dest


@pytest.mark.parametrize(("field", "kind"), REFUSED)
def test_hf_config_value_train_and_from_hf(field, kind, tmp_path, capsys, hf_dirs):
    hf = _write_hf(tmp_path / "hf", hf_dirs["single"], _hf_dict(field, _bad(field, kind)))
    before = _snapshot(tmp_path)
    capsys.readouterr()
    code = _train(tmp_path / "run", f"--config.model.hf_dir={hf}", dry=True)
    _one_line(capsys, code, field)
    code = from_hf.main(["--hf-dir", str(hf), "--out", str(tmp_path / "ck")])
    _one_line(capsys, code, field)
    assert _snapshot(tmp_path) == before


@pytest.fixture(scope="module")
def converted(tmp_path_factory, hf_dirs) -> Path:
    """A run dir written by from_hf (step 0, digests)."""
    out = tmp_path_factory.mktemp("converted") / "ck"
    assert from_hf.main(["--hf-dir", str(hf_dirs["single"]), "--out", str(out)]) == 0
    assert verify_step(out / "checkpoints" / "0")
    return out


@pytest.mark.parametrize(("field", "kind"), REFUSED)
def test_actor_config_value_to_hf(field, kind, tmp_path, capsys, converted):
    run = tmp_path / "ck"
    shutil.copytree(converted, run)
    (run / "actor_config.json").write_text(json.dumps(_hf_dict(field, _bad(field, kind))))
    before = _snapshot(tmp_path)
    capsys.readouterr()
    code = to_hf.main(["--checkpoint", str(run), "--out", str(tmp_path / "out")])
    _one_line(capsys, code, field)
    assert _snapshot(tmp_path) == before


NON_NUMERIC = {
    "model_type list": ("model_type", ["nanbeige"], "model_type=['nanbeige'] is not supported"),
    "boolean as a string": ("skip_loop_final_norm", "false", "is not true or false"),
    "rope_parameters a list": ("rope_parameters", [1], "is not a JSON object"),
    "role a list": ("jaxloop_role", ["critic"], "jaxloop_role=['critic']"),
}


@pytest.mark.parametrize("case", list(NON_NUMERIC))
def test_hf_config_other_types(case, tmp_path, capsys, hf_dirs):
    key, value, message = NON_NUMERIC[case]
    hf = _write_hf(tmp_path / "hf", hf_dirs["single"], {**_hf_dict("vocab_size", 64), key: value})
    before = _snapshot(tmp_path)
    capsys.readouterr()
    _one_line(capsys, _train(tmp_path / "run", f"--config.model.hf_dir={hf}", dry=True), message)
    code = from_hf.main(["--hf-dir", str(hf), "--out", str(tmp_path / "ck")])
    _one_line(capsys, code, message)
    assert _snapshot(tmp_path) == before


# ---- safetensors headers with impossible shapes and offsets -----------------------------------
def _rewrite_header(file: Path, change) -> None:
    data = file.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    name = sorted(k for k in header if k != "__metadata__")[0]
    change(header[name])
    blob = json.dumps(header).encode()
    blob += b" " * (-len(blob) % 8)
    file.write_bytes(struct.pack("<Q", len(blob)) + blob + data[8 + n :])


def _set(key, value):
    return lambda entry: entry.__setitem__(key, value)


HEADERS = {
    "negative dimension": (_set("shape", [-1, 64]), "not a list of integers >= 0"),
    "two negative dimensions": (_set("shape", [-2, -32]), "not a list of integers >= 0"),
    "dimensions overflowing int64": (_set("shape", [2**40, 2**40, 2**40]), "do not fit shape"),
    "huge dimension": (_set("shape", [10**30]), "do not fit shape"),
    "shape a string": (_set("shape", "64"), "has shape '64'"),
    "nested shape": (_set("shape", [[64]]), "has shape [[64]]"),
    "fractional dimension": (_set("shape", [1.5]), "not a list of integers"),
    "null shape": (_set("shape", None), "has shape None"),
    "negative offset": (_set("data_offsets", [-8, 0]), "data offsets"),
    "one offset": (_set("data_offsets", [0]), "not [start, end]"),
    "offset past 2^64": (_set("data_offsets", [0, 2**70]), "out of range"),
    "dtype a list": (_set("dtype", ["F32"]), "unsupported dtype"),
    "entry not an object": (lambda e: e.clear() or e.update(x=1), "unsupported dtype"),
}


@pytest.mark.parametrize("case", list(HEADERS))
def test_safetensors_header(case, tmp_path, capsys, hf_dirs):
    change, message = HEADERS[case]
    hf = tmp_path / "hf"
    shutil.copytree(hf_dirs["single"], hf)
    _rewrite_header(hf / "model.safetensors", change)
    before = _snapshot(tmp_path)
    capsys.readouterr()
    line = _one_line(
        capsys, _train(tmp_path / "run", f"--config.model.hf_dir={hf}", dry=True), message
    )
    assert "model.safetensors:" in line
    code = from_hf.main(["--hf-dir", str(hf), "--out", str(tmp_path / "ck")])
    _one_line(capsys, code, message)
    assert _snapshot(tmp_path) == before


# ---- NaN / inf weights in an HF checkpoint: refused before training ---------------------------
NON_FINITE = {"nan": np.nan, "inf": np.inf, "-inf": -np.inf}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("value", list(NON_FINITE))
def test_non_finite_weights(value, dtype, tmp_path, capsys, hf_dirs):
    hf = tmp_path / "hf"
    shutil.copytree(hf_dirs["single"], hf)
    file = hf / "model.safetensors"
    np_dtype = np.dtype(ml_dtypes.bfloat16) if dtype == "bfloat16" else np.dtype(dtype)
    tensors = {n: np.array(a).astype(np_dtype) for n, a in read_safetensors(file)}
    name = "model.layers.0.mlp.up_proj.weight"
    tensors[name][3, 5] = NON_FINITE[value]
    write_safetensors(file, tensors)
    before = _snapshot(tmp_path)
    message = f"tensor {name} holds non-finite values (NaN or inf; the first at index (3, 5))"
    capsys.readouterr()
    _one_line(capsys, _train(tmp_path / "run", f"--config.model.hf_dir={hf}"), message)
    assert not (tmp_path / "run").exists()
    code = from_hf.main(["--hf-dir", str(hf), "--out", str(tmp_path / "ck")])
    _one_line(capsys, code, message)
    assert _snapshot(tmp_path) == before


# ---- damaged run dirs: resume, evaluate, to_hf, plot ------------------------------------------
def _step(run: Path, step: int = 2) -> Path:
    return run / "checkpoints" / str(step)


def _data_files(item: Path) -> list[Path]:
    """An orbax item's array data files (ocdbt.process_0/d/: the arrays' chunks; the trainer's
    are zstd-compressed, from_hf's raw), largest first."""
    files = [p for p in (item / "ocdbt.process_0" / "d").iterdir() if p.is_file()]
    return sorted(files, key=lambda p: (-p.stat().st_size, str(p)))


def _flip_byte(file: Path) -> None:
    data = bytearray(file.read_bytes())
    data[len(data) // 2] ^= 0x01
    file.write_bytes(bytes(data))


def _delete_data(item: Path) -> None:
    for f in _data_files(item):
        f.unlink()


def _empty(step_dir: Path) -> None:
    for p in step_dir.iterdir():
        shutil.rmtree(p) if p.is_dir() else p.unlink()


DAMAGE = {
    # id: (mutate(run dir), {entry point: message}); an entry point not listed must work
    "truncated optimizer state": (
        lambda r: _truncate(_data_files(_step(r) / "actor_opt")[0], 0.5),
        {"resume": "checkpoint 2 is corrupt: actor_opt/"},
    ),
    "deleted parameter data": (
        lambda r: _delete_data(_step(r) / "actor_params"),
        {
            "resume": "checkpoint 2 is corrupt: actor_params/ocdbt.process_0/d/",
            "evaluate": "checkpoint 2 is corrupt: actor_params/",
            "to_hf": "checkpoint 2 is corrupt: actor_params/",
        },
    ),
    "same-size flipped byte in the parameters": (
        lambda r: _flip_byte(_data_files(_step(r) / "actor_params")[0]),
        {
            "resume": "does not match its checksum",
            "evaluate": "does not match its checksum",
            "to_hf": "does not match its checksum",
        },
    ),
    "same-size flipped byte in the optimizer state": (
        lambda r: _flip_byte(_data_files(_step(r) / "actor_opt")[0]),
        {"resume": "checkpoint 2 is corrupt: actor_opt/"},
    ),
    "emptied step": (
        lambda r: _empty(_step(r)),
        {
            "resume": "checkpoint 2 is incomplete",
            "evaluate": "step 2",
            "to_hf": "step 2",
        },
    ),
    "garbage digest file": (
        lambda r: (_step(r) / DIGEST_FILE).write_text('{"items": '),
        {
            "resume": f"its {DIGEST_FILE} is unreadable",
            "evaluate": f"its {DIGEST_FILE} is unreadable",
            "to_hf": f"its {DIGEST_FILE} is unreadable",
        },
    ),
    "garbage actor_config.json (bytes)": (
        lambda r: (r / "actor_config.json").write_bytes(b"\xff\xfe\x00garbage"),
        {
            "resume": "actor_config.json is not valid JSON",
            "evaluate": "actor_config.json is not valid JSON",
            "to_hf": "actor_config.json is not valid JSON",
        },
    ),
    "actor_config.json a list": (
        lambda r: (r / "actor_config.json").write_text("[1, 2]"),
        {
            "resume": "actor_config.json is not a JSON object",
            "evaluate": "actor_config.json is not a JSON object",
            "to_hf": "actor_config.json is not a JSON object",
        },
    ),
    "non-UTF-8 metrics.jsonl": (
        lambda r: open(r / "metrics.jsonl", "ab").write(b'{"update": 9, "x": "\xff\xfe"}\n'),
        {
            "resume": "metrics.jsonl: line 3 is not UTF-8",
            "plot": "metrics.jsonl: line 3 is not UTF-8",
        },
    ),
}
ENTRY_POINTS = ("resume", "evaluate", "to_hf", "plot")
DAMAGED = [
    pytest.param(case, entry, id=f"{case}-{entry}")
    for case, (_, messages) in DAMAGE.items()
    for entry in ENTRY_POINTS
    if entry in messages
]


def _run_entry(entry: str, run: Path, tmp_path: Path, *extra: str) -> int:
    if entry == "resume":
        return _train(run, *extra)
    if entry == "evaluate":
        return evaluate_main(["--checkpoint", str(run), "--prompts", "2", *extra])
    if entry == "to_hf":
        return to_hf.main(["--checkpoint", str(run), "--out", str(tmp_path / "out"), *extra])
    assert entry == "plot"
    return plot_main([str(run), "--out", str(tmp_path / "curves.png"), *extra])


@pytest.mark.parametrize(("case", "entry"), DAMAGED)
def test_damaged_run_dir(case, entry, tmp_path, capsys, base_run):
    mutate, messages = DAMAGE[case]
    run = tmp_path / "run"
    shutil.copytree(base_run, run)
    mutate(run)
    before = _snapshot(tmp_path)
    capsys.readouterr()
    line = _one_line(capsys, _run_entry(entry, run, tmp_path), messages[entry])
    assert _snapshot(tmp_path) == before  # nothing written, nothing touched
    if "checkpoint 2" in line:  # the offer: the newest older step that verifies, and how
        if entry == "resume":
            assert f"checkpoint 1 verifies: move {_step(run)} out of checkpoints/" in line
        else:
            assert "checkpoint 1 verifies: pass --step 1" in line


def test_offer_of_an_older_step_without_digests(tmp_path, capsys, base_run):
    """A run written before digests: a damaged newest step offers the older step as unverified
    (nothing to check it against), not as damaged."""
    run = tmp_path / "run"
    shutil.copytree(base_run, run)
    (_step(run, 1) / DIGEST_FILE).unlink()
    _flip_byte(_data_files(_step(run) / "actor_params")[0])
    capsys.readouterr()
    code = to_hf.main(["--checkpoint", str(run), "--out", str(tmp_path / "o")])
    _one_line(capsys, code, "(checkpoint 1 has no digests (unverified): pass --step 1 to use it)")


def test_damage_outside_the_restored_items_does_not_stop_to_hf(tmp_path, capsys, base_run):
    """Digests are per item: to_hf reads (and verifies) actor_params only."""
    run = tmp_path / "run"
    shutil.copytree(base_run, run)
    _flip_byte(_data_files(_step(run) / "actor_opt")[0])
    assert to_hf.main(["--checkpoint", str(run), "--out", str(tmp_path / "out")]) == 0
    assert capsys.readouterr().err == ""


def test_same_size_corruption_needs_the_digest(tmp_path, capsys, converted):
    """Why digests: from_hf's arrays are stored raw, so a flipped byte with the digest file gone
    restores silently (only a warning that the step is unverified, and a different weight); with
    the digest file it is refused."""
    run = tmp_path / "ck"
    shutil.copytree(converted, run)
    assert to_hf.main(["--checkpoint", str(run), "--out", str(tmp_path / "ref_hf")]) == 0
    _flip_byte(_data_files(_step(run, 0) / "actor_params")[0])
    capsys.readouterr()
    code = to_hf.main(["--checkpoint", str(run), "--out", str(tmp_path / "x")])
    _one_line(capsys, code, "checkpoint 0 is corrupt: actor_params/ocdbt.process_0/d/")
    (_step(run, 0) / DIGEST_FILE).unlink()
    assert to_hf.main(["--checkpoint", str(run), "--out", str(tmp_path / "bad_hf")]) == 0
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("warning: checkpoint 0") and "unverified" in err
    a = dict(read_safetensors(tmp_path / "ref_hf" / "model.safetensors"))
    b = dict(read_safetensors(tmp_path / "bad_hf" / "model.safetensors"))
    assert sum(not np.array_equal(a[k], b[k]) for k in a) == 1


def test_unverified_damaged_step_is_one_line(tmp_path, capsys, base_run):
    """Without digests, what orbax cannot read (a chunk file cut short) is still one line naming
    the step, not a tensorstore traceback."""
    run = tmp_path / "run"
    shutil.copytree(base_run, run)
    item = _step(run) / "actor_params"
    for file in [p for p in item.rglob("*") if p.is_file() and p.parent.name == "d"]:
        _truncate(file, 0.5)  # every chunk file (where orbax keeps which depends on the mesh)
    (_step(run) / DIGEST_FILE).unlink()
    capsys.readouterr()
    code = to_hf.main(["--checkpoint", str(run), "--out", str(tmp_path / "o")])
    line = _one_line(capsys, code, "is damaged: its actor_params is unreadable")
    assert line.startswith("error: checkpoint 2 of ") and f"no {DIGEST_FILE}" in line
    assert not (tmp_path / "o").exists()


def test_a_step_without_digests_resumes_unverified(tmp_path, capsys, base_run):
    """A checkpoint written before digests (or whose save was killed before its digest file):
    restored with one warning line; the next save writes digests again."""
    run = tmp_path / "run"
    shutil.copytree(base_run, run)
    (_step(run) / DIGEST_FILE).unlink()
    assert _train(run) == 0
    err = capsys.readouterr().err
    assert "warning: checkpoint 2" in err and "restored unverified" in err
    assert verify_step(_step(run, 3))


def test_digests_of_a_training_run(base_run):
    """Every step of a run has its digest file, listing every item, and verifies."""
    for step in (1, 2):
        doc = json.loads((_step(base_run, step) / DIGEST_FILE).read_text())
        items = {p.name for p in _step(base_run, step).iterdir() if p.is_dir()}
        assert set(doc["items"]) == items
        assert verify_step(_step(base_run, step))


def test_half_deleted_step_in_the_trash(tmp_path, capsys, base_run):
    """Old steps are moved into checkpoints/.deleted/ before they are removed: a kill during
    the removal leaves a half-deleted step there, which no reader lists."""
    run = tmp_path / "run"
    shutil.copytree(base_run, run)
    trash = run / "checkpoints" / TRASH_DIR
    trash.mkdir()
    os.replace(_step(run, 1), trash / "1")
    shutil.rmtree(trash / "1" / "actor_params")
    code = to_hf.main(["--checkpoint", str(run), "--out", str(tmp_path / "o"), "--step", "1"])
    _one_line(capsys, code, "has no step 1 (steps: [2])")
    assert to_hf.main(["--checkpoint", str(run), "--out", str(tmp_path / "o")]) == 0
    capsys.readouterr()


def test_old_steps_are_deleted_whole(tmp_path, capsys):
    """keep_checkpoints=1: every older step is gone, and so is the trash."""
    run = tmp_path / "run"
    assert _train(run, "--config.keep_checkpoints=1") == 0
    assert sorted(os.listdir(run / "checkpoints")) == ["3"]
    assert verify_step(_step(run, 3))


# ---- the smaller ones -------------------------------------------------------------------------
def test_plot_out_is_a_directory(tmp_path, capsys, base_run):
    (tmp_path / "dir").mkdir()
    (tmp_path / "file").write_text("x")
    before = _snapshot(tmp_path)
    capsys.readouterr()
    code = plot_main([str(base_run), "--out", str(tmp_path / "dir")])
    _one_line(capsys, code, "is a directory")
    code = plot_main([str(base_run), "--out", str(tmp_path / "file" / "c.png")])
    _one_line(capsys, code, "is a file, not a directory")
    _one_line(capsys, plot_main([str(base_run), "--bogus"]), "unrecognized arguments")
    assert _snapshot(tmp_path) == before


LAUNCH = {
    "no --": (["--num-processes", "2"], "no `--` before the training arguments"),
    "zero processes": (["--num-processes", "0", "--"], "--num-processes must be >= 1 (got 0)"),
    "negative processes": (["--num-processes", "-3", "--"], "--num-processes must be >= 1"),
    "zero devices": (
        ["--num-processes", "1", "--devices-per-process", "0", "--"],
        "--devices-per-process must be >= 1",
    ),
    "not a number": (["--num-processes", "two", "--"], "invalid int value: 'two'"),
    "missing count": (["--"], "the following arguments are required: --num-processes"),
    "negative GPUs": (
        ["--num-processes", "1", "--gpus-per-process", "-1", "--"],
        "--gpus-per-process must be a finite number >= 0",
    ),
}


@pytest.mark.parametrize("case", list(LAUNCH))
def test_launch_command_line(case, capsys):
    argv, message = LAUNCH[case]
    _one_line(capsys, launch_main([*argv, *BASE]), message)


def test_non_utf8_eval_source(tmp_path, capsys, base_run):
    bad = tmp_path / "eval.jsonl"
    bad.write_bytes(b'{"prompt": "12", "label": "21"}\n{"prompt": "\xff", "label": "1"}\n')
    before = _snapshot(tmp_path)
    capsys.readouterr()
    message = f"{bad}: line 2 is not UTF-8 (byte 0xff at column 13)"
    _one_line(
        capsys, _train(tmp_path / "run", f"--config.data.eval_source={bad}", dry=True), message
    )
    _one_line(capsys, _train(tmp_path / "run", f"--config.data.source={bad}", dry=True), message)
    code = evaluate_main(["--checkpoint", str(base_run), "--data", str(bad)])
    _one_line(capsys, code, message)
    assert _snapshot(tmp_path) == before


def test_tokenizer_load_error_is_one_line(tmp_path, capsys):
    tok = tmp_path / "tok"
    tok.mkdir()
    (tok / "tokenizer_config.json").write_text('{"x": 1}')
    capsys.readouterr()
    code = _train(tmp_path / "run", f"--config.data.tokenizer={tok}", dry=True)
    line = _one_line(capsys, code, f"cannot load a tokenizer from {tok}")
    assert len(line) > len(f"error: cannot load a tokenizer from {tok}: ") + 20  # the reason


def test_configs_are_written_atomically(tmp_path, monkeypatch):
    """{role}_config.json: a temporary file renamed over it, so a kill leaves the old or the
    new file, never half of one."""
    from flax import nnx

    from jaxloop.io import orbax as orbax_io
    from jaxloop.models import LoopedLM

    model = LoopedLM(LoopedConfig.from_hf_dict(tiny_hf_config()), rngs=nnx.Rngs(0))
    (tmp_path / "actor_config.json").write_text("old")
    replaced = []
    real = os.replace
    monkeypatch.setattr(os, "replace", lambda a, b: (replaced.append((a, b)), real(a, b)))
    orbax_io.write_config(tmp_path, model)
    assert [Path(b).name for _, b in replaced] == ["actor_config.json"]
    assert json.loads((tmp_path / "actor_config.json").read_text())["vocab_size"] == 64
    assert sorted(os.listdir(tmp_path)) == ["actor_config.json"]


def test_a_bug_keeps_its_traceback(tmp_path, monkeypatch, converted):
    """The boundary passes user errors only: any other exception propagates (exit code 1)."""
    import jaxloop.io.orbax as orbax_io

    def boom(*args, **kwargs):
        raise ZeroDivisionError("a bug")

    monkeypatch.setattr(orbax_io, "export_hf", boom)
    with pytest.raises(ZeroDivisionError):
        to_hf.main(["--checkpoint", str(converted), "--out", str(tmp_path / "o")])
    monkeypatch.setattr("jaxloop.plot.plot_run", boom)
    with pytest.raises(ZeroDivisionError):
        plot_main([str(tmp_path)])
