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


def test_a_refused_permission_is_not_called_a_write(capsys):
    """EACCES/EPERM come from reads as well as writes (root ignores file modes, so the errno is
    raised here rather than provoked): the line says "cannot access", not "cannot write"."""
    import errno

    from jaxloop.errors import run_entry_point

    def body() -> int:
        raise PermissionError(errno.EACCES, "Permission denied", "/data/prompts.jsonl")

    assert run_entry_point(body) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["error: cannot access: [Errno 13] Permission denied: '/data/prompts.jsonl'"]


def test_a_file_size_limit_of_the_kernel_is_one_line_exit_2(tmp_path):
    """A real kernel refusal: RLIMIT_FSIZE in a child (SIGXFSZ ignored, so the write fails with
    EFBIG instead of killing the process) is a user error, exit 2, one `cannot write` line."""
    import subprocess
    import sys

    script = (
        "import resource, signal, sys\n"
        "from jaxloop.errors import run_entry_point\n"
        "signal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"
        "resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))\n"
        "def body():\n"
        f"    with open({str(tmp_path / 'big.bin')!r}, 'wb') as f:\n"
        "        f.write(b'x' * 65536)\n"
        "    return 0\n"
        "sys.exit(run_entry_point(body))\n"
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert lines[0].startswith("error: cannot write: [Errno 27] File too large"), lines


@pytest.mark.parametrize("family", ["nanbeige", "ouro"])
def test_a_null_rms_norm_eps_is_refused_and_a_missing_one_is_the_default(family):
    from jaxloop.families import read_hf_config, tiny_hf_config
    from jaxloop.families.common import ConfigError

    hf = tiny_hf_config(family)
    with pytest.raises(ConfigError, match="null for rms_norm_eps"):
        read_hf_config({**hf, "rms_norm_eps": None})
    without = {k: v for k, v in hf.items() if k != "rms_norm_eps"}
    assert read_hf_config(without)["rms_norm_eps"] == 1e-6


@pytest.mark.parametrize("value", [10**400, -(10**400)])
def test_a_reward_beyond_a_float_is_refused_in_one_line(value):
    """An int no float holds (float() raises OverflowError) is refused like a non-number."""
    from types import SimpleNamespace

    from jaxloop.rollout.producer import RewardError, RolloutProducer

    producer = SimpleNamespace(reward_fn=lambda response, label: value)
    producer.settings = SimpleNamespace(reward="tests.rewards:huge")
    with pytest.raises(RewardError, match="a reward must be a number") as caught:
        RolloutProducer.score(producer, "12", "12")
    assert len(str(caught.value).splitlines()) == 1
