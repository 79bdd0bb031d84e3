"""Inputs of the wider bad-input catalogue that ended in a traceback or were accepted: each is
refused in one `error:` line with exit code 2 before anything is read or written."""

import shutil

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


# ---- two-line errors: a warning of transformers or orbax printed before the one error line ----
def _stderr_lines(*argv: str) -> tuple[int, list[str]]:
    """Run `python -m ...` in a fresh process (the warnings of absl and transformers reach its
    real stderr, which capsys does not see): (exit code, the non-empty stderr lines)."""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", *argv], capture_output=True, text=True)
    return proc.returncode, [line for line in proc.stderr.splitlines() if line.strip()]


@pytest.fixture(scope="module")
def tiny_model():
    from flax import nnx

    from jaxloop.families import tiny_hf_config
    from jaxloop.models.config import LoopedConfig
    from jaxloop.models.looped import LoopedLM

    hf = tiny_hf_config("nanbeige", num_hidden_layers=1, intermediate_size=64)
    return LoopedLM(LoopedConfig.from_hf_dict(hf), rngs=nnx.Rngs(0))


def test_an_hf_dir_without_a_tokenizer_as_data_tokenizer_is_one_line(tmp_path, tiny_model):
    """data.tokenizer naming an HF model dir that holds no tokenizer files: one line naming the
    dir (it was a transformers warning about the model type, then the error)."""
    from jaxloop.io.hf import save_hf

    hf_dir = save_hf(tiny_model, tmp_path / "hf", dtype="float32")
    run_dir = tmp_path / "run"
    code, lines = _stderr_lines(
        "jaxloop.train",
        "--config",
        "ppo.py",
        f"--config.run_dir={run_dir}",
        f"--config.model.hf_dir={hf_dir}",
        f"--config.data.tokenizer={hf_dir}",
        "--dry-run",
    )
    assert code == 2 and len(lines) == 1, lines
    assert lines[0] == (
        f"error: no HF tokenizer in {hf_dir}: it holds none of tokenizer.json, "
        "tokenizer_config.json, tokenizer.model, vocab.json"
    )
    assert not run_dir.exists()


@pytest.mark.parametrize("entry", ["jaxloop.evaluate", "conversion.to_hf"])
def test_an_emptied_checkpoint_step_is_one_line(tmp_path, tiny_model, entry):
    """The newest step of a run dir emptied (its files removed, the directory left): one line
    naming the step and the older step that verifies (it was orbax's warning about the step's
    missing metadata file, then the error)."""
    from jaxloop.config import base_config
    from jaxloop.io.orbax import save_model

    run_dir = tmp_path / "run"
    for step in (1, 2):
        save_model(run_dir, tiny_model, step=step)
    # evaluate reads the run's data settings: the defaults'
    (run_dir / "config.json").write_text(base_config().to_json_best_effort())
    step_dir = run_dir / "checkpoints" / "2"
    shutil.rmtree(step_dir)
    step_dir.mkdir()
    out = tmp_path / "out"
    argv = ["--checkpoint", str(run_dir)]
    argv += ["--prompts", "2"] if entry == "jaxloop.evaluate" else ["--out", str(out)]
    code, lines = _stderr_lines(entry, *argv)
    assert code == 2 and len(lines) == 1, lines
    offer = "pass --step 1 to use it" if entry == "jaxloop.evaluate" else "--step 1"
    assert lines[0].startswith(f"error: step 2 of {run_dir / 'checkpoints'} is empty"), lines
    assert "checkpoint 1 verifies" in lines[0] and offer in lines[0], lines
    assert not out.exists()


@pytest.mark.parametrize("entry", ["init_checkpoint", "evaluate"])
def test_non_finite_weights_in_an_orbax_checkpoint_are_refused_at_load(tmp_path, entry):
    """An inf in one parameter of an orbax checkpoint (digests written after it, so it
    verifies): refused in one line naming the parameter and the first index, as an HF
    checkpoint's NaN / inf are; a run started from it writes nothing."""
    import jax.numpy as jnp
    from flax import nnx

    from jaxloop.config import base_config, unit_overrides
    from jaxloop.families import tiny_hf_config
    from jaxloop.io.orbax import save_model
    from jaxloop.models.config import LoopedConfig
    from jaxloop.models.looped import LoopedLM

    hf = tiny_hf_config("nanbeige", num_hidden_layers=1, intermediate_size=64)
    model = LoopedLM(LoopedConfig.from_hf_dict(hf), rngs=nnx.Rngs(0))
    params = nnx.state(model, nnx.Param)
    pure = nnx.to_pure_dict(params)
    pure["blocks"]["up_proj"] = pure["blocks"]["up_proj"].at[0, 1, 3].set(jnp.inf)
    nnx.replace_by_pure_dict(params, pure)
    nnx.update(model, params)
    weights = tmp_path / "weights"
    save_model(weights, model, step=1)
    (weights / "config.json").write_text(base_config().to_json_best_effort())
    run_dir = tmp_path / "run"
    if entry == "evaluate":
        argv = ("jaxloop.evaluate", "--checkpoint", str(weights), "--prompts", "2")
    else:
        argv = ("jaxloop.train", "--config", "ppo.py", *unit_overrides())
        argv += (f"--config.run_dir={run_dir}", f"--config.model.init_checkpoint={weights}")
        argv += ("--config.prompts_per_update=2", "--config.progress=false")
    code, lines = _stderr_lines(*argv)
    assert code == 2 and len(lines) == 1, lines
    assert lines[0] == (
        f"error: checkpoint 1 of {weights / 'checkpoints'}: actor_params parameter "
        "blocks.up_proj holds non-finite values (NaN or inf; the first at index (0, 1, 3)): "
        "refusing to load it"
    )
    assert not run_dir.exists()
