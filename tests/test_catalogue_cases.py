"""Inputs of the wider bad-input catalogue that ended in a traceback or were accepted: each is
refused in one `error:` line with exit code 2 before anything is read or written."""

import pytest

from conversion import to_hf
from jaxloop import evaluate


@pytest.mark.parametrize("value", ["nan", "inf", "-1"])
def test_evaluate_refuses_a_temperature_that_is_not_a_finite_number_ge_0(tmp_path, capsys, value):
    code = evaluate.main(["--checkpoint", str(tmp_path / "missing"), "--temperature", value])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "--temperature" in err[0], err


@pytest.mark.parametrize("size", ["infGB", "nanMB", "inf", "0"])
def test_to_hf_refuses_a_shard_size_that_is_not_a_positive_size(tmp_path, capsys, size):
    out = tmp_path / "out"
    argv = [
        "--checkpoint",
        str(tmp_path / "missing"),
        "--out",
        str(out),
        f"--max-shard-size={size}",
    ]
    try:
        code = to_hf.main(argv)
    except SystemExit as stop:
        code = stop.code
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "--max-shard-size" in err[0], err
    assert not out.exists()
