"""The bad-input catalogue: `python -m jaxloop.train` given a bad input prints one line on stderr
(`error: ...`), exits with code 2 and writes nothing: a new run dir is not created, an existing
run dir (checkpoints, metrics.jsonl, configs) is untouched, and nothing else under the test's
directory changes (the inputs included).

Each row of CATALOGUE: an id, a setup (returns the extra command-line arguments; it may build
input files and an existing run dir), and the text the one line contains. Rows marked `dry` are
also checked with --dry-run (their check runs before a model is built). A few rows are checked
once more in a fresh process (the real stderr, not capsys). NaN / inf rewards are not errors:
they are dropped and counted (test_non_finite_rewards_are_dropped_and_counted).

Below the rows, bad inputs by kind (issue 22): the three data-loss cases, checked byte for byte
(an empty run_dir, a resume with keep_checkpoints=0, a rerun over another run's files); every
numeric key of jaxloop.config.DOMAINS with NaN, inf, huge, 0, -1 and wrong-type values (through
--dry-run; the issue's values through a real run too); every key with choices or that needs a
value; config files and reward functions that fail; starts that would leave a skeleton run dir;
the exception boundary (a bug keeps its traceback, exit 1); the non-finite guard.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import math
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from flax import nnx

from jaxloop.config import DOMAINS, TYPES, base_config, flat_items, validate
from jaxloop.io.hf import read_safetensors, save_hf, write_safetensors
from jaxloop.models import LoopedConfig, LoopedLM, tiny_hf_config
from jaxloop.train.checkpoint import resume_changes_math
from jaxloop.train.cli import main
from tests.train.helpers import TINY

ALGO = "ppo"
# the base run: 2 of 3 updates done (checkpoints 1 and 2), so that a rerun resumes
BASE = (
    *TINY,
    "--config.total_updates=3",
    "--config.checkpoint_every=1",
    "--config.keep_checkpoints=5",
    "--config.rollout.max_new_tokens=2",
    "--config.data.reward=tests.train.rewards:char_code_reward",
    "--config.curves=true",  # the rerun rows find the old run's curves.png
)


# ---- rewards used by the rows ----
def text_reward(response: str, label: str):
    return "yes"


def none_reward(response: str, label: str):
    return None


def nan_or_inf_reward(response: str, label: str) -> float:
    code = ord(response[0]) % 3 if response else 2
    return (float("nan"), float("inf"), 1.0)[code]


# ---- shared inputs, built once ----
@pytest.fixture(scope="module")
def base_run(tmp_path_factory) -> Path:
    """A ppo run dir stopped after 2 of 3 updates."""
    run_dir = tmp_path_factory.mktemp("base") / "run"
    args = ["--config", f"{ALGO}.py", *BASE, f"--config.run_dir={run_dir}"]
    assert main([*args, "--config.stop_after=2"]) == 0
    assert sorted(os.listdir(run_dir / "checkpoints")) == ["1", "2"]
    return run_dir


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory) -> dict[str, Path]:
    """A valid tiny HF dir (one file) and a sharded one (an index and several files)."""
    root = tmp_path_factory.mktemp("hf")
    hf = tiny_hf_config("nanbeige", num_hidden_layers=1, intermediate_size=64)
    model = LoopedLM(LoopedConfig.from_hf_dict(hf), rngs=nnx.Rngs(0))
    single = save_hf(model, root / "single", dtype="float32")
    sharded = save_hf(model, root / "sharded", dtype="float32", max_shard_size="8KB")
    assert (sharded / "model.safetensors.index.json").is_file()
    return {"single": Path(single), "sharded": Path(sharded)}


@dataclasses.dataclass
class Ctx:
    """What a row's setup gets: a fresh directory, the run dir to use, the shared inputs."""

    root: Path
    run_dir: Path
    base_run: Path
    hf_dirs: dict
    monkeypatch: pytest.MonkeyPatch

    def existing_run(self) -> Path:
        shutil.copytree(self.base_run, self.run_dir)
        return self.run_dir

    def hf_copy(self, which: str = "single") -> Path:
        dest = self.root / f"hf_{which}"
        shutil.copytree(self.hf_dirs[which], dest)
        return dest

    def data(self, text: str, name: str = "prompts.jsonl") -> Path:
        path = self.root / name
        path.write_text(text)
        return path


def _hf(ctx: Ctx, mutate: Callable[[Path], None], which: str = "single") -> list[str]:
    path = ctx.hf_copy(which)
    mutate(path)
    return [f"--config.model.hf_dir={path}"]


def _edit_config(path: Path, **changes) -> None:
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(changes)
    (path / "config.json").write_text(json.dumps(cfg))


def _rewrite_tensor(path: Path, fn) -> None:
    file = path / "model.safetensors"
    tensors = {name: np.array(arr) for name, arr in read_safetensors(file)}
    name = sorted(tensors)[0]
    tensors[name] = fn(tensors[name])
    if tensors[name] is None:
        del tensors[name]
    write_safetensors(file, tensors)


def _shards(path: Path) -> list[Path]:
    return sorted(path.glob("model-*.safetensors"))


def _first_file(path: Path) -> Path:
    return sorted(p for p in path.iterdir() if p.is_file())[0]


def _cut_tail(file: Path, nbytes: int) -> None:
    file.write_bytes(file.read_bytes()[:-nbytes])


def _truncate(file: Path, keep: float) -> None:
    data = file.read_bytes()
    file.write_bytes(data[: int(len(data) * keep)])


def _corrupt_header(file: Path) -> None:
    data = bytearray(file.read_bytes())
    data[8:40] = b"\xff" * 32
    file.write_bytes(bytes(data))


def _resume(*args: str):
    def setup(ctx: Ctx) -> list[str]:
        ctx.existing_run()
        return list(args)

    return setup


def _resume_mutated(mutate: Callable[[Path], None], *args: str):
    def setup(ctx: Ctx) -> list[str]:
        mutate(ctx.existing_run())
        return list(args)

    return setup


def _drop_run_configs(run_dir: Path) -> None:
    """A run dir without the config files of its first start (written by an older version, or
    assembled by hand): only the checkpoint itself tells what it holds."""
    for name in ("config.json", "actor_config.json", "critic_config.json"):
        (run_dir / name).unlink()


def _simulate_write_error(code: int):
    """Writes of the run dir's write probe fail with `code` (a read-only or full file system)."""

    def setup(ctx: Ctx) -> list[str]:
        real_open = os.open

        def failing_open(path, flags, *args, **kwargs):
            if ".jaxloop-write-probe" in str(path):
                raise OSError(code, os.strerror(code), str(path))
            return real_open(path, flags, *args, **kwargs)

        ctx.monkeypatch.setattr(os, "open", failing_open)
        return []

    return setup


def _existing_and(setup):
    def both(ctx: Ctx) -> list[str]:
        ctx.existing_run()
        return setup(ctx)

    return both


@dataclasses.dataclass(frozen=True)
class Row:
    id: str
    setup: Callable[[Ctx], list[str]]
    message: str
    dry: bool = False  # also checked with --dry-run
    algorithm: str = ALGO


def _args(*args: str):
    return lambda ctx: list(args)


CATALOGUE = [
    # ---- config
    Row("unknown key", _args("--config.nope=1"), "unknown config key 'nope'", dry=True),
    Row("unknown nested key", _args("--config.model.nope=1"), "'model.nope'", dry=True),
    Row("wrong type (int)", _args("--config.total_updates=many"), "expected an integer", True),
    Row("wrong type (bool)", _args("--config.progress=maybe"), "expected a boolean", True),
    Row(
        "grpo with one sample per prompt",
        _args("--config.n_samples_per_prompt=1"),
        "needs n_samples_per_prompt >= 2",
        dry=True,
        algorithm="grpo",
    ),
    Row(
        "top_p < 1 in a training rollout",
        _args("--config.rollout.top_p=0.9"),
        "must sample the full distribution",
        dry=True,
    ),
    Row(
        "negative entropy bonus",
        _args("--config.algo.entropy_coef=-0.1"),
        "algo.entropy_coef must be >= 0",
        dry=True,
    ),
    Row(
        "negative evaluation interval",
        _args("--config.eval_every=-1"),
        "eval_every must be in [1, 2147483647] or None (got -1)",
        dry=True,
    ),
    Row(
        "negative checkpoint interval",
        _args("--config.checkpoint_every=-5"),
        "checkpoint_every must be in [1, 2147483647] or None (got -5)",
        dry=True,
    ),
    Row(
        "negative rollout staleness",
        _args("--config.rollout.max_staleness=-1"),
        "rollout.max_staleness must be in [0, 2147483647] (got -1)",
        dry=True,
    ),
    Row(
        "unknown publication mode",
        _args("--config.rollout.publish=sparse"),
        "rollout.publish must be one of 'full'/'delta'/'delta_xor' (got 'sparse')",
        dry=True,
    ),
    Row(
        "delta publication to the embedded engine",
        _args("--config.rollout.publish=delta"),
        "rollout.publish=delta needs remote engines",
        dry=True,
    ),
    Row(
        "xor delta publication to the embedded engine",
        _args("--config.rollout.publish=delta_xor"),
        "rollout.publish=delta_xor needs remote engines",
        dry=True,
    ),
    Row(
        "mesh larger than the devices",
        _args("--config.mesh.fsdp=16"),
        "= 16 devices, but 8 are available",
    ),
    Row(
        "mesh.tensor not dividing the heads",
        _args("--config.mesh.fsdp=1", "--config.mesh.tensor=8"),
        "mesh.tensor=8 does not divide the model's query heads (4)",
    ),
    Row(
        "micro-batch not divisible by data x fsdp",
        _args("--config.micro_batch_size=4"),
        "micro_batch_size=4 is not divisible by mesh data x fsdp = 8",
    ),
    # ---- HF dirs
    Row(
        "HF dir without config.json",
        lambda ctx: _hf(ctx, lambda p: (p / "config.json").unlink()),
        "config.json does not exist",
        dry=True,
    ),
    Row(
        "HF config.json not JSON",
        lambda ctx: _hf(ctx, lambda p: (p / "config.json").write_text("{vocab_size: 64")),
        "config.json is not valid JSON",
        dry=True,
    ),
    Row(
        "corrupted safetensors header",
        lambda ctx: _hf(ctx, lambda p: _corrupt_header(p / "model.safetensors")),
        "model.safetensors:",
        dry=True,
    ),
    Row(
        "truncated shard",
        lambda ctx: _hf(ctx, lambda p: _cut_tail(_shards(p)[1], 16), "sharded"),
        "data offsets out of range",
        dry=True,
    ),
    Row(
        "index naming a missing file",
        lambda ctx: _hf(ctx, lambda p: _shards(p)[2].unlink(), "sharded"),
        ".safetensors, which is not in",
        dry=True,
    ),
    Row(
        "integer weights (wrong dtype)",
        lambda ctx: _hf(ctx, lambda p: _rewrite_tensor(p, lambda a: a.astype(np.int32))),
        "has dtype int32; weights must be floating point",
        dry=True,
    ),
    Row(
        "a missing tensor",
        lambda ctx: _hf(ctx, lambda p: _rewrite_tensor(p, lambda a: None)),
        "missing tensor",
        dry=True,
    ),
    Row(
        "a tensor of the wrong shape",
        lambda ctx: _hf(ctx, lambda p: _rewrite_tensor(p, lambda a: a[..., :1])),
        "expected",
        dry=True,
    ),
    Row(
        "unsupported architecture (model_type)",
        lambda ctx: _hf(ctx, lambda p: _edit_config(p, model_type="mistral")),
        "model_type='mistral' is not supported",
        dry=True,
    ),
    Row(
        "unsupported architecture key (tied embeddings)",
        lambda ctx: _hf(ctx, lambda p: _edit_config(p, tie_word_embeddings=True)),
        "tie_word_embeddings=true is not implemented",
        dry=True,
    ),
    # ---- datasets
    Row(
        "empty dataset",
        lambda ctx: [f"--config.data.source={ctx.data('')}"],
        "no rows",
        dry=True,
    ),
    Row(
        "malformed JSONL line",
        lambda ctx: [
            "--config.data.source="
            + str(ctx.data('{"prompt": "a", "label": "b"}\n\n{"prompt": "c", "label":\n'))
        ],
        "line 3 is not valid JSON",
        dry=True,
    ),
    Row(
        "missing field",
        lambda ctx: [
            "--config.data.source="
            + str(ctx.data('{"prompt": "a", "label": "b"}\n{"prompt": "c"}\n'))
        ],
        "line 2 is missing field(s) ['label']",
        dry=True,
    ),
    Row(
        "prompt longer than data.max_prompt_tokens",
        _args("--config.data.max_prompt_tokens=3"),
        "longer than data.max_prompt_tokens=3",
        dry=True,
    ),
    Row(
        "tokenizer vocabulary larger than the model's",
        lambda ctx: [f"--config.data.tokenizer={_hf_tokenizer(ctx.root / 'tok')}"],
        "more than the model's vocabulary of 64",
        dry=True,
    ),
    Row(
        "unsupported data file type",
        lambda ctx: [f"--config.data.source={ctx.data('prompt,label', 'p.csv')}"],
        "unsupported data file type '.csv'",
        dry=True,
    ),
    # ---- checkpoints (an existing run dir, resumed)
    Row(
        "checkpoint of another model shape",
        _resume("--config.model.hidden_size=64"),
        "was started with model.hidden_size=32; this run has model.hidden_size=64",
    ),
    Row(
        "checkpoint of another model shape (no config files)",
        _resume_mutated(_drop_run_configs, "--config.model.hidden_size=64"),
        "of shape (1, 64, 32) float32; this model has (1, 64, 64)",
    ),
    Row(
        "checkpoint of another algorithm",
        _resume(),
        "was started with algorithm='ppo'; this run has algorithm='grpo'",
        algorithm="grpo",
    ),
    Row(
        "checkpoint of another algorithm (no config files)",
        _resume_mutated(_drop_run_configs),
        "holds critic_opt, critic_params, which a grpo run does not have",
        algorithm="grpo",
    ),
    Row(
        "half-written checkpoint (an item missing)",
        _resume_mutated(lambda r: shutil.rmtree(r / "checkpoints" / "2" / "train_state")),
        "checkpoint 2 is incomplete: it lacks train_state",
    ),
    Row(
        "half-written checkpoint (counters cut short)",
        _resume_mutated(lambda r: _truncate(r / "checkpoints/2/train_state/metadata", 0.5)),
        "checkpoint 2 is corrupt: its train_state is unreadable",
    ),
    Row(
        "corrupt checkpoint metadata",
        _resume_mutated(lambda r: _corrupt_header(r / "checkpoints/2/actor_params/_METADATA")),
        "checkpoint 2 is corrupt: actor_params metadata is unreadable",
    ),
    Row(
        "truncated array data in the newest checkpoint",
        _resume_mutated(lambda r: _truncate(_first_file(r / "checkpoints/2/actor_params/d"), 0.5)),
        "checkpoint 2 lacks actor_params['blocks']['down_proj']: it is corrupt",
    ),
    # ---- resume with a config that changes the math (keys that do not are allowed: below)
    Row(
        "resume changing the model's dtype",
        _resume("--config.model.param_dtype=bfloat16"),
        "model.param_dtype='float32'; this run has model.param_dtype='bfloat16' (start a new",
    ),
    Row(
        "resume changing a loss hyper-parameter",
        _resume("--config.algo.clip_eps=0.3"),
        "was started with algo.clip_eps=0.2; this run has algo.clip_eps=0.3",
    ),
    Row(
        "resume changing the learning rate",
        _resume("--config.optim.lr=0.01"),
        "was started with optim.lr=0.001; this run has optim.lr=0.01",
    ),
    Row(
        "resume changing the seed",
        _resume("--config.seed=1"),
        "was started with seed=0; this run has seed=1",
    ),
    Row(
        "resume changing the data",
        _resume("--config.data.num_digits=5"),
        "was started with data.num_digits=4; this run has data.num_digits=5",
    ),
    # ---- the run dir cannot be written
    Row(
        "read-only run dir (simulated)",
        _existing_and(_simulate_write_error(errno.EROFS)),
        "is not writable: Read-only file system",
    ),
    Row(
        "full disk (simulated)",
        _simulate_write_error(errno.ENOSPC),
        "is not writable: No space left on device",
    ),
    Row(
        "run_dir is a file",
        lambda ctx: (ctx.run_dir.write_text("not a dir"), [])[1],
        "exists and is not a directory",
    ),
    # ---- rewards
    Row(
        "reward returning text",
        _args("--config.data.reward=tests.test_bad_inputs:text_reward"),
        "reward function 'tests.test_bad_inputs:text_reward' returned 'yes' (str)",
        dry=True,
    ),
    Row(
        "reward returning None",
        _args("--config.data.reward=tests.test_bad_inputs:none_reward"),
        "returned None (NoneType)",
        dry=True,
    ),
    Row(
        "reward function that does not exist",
        _args("--config.data.reward=tests.test_bad_inputs:no_such_reward"),
        "cannot import reward function",
        dry=True,
    ),
    # ---- loop budgets
    Row(
        "sft key without a warm start (it would be ignored)",
        _args("--config.sft.lr=0.01"),
        "sft.lr=0.01 is read only by a warm start",
        dry=True,
    ),
    Row("loop budget not K@N", _args("--config.model.loop_budget=2@x"), "is not K@N", dry=True),
    Row(
        "loop budget not starting at update 0",
        _args("--config.model.loop_budget=1@5,2@9"),
        "must start at 0 and increase",
        dry=True,
    ),
    Row(
        "loop budget deeper than the model",
        _args("--config.model.loop_budget=1@0,3@2"),
        "K=3 exceeds the model's num_loops=2",
        dry=True,
    ),
    Row(
        "loop budget deeper than the HF model",
        lambda ctx: _hf(ctx, lambda p: None) + ["--config.model.loop_budget=4@0"],
        "K=4 exceeds the model's num_loops=2",
    ),
    # ---- per-loop credit
    Row(
        "unknown loop credit",
        _args("--config.algo.loop_credit=first"),
        "algo.loop_credit must be one of 'last'/'uniform'/'progressive'/'exit_pdf' (got 'first')",
        dry=True,
    ),
    Row(
        "exit-pdf loop credit without an exit gate",
        _args("--config.algo.loop_credit=exit_pdf"),
        "algo.loop_credit=exit_pdf needs a model with an exit gate",
        dry=True,
    ),
    Row(
        "loop credit with the exit choice as an action",
        _args(
            "--config.model.family=ouro",
            "--config.rollout.early_exit=sample",
            "--config.algo.depth_as_action=true",
            "--config.algo.loop_credit=uniform",
        ),
        "algo.loop_credit=uniform with algo.depth_as_action is not supported",
        dry=True,
    ),
    # ---- early exit
    Row(
        "unknown early-exit mode",
        _args("--config.model.family=ouro", "--config.rollout.early_exit=always"),
        "rollout.early_exit must be one of 'none'/'threshold'/'sample' (got 'always')",
        dry=True,
    ),
    Row(
        "exit threshold outside (0, 1]",
        _args("--config.rollout.exit_threshold=1.5"),
        "rollout.exit_threshold must be in (0, 1] (got 1.5)",
        dry=True,
    ),
    Row(
        "depth as action without sampled exits",
        _args(
            "--config.model.family=ouro",
            "--config.rollout.early_exit=threshold",
            "--config.algo.depth_as_action=true",
        ),
        "algo.depth_as_action needs rollout.early_exit=sample",
        dry=True,
    ),
    Row(
        "early exit on a model without an exit gate",
        _args("--config.rollout.early_exit=sample"),
        "needs a model with an exit gate",
        dry=True,
    ),
    Row(
        "early exit on an HF model without an exit gate",
        lambda ctx: _hf(ctx, lambda p: None) + ["--config.rollout.early_exit=threshold"],
        "needs a model with an exit gate",
    ),
    Row(
        "early exit with sequence packing",
        _args(
            "--config.model.family=ouro",
            "--config.learner.pack_tokens=64",
            "--config.rollout.early_exit=sample",
        ),
        "with learner.pack_tokens is not supported",
        dry=True,
    ),
]


def _hf_tokenizer(path: Path) -> Path:
    from tests.data.test_tokenizer import _build_hf_tokenizer

    return _build_hf_tokenizer(path)


def _snapshot(root: Path) -> list:
    """(path, size, mtime) of everything under root: any write shows."""
    return sorted(
        (str(p.relative_to(root)), p.stat().st_size, p.stat().st_mtime_ns) for p in root.rglob("*")
    )


def _check(row: Row, tmp_path, capsys, monkeypatch, base_run, hf_dirs, dry_run: bool):
    ctx = Ctx(tmp_path, tmp_path / "run", base_run, hf_dirs, monkeypatch)
    extra = row.setup(ctx)
    existed = ctx.run_dir.exists()
    before = _snapshot(tmp_path)
    capsys.readouterr()
    argv = ["--config", f"{row.algorithm}.py", *BASE, f"--config.run_dir={ctx.run_dir}", *extra]
    code = main(argv + (["--dry-run"] if dry_run else []))
    out, err = capsys.readouterr()
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and out == "", (code, out, err)
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert row.message in lines[0], lines[0]
    assert ctx.run_dir.exists() == existed
    assert _snapshot(tmp_path) == before  # nothing written, nothing touched
    return lines[0]


@pytest.mark.parametrize("row", CATALOGUE, ids=[r.id for r in CATALOGUE])
def test_bad_input(row, tmp_path, capsys, monkeypatch, base_run, hf_dirs):
    _check(row, tmp_path, capsys, monkeypatch, base_run, hf_dirs, dry_run=False)


DRY = [r for r in CATALOGUE if r.dry]


@pytest.mark.parametrize("row", DRY, ids=[r.id for r in DRY])
def test_bad_input_dry_run(row, tmp_path, capsys, monkeypatch, base_run, hf_dirs):
    _check(row, tmp_path, capsys, monkeypatch, base_run, hf_dirs, dry_run=True)


def test_catalogue_size():
    assert len(CATALOGUE) >= 25
    assert len({r.id for r in CATALOGUE}) == len(CATALOGUE)


IN_A_FRESH_PROCESS = [
    "checkpoint of another algorithm",
    "corrupt checkpoint metadata",
    "truncated shard",
    "reward returning text",
]


@pytest.mark.parametrize("row_id", IN_A_FRESH_PROCESS)
def test_bad_input_in_a_fresh_process(row_id, tmp_path, monkeypatch, base_run, hf_dirs):
    """The real stderr of `python -m jaxloop.train` (no capture, every logger): one line."""
    row = next(r for r in CATALOGUE if r.id == row_id)
    ctx = Ctx(tmp_path, tmp_path / "run", base_run, hf_dirs, monkeypatch)
    extra = row.setup(ctx)
    before = _snapshot(tmp_path)
    argv = ["--config", f"{row.algorithm}.py", *BASE, f"--config.run_dir={ctx.run_dir}", *extra]
    proc = subprocess.run(
        [sys.executable, "-m", "jaxloop.train", *argv], capture_output=True, text=True
    )
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and proc.stdout == "", proc.stderr[-2000:]
    assert len(lines) == 1 and row.message in lines[0], proc.stderr[-2000:]
    assert _snapshot(tmp_path) == before


# ---- what a resume may change, and what it may not ----
def test_resume_with_keys_that_do_not_change_the_math(tmp_path, base_run):
    """Evaluation, checkpointing, logging, micro-batching and the mesh may change on resume."""
    run_dir = tmp_path / "run"
    shutil.copytree(base_run, run_dir)
    code = main(
        ["--config", f"{ALGO}.py", *BASE, f"--config.run_dir={run_dir}"]
        + ["--config.eval_every=5", "--config.keep_checkpoints=4", "--config.verbose=true"]
        + ["--config.mesh.fsdp=4", "--config.mesh.data=2", "--config.micro_batch_size=8"]
    )
    assert code == 0
    assert sorted(os.listdir(run_dir / "checkpoints")) == ["1", "2", "3"]
    rows = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
    assert [r["update"] for r in rows] == [0, 1, 2]


# how jaxloop before typed None keys wrote "off" / "detected" / "the default" in config.json
LEGACY_SPELLING = {
    "algo.clip_eps_high": -1.0,
    "algo.dual_clip": -1.0,
    "algo.behav_drop_cap": -1.0,
    "rollout.top_k": -1,
    "rollout.max_logprob_diff": 0.0,
    "learner.pack_tokens": 0,
    "model.logits_chunk": 0,
    "updates_per_rollout": 0,
    "stop_after": 0,
    "dist.num_processes": 0,
    "dist.process_id": -1,
}


def test_an_older_run_dirs_config_reads_as_todays(tmp_path, base_run, capsys):
    """A run dir whose config.json spells None as -1 / 0 (an older jaxloop) resumes: its keys of
    the run's math are read as None (`upgrade_stored`); an ordinary stored number stays one."""
    from jaxloop.config import upgrade_stored

    assert upgrade_stored(LEGACY_SPELLING) == dict.fromkeys(LEGACY_SPELLING)
    kept = {"mesh.fsdp": -1, "algo.value_clip": 0.2, "seed": 0, "eval_every": 5, "x.y": -1}
    assert upgrade_stored(kept) == kept
    run_dir = tmp_path / "run"
    shutil.copytree(base_run, run_dir)
    stored = json.loads((run_dir / "config.json").read_text())
    for key, value in LEGACY_SPELLING.items():
        section, _, name = key.rpartition(".")
        (stored[section] if section else stored)[name] = value
    (run_dir / "config.json").write_text(json.dumps(stored))
    args = ["--config", f"{ALGO}.py", *BASE, f"--config.run_dir={run_dir}", "--dry-run"]
    capsys.readouterr()
    assert main(args) == 0, capsys.readouterr().err
    assert "resumes at update 2 of 3" in capsys.readouterr().out
    assert main([*args, "--config.algo.dual_clip=2.0"]) == 2  # None (off) is the run's math
    assert "was started with algo.dual_clip=None" in capsys.readouterr().err


def test_which_keys_change_the_math():
    from jaxloop.config import base_config, flat_items

    cfg = base_config()
    free = {k for k, _ in flat_items(cfg) if not resume_changes_math(cfg, k)}
    assert {"eval_every", "progress", "micro_batch_size", "mesh.fsdp", "total_updates"} <= free
    assert {"rollout.engine", "model.remat", "dist.num_processes"} <= free
    for key in ("seed", "algorithm", "model.hidden_size", "model.param_dtype", "optim.lr"):
        assert resume_changes_math(cfg, key), key
    for key in ("algo.clip_eps", "critic.lr", "data.source", "rollout.temperature"):
        assert resume_changes_math(cfg, key), key
    assert resume_changes_math(cfg, "prompts_per_update")
    # total_updates shapes a decaying learning-rate schedule; critic keys need a critic
    with cfg.unlocked():
        cfg.optim.schedule = "cosine"
        cfg.algorithm = "grpo"
    assert resume_changes_math(cfg, "total_updates")
    assert not resume_changes_math(cfg, "critic.lr")


# ---- NaN / inf rewards: dropped and counted, not errors ----
def test_non_finite_rewards_are_dropped_and_counted(tmp_path, capsys):
    run_dir = tmp_path / "run"
    code = main(
        ["--config", f"{ALGO}.py", *BASE, f"--config.run_dir={run_dir}"]
        + [
            "--config.total_updates=2",
            "--config.data.reward=tests.test_bad_inputs:nan_or_inf_reward",
        ]
    )
    assert code == 0, capsys.readouterr().err
    rows = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
    assert len(rows) == 2
    for row in rows:
        assert row["dropped_samples"] + row["num_samples"] == 8
        assert math.isfinite(row["reward_mean"]) and math.isfinite(row["policy_loss"])
    assert sum(r["dropped_samples"] for r in rows) > 0


# ==== issue 22, part A: data loss, value domains, user code, skeleton run dirs, the boundary ====
def _contents(root: Path) -> dict[str, bytes | None]:
    """Every file's bytes (None for a directory) under root: compared byte for byte."""
    return {
        str(p.relative_to(root)): (None if p.is_dir() else p.read_bytes())
        for p in sorted(root.rglob("*"))
    }


def one_error_line(capsys, code: int, message: str) -> str:
    """An entry point returned `code` 2 and printed one line `error: ...` containing `message`
    (and nothing on stdout)."""
    out, err = capsys.readouterr()
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and out == "", (code, out, err)
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert message in lines[0], lines[0]
    return lines[0]


def _refused(argv: list[str], capsys, message: str) -> str:
    """main(argv) prints one line `error: ...` containing `message` and returns 2."""
    capsys.readouterr()
    return one_error_line(capsys, main(argv), message)


def _argv(run_dir, *extra: str, algorithm: str = ALGO) -> list[str]:
    return ["--config", f"{algorithm}.py", *BASE, f"--config.run_dir={run_dir}", *extra]


# ---- the three data-loss cases: refused, every old file byte for byte unchanged ----
@pytest.mark.parametrize("dry", [False, True], ids=["run", "dry-run"])
def test_empty_run_dir_is_refused(dry, tmp_path, capsys, monkeypatch):
    """`--config.run_dir=` would train in the current directory over its config.json."""
    (tmp_path / "config.json").write_text('{"mine": "precious"}\n')
    (tmp_path / "metrics.jsonl").write_text('{"update": 0}\n')
    monkeypatch.chdir(tmp_path)
    before = _contents(tmp_path)
    argv = [*_argv("x"), "--config.run_dir="] + (["--dry-run"] if dry else [])
    _refused(argv, capsys, "run_dir must be a non-empty string")
    assert _contents(tmp_path) == before


def test_resume_with_keep_checkpoints_0_is_refused(tmp_path, capsys, base_run):
    """keep_checkpoints=0 would keep none: the resume deleted every checkpoint of the run."""
    run_dir = tmp_path / "run"
    shutil.copytree(base_run, run_dir)
    before = _contents(tmp_path)
    for value in ("0", "-1"):
        for dry in ([], ["--dry-run"]):
            argv = _argv(run_dir, f"--config.keep_checkpoints={value}", *dry)
            _refused(argv, capsys, f"keep_checkpoints must be in [1, 2147483647] (got {value})")
            assert _contents(tmp_path) == before
    assert sorted(os.listdir(run_dir / "checkpoints")) == ["1", "2"]


@pytest.mark.parametrize("dry", [False, True], ids=["run", "dry-run"])
def test_rerun_over_another_runs_files_is_refused(dry, tmp_path, capsys, base_run):
    """A run dir whose checkpoints/ was moved away still holds the old run's config.json,
    metrics.jsonl and curves.png: a run of another algorithm there would start afresh over them."""
    run_dir = tmp_path / "run"
    shutil.copytree(base_run, run_dir)
    shutil.move(run_dir / "checkpoints", tmp_path / "moved_checkpoints")
    assert {"config.json", "metrics.jsonl", "curves.png"} <= set(os.listdir(run_dir))
    before = _contents(tmp_path)
    argv = _argv(run_dir, algorithm="grpo") + (["--dry-run"] if dry else [])
    line = _refused(argv, capsys, f"run dir {run_dir} holds config.json of another run")
    assert "algorithm='ppo' (this run has 'grpo')" in line and "no checkpoint" in line
    assert _contents(tmp_path) == before


def test_rerun_over_files_without_config_is_refused(tmp_path, capsys):
    """Run files without the config.json that would tell whose they are: refused, naming one."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text('{"update": 0, "reward_mean": 1.0}\n')
    before = _contents(tmp_path)
    _refused(_argv(run_dir), capsys, "holds metrics.jsonl of another run (no config.json)")
    assert _contents(tmp_path) == before


def test_restart_of_the_same_run_before_its_first_checkpoint(tmp_path, capsys):
    """Its own files (the same config.json, no checkpoint yet): the run starts again."""
    run_dir = tmp_path / "run"
    assert main(_argv(run_dir, "--config.total_updates=1", "--config.checkpoint_every=None")) == 0
    shutil.rmtree(run_dir / "checkpoints")
    assert main(_argv(run_dir, "--config.total_updates=1", "--config.checkpoint_every=None")) == 0
    assert [r["update"] for r in map(json.loads, open(run_dir / "metrics.jsonl"))] == [0]


# ---- value domains: every key's, declared once (jaxloop.config.DOMAINS, TYPES) ----
BASE_VALUES = dict(flat_items(base_config()))
NUMERIC_KEYS = [k for k, t in TYPES.items() if t.base in (int, float)]
# keys whose 0 is an ordinary value (docs/reliability.md, "Bad input"); all others refuse it
ACCEPTS_ZERO = {
    "seed",
    "rollout.max_staleness",  # synchronous
    "rollout.dynamic_sampling_rounds",  # off
    "optim.warmup_steps",
    "optim.weight_decay",
    "optim.b1",
    "optim.b2",
    "critic.warmup_updates",
    "algo.kl_coef",  # no reference model
    "algo.behav_weight_min",
    "algo.flow_delta",
    "algo.gamma",
    "algo.lam",
    "algo.entropy_coef",  # no bonus
    "dist.process_id",  # the first process
    "warm_start.sft_steps",  # no warm start
}
# keys whose -1 means something: the remaining devices
ACCEPTS_MINUS_ONE = {"mesh.data", "mesh.fsdp", "mesh.tensor"}
# keys that may be None: off, detected, or a default the help text names (never a number)
ACCEPTS_NONE = {
    "stop_after",  # off
    "updates_per_rollout",  # the algorithm's default
    "checkpoint_every",  # only after the last update
    "eval_every",  # only after the last update
    "resume_step",  # the newest checkpoint
    "model.logits_chunk",  # the whole sequence
    "rollout.top_k",  # off
    "rollout.max_logprob_diff",  # the engine's default bound
    "optim.grad_clip",  # off
    "learner.pack_tokens",  # padded
    "algo.clip_eps_high",  # clip_eps
    "algo.dual_clip",  # off
    "algo.behav_drop_cap",  # off
    "algo.value_clip",  # off
    "dist.num_processes",  # one, or detected
    "dist.process_id",  # detected
    "warm_start.stop_at_reward",  # every warm-start step
}
# in-domain values another rule refuses in this setting (the default mesh already has fsdp=-1)
CROSS_KEY_REFUSALS = {("mesh.data", "-1"), ("mesh.tensor", "-1")}
ALWAYS_BAD = {  # refused for every numeric key (and one past the key's upper bound: below)
    int: ["nan", "inf", "1.5", "abc", "", "-2147483649"],
    float: ["nan", "inf", "-inf", "1e39", "1e300", "-1e300", "abc", ""],
}


def test_every_key_has_a_domain():
    assert set(DOMAINS) == set(BASE_VALUES)
    base = base_config()
    validate(base)  # the defaults are in their domains
    assert {k for k in NUMERIC_KEYS if DOMAINS[k].contains(0)} == ACCEPTS_ZERO
    assert {k for k in NUMERIC_KEYS if DOMAINS[k].contains(-1)} == ACCEPTS_MINUS_ONE
    assert {k for k, t in TYPES.items() if t.optional} == ACCEPTS_NONE
    assert {k for k in DOMAINS if DOMAINS[k].contains(None)} == ACCEPTS_NONE
    # the choices agree with the modules that implement them
    from jaxloop.data.tasks import TASKS
    from jaxloop.models.presets import FULL_SIZE
    from jaxloop.rl.algorithms import ALGORITHMS
    from jaxloop.rl.losses import KL_ESTIMATORS, REDUCTIONS

    assert sorted(DOMAINS["algorithm"].choices) == sorted(ALGORITHMS)
    assert sorted(DOMAINS["data.task"].choices) == sorted(TASKS)
    assert sorted(DOMAINS["model.preset"].choices) == sorted(["", *FULL_SIZE])
    assert DOMAINS["algo.kl_estimator"].choices == KL_ESTIMATORS
    assert DOMAINS["algo.reduction"].choices == REDUCTIONS


def _dry(key: str, value: str, tmp_path, capsys) -> tuple[int, str]:
    """A dry run with --config.key=value: (exit code, the error line or '')."""
    before = _snapshot(tmp_path)
    capsys.readouterr()
    code = main(_argv(tmp_path / "run", f"--config.{key}={value}", "--dry-run"))
    out, err = capsys.readouterr()
    assert _snapshot(tmp_path) == before  # a dry run writes nothing
    if code == 0:
        return 0, ""
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and out == "", (key, value, code, err)
    assert len(lines) == 1 and lines[0].startswith("error: "), (key, value, err)
    return code, lines[0]


@pytest.mark.parametrize("key", NUMERIC_KEYS)
def test_value_domain(key, tmp_path, capsys):
    """For every numeric key: NaN, inf, huge, wrong type are refused (one line naming the key,
    exit 2, nothing written); 0 and -1 are refused unless the key gives them a meaning, None
    unless the key's type takes it."""
    kind = TYPES[key].base
    huge = [str(int(DOMAINS[key].hi) + 1)] if kind is int else []
    for value in ALWAYS_BAD[kind] + huge:
        code, line = _dry(key, value, tmp_path, capsys)
        assert code == 2 and key in line, (key, value, line)
    for value, accepted in (
        ("0", key in ACCEPTS_ZERO),
        ("-1", key in ACCEPTS_MINUS_ONE),
        ("None", key in ACCEPTS_NONE),
    ):
        code, line = _dry(key, value, tmp_path, capsys)
        if not accepted:
            assert code == 2 and key in line, (key, value, line)
        elif (key, value) in CROSS_KEY_REFUSALS:
            assert code == 2, (key, value)
        else:
            assert code == 0, (key, value, line)


CHOICE_KEYS = [k for k, d in DOMAINS.items() if d.choices]
NON_EMPTY_KEYS = [k for k, d in DOMAINS.items() if d.nonempty]


@pytest.mark.parametrize("key", CHOICE_KEYS + NON_EMPTY_KEYS)
def test_string_domain(key, tmp_path, capsys):
    """A value outside a key's choices (model.family=llama, model.param_dtype=int8, ...) or an
    empty one where a value is needed: refused in a dry run."""
    values = ["llama"] if key in CHOICE_KEYS else []
    values += [""] if "" not in DOMAINS[key].choices else []
    for value in values:
        code, line = _dry(key, value, tmp_path, capsys)
        assert code == 2 and key in line, (key, value, line)


# the list, through a real run too: refused before anything is written
REAL_RUN_VALUES = [
    ("optim.lr", "nan"),
    ("optim.lr", "-1"),
    ("rollout.temperature", "nan"),
    ("model.head_dim", "0"),
    ("model.num_kv_heads", "0"),
    ("model.num_heads", "0"),
    ("model.num_layers", "0"),
    ("model.num_loops", "0"),
    ("rollout.max_new_tokens", "0"),
    ("keep_checkpoints", "0"),
    ("seed", "-1"),
    ("seed", "99999999999"),
    ("mesh.data", "0"),
    ("model.param_dtype", "int8"),
    ("model.family", "llama"),
]


@pytest.mark.parametrize("key,value", REAL_RUN_VALUES, ids=[f"{k}={v}" for k, v in REAL_RUN_VALUES])
def test_value_domain_real_run(key, value, tmp_path, capsys):
    before = _snapshot(tmp_path)
    _refused(_argv(tmp_path / "run", f"--config.{key}={value}"), capsys, key)
    assert not (tmp_path / "run").exists() and _snapshot(tmp_path) == before


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["--config.model.num_heads=4", "--config.model.num_kv_heads=3"], "num_key_value_heads"),
        (["--config.model.head_dim=15"], "head_dim=15 must be even"),
        (["--config.mesh.data=-1"], "at most one axis may be -1"),
    ],
)
def test_model_rules_in_a_dry_run(overrides, message, tmp_path, capsys):
    """The model's own rules, which need no device: a dry run refuses them as the run does."""
    before = _snapshot(tmp_path)
    _refused(_argv(tmp_path / "run", *overrides, "--dry-run"), capsys, message)
    _refused(_argv(tmp_path / "run", *overrides), capsys, message)
    assert _snapshot(tmp_path) == before


# ---- user code: config files and reward functions ----
def one_arg_reward(response: str) -> float:
    return 1.0


def raising_reward(response: str, label: str) -> float:
    raise KeyError("no score for this")


def always_nan_reward(response: str, label: str) -> float:
    return float("nan")


def raises_on_samples_reward(response: str, label: str) -> float:
    """Fine on the checks' responses (the label, empty, the label and '?'), raises on a sampled
    response with any other character (a random policy writes them)."""
    if set(response) - set("0123456789?"):
        raise ValueError(f"cannot parse {response!r}")
    return 1.0 if response == label else 0.0


CONFIG_FILES = {
    "raises": ("def get_config():\n    raise RuntimeError('boom')\n", "RuntimeError: boom"),
    "not Python": ("config = {\ndef get_config(:\n", "SyntaxError: "),
    "raises on import": ("import no_such_module_xyz\n", "ModuleNotFoundError"),
    "no get_config": ("x = 1\n", "has no get_config()"),
    "wrong type": ("def get_config():\n    return {'seed': 0}\n", "returned dict, not a"),
    "keys missing": (
        "import ml_collections\ndef get_config():\n    return ml_collections.ConfigDict("
        "{'seed': 0})\n",
        "get_config() lacks key(s) run_dir, algorithm, total_updates",
    ),
    "wrong value type": (
        "from jaxloop.config import base_config\ndef get_config():\n    c = base_config()\n"
        "    c.total_updates = 'many'\n    return c\n",
        "TypeError",
    ),
}


@pytest.mark.parametrize("case", list(CONFIG_FILES))
@pytest.mark.parametrize("dry", [False, True], ids=["run", "dry-run"])
def test_config_file_user_code(case, dry, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(sys, "dont_write_bytecode", True)
    text, message = CONFIG_FILES[case]
    path = tmp_path / "my_config.py"
    path.write_text(text)
    before = _snapshot(tmp_path)
    argv = ["--config", str(path), f"--config.run_dir={tmp_path / 'run'}"]
    line = _refused(argv + (["--dry-run"] if dry else []), capsys, message)
    assert str(path) in line  # the file is named
    assert _snapshot(tmp_path) == before


REWARD_CODE = [
    ("tests.test_bad_inputs:one_arg_reward", "cannot be called as fn(response, label)"),
    ("tests.test_bad_inputs:raising_reward", "raised KeyError: 'no score for this'"),
    ("tests.test_bad_inputs:always_nan_reward", "returned a non-finite value (nan) for every"),
    ("broken_reward_module:fn", "cannot import reward function 'broken_reward_module:fn': "),
    ("syntax_reward_module:fn", "SyntaxError"),
    ("no_such_module_xyz:fn", "ModuleNotFoundError"),
]


@pytest.mark.parametrize("reward,message", REWARD_CODE, ids=[r for r, _ in REWARD_CODE])
@pytest.mark.parametrize("dry", [False, True], ids=["run", "dry-run"])
def test_reward_user_code(reward, message, dry, tmp_path, capsys, monkeypatch):
    """One line naming the function and the exception, exit 2, nothing written."""
    monkeypatch.setattr(sys, "dont_write_bytecode", True)
    mods = tmp_path / "mods"
    mods.mkdir()
    (mods / "broken_reward_module.py").write_text("raise RuntimeError('broken module')\n")
    (mods / "syntax_reward_module.py").write_text("def fn(response, label) return 1\n")
    monkeypatch.syspath_prepend(str(mods))
    before = _snapshot(tmp_path)
    argv = _argv(tmp_path / "run", f"--config.data.reward={reward}")
    line = _refused(argv + (["--dry-run"] if dry else []), capsys, message)
    assert reward in line
    assert _snapshot(tmp_path) == before


# ---- no skeleton run dir: a refused start leaves nothing behind ----
def test_reward_raising_on_sampled_responses(tmp_path, capsys):
    """It passes the checks before the run and raises on update 0's samples: the fresh run dir
    (run/, checkpoints/, config.json, metrics.jsonl) is removed again."""
    before = _snapshot(tmp_path)
    reward = "tests.test_bad_inputs:raises_on_samples_reward"
    argv = _argv(tmp_path / "a" / "run", f"--config.data.reward={reward}")
    _refused(argv, capsys, f"reward function '{reward}' raised ValueError: cannot parse")
    assert _snapshot(tmp_path) == before and not (tmp_path / "a").exists()


def test_reward_raising_on_resume_keeps_the_checkpoints(tmp_path, capsys, base_run, monkeypatch):
    """The same reward (a resume may not change it) starts raising: exit 2, checkpoints intact."""
    import tests.train.rewards as rewards

    run_dir = tmp_path / "run"
    shutil.copytree(base_run, run_dir)
    before = _contents(run_dir / "checkpoints")
    configs = {n: (run_dir / n).read_bytes() for n in ("config.json", "actor_config.json")}
    monkeypatch.setattr(rewards, "char_code_reward", raises_on_samples_reward)
    _refused(_argv(run_dir), capsys, "raised ValueError: cannot parse")
    assert _contents(run_dir / "checkpoints") == before
    assert {n: (run_dir / n).read_bytes() for n in configs} == configs


@pytest.mark.parametrize("existing", [False, True], ids=["new dir", "empty existing dir"])
def test_init_checkpoint_without_checkpoints(existing, tmp_path, capsys):
    init = tmp_path / "init"
    init.mkdir()
    (init / "actor_config.json").write_text(json.dumps(tiny_hf_config("nanbeige")))
    if existing:
        (tmp_path / "run").mkdir()
    before = _snapshot(tmp_path)
    argv = _argv(tmp_path / "run", f"--config.model.init_checkpoint={init}")
    _refused(argv + ["--dry-run"], capsys, "holds no checkpoint")
    _refused(argv, capsys, "holds no checkpoint")
    assert _snapshot(tmp_path) == before


def test_failure_after_the_run_dir_was_created_removes_it(tmp_path, capsys, monkeypatch):
    """The net under every check: a user error raised after the fresh run dir was written (here
    by the first update) removes what this start created, and only that."""
    from jaxloop.data.datasets import DataError
    from jaxloop.train.loop import Trainer

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "notes.txt").write_text("mine")

    def fail(self, update, last, bar):
        assert (self.run_dir / "config.json").is_file()  # written by now
        raise DataError("simulated bad data at update 0")

    monkeypatch.setattr(Trainer, "one_update", fail)
    before = _contents(tmp_path)
    _refused(_argv(run_dir), capsys, "simulated bad data at update 0")
    assert _contents(tmp_path) == before


# ---- the boundary: user errors are one line, anything else is a bug with its traceback ----
def test_a_bug_keeps_its_traceback(tmp_path, monkeypatch):
    import jaxloop.train.cli as train

    def broken(cfg):
        raise RuntimeError("a bug, not a bad input")

    monkeypatch.setattr(train, "preflight", broken)
    with pytest.raises(RuntimeError, match="a bug, not a bad input"):
        main(_argv(tmp_path / "run"))
    assert not (tmp_path / "run").exists()


def test_a_bug_exits_1_with_a_traceback_in_a_fresh_process(tmp_path):
    code = (
        "import sys, jaxloop.train.cli as t\n"
        "def bug(cfg):\n    raise ZeroDivisionError('bug')\n"
        "t.preflight = bug\n"
        f"sys.exit(t.main(['--config', 'ppo.py', '--config.run_dir={tmp_path / 'run'}']))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 1 and "Traceback" in proc.stderr, proc.stderr[-2000:]
    assert "ZeroDivisionError: bug" in proc.stderr and not (tmp_path / "run").exists()


SFT_REFUSALS = [
    (["--config.sft.lr=nan"], "sft.lr must be"),
    (["--config.sft.lr=0"], "sft.lr must be"),
    (["--config.keep_checkpoints=0"], "keep_checkpoints must be"),
    (["--config.model.head_dim=15"], "head_dim=15 must be even"),
    (["--config.run_dir="], "run_dir must be a non-empty string"),
]


@pytest.mark.parametrize("dry", [False, True], ids=["run", "dry-run"])
def test_sft_boundary(dry, tmp_path, capsys):
    """jaxloop.sft: the same domains, model rules, init_checkpoint check and boundary."""
    from jaxloop.sft import main as sft_main

    init = tmp_path / "init"
    init.mkdir()
    (init / "actor_config.json").write_text(json.dumps(tiny_hf_config("nanbeige")))
    refusals = SFT_REFUSALS + [([f"--config.model.init_checkpoint={init}"], "holds no checkpoint")]
    before = _snapshot(tmp_path)
    for overrides, message in refusals:
        capsys.readouterr()
        argv = ["--config", "sft.py", f"--config.run_dir={tmp_path / 'r'}", *overrides]
        code = sft_main(argv + (["--dry-run"] if dry else []))
        out, err = capsys.readouterr()
        lines = err.strip().splitlines()
        assert code == 2 and out == "" and len(lines) == 1 and message in lines[0], err
    assert _snapshot(tmp_path) == before


# ---- the non-finite guard checks what it commits ----
@pytest.mark.parametrize("tx_name", ["sgd lr=nan", "adam b1=nan", "adamw weight_decay=inf"])
def test_guard_never_commits_non_finite_parameters(tx_name):
    """A finite loss and gradient norm with a step that would write NaN / inf (a NaN learning
    rate or hyper-parameter): the update is skipped and counted, the parameters stay."""
    import jax
    import optax

    from tests.rl.test_learner import _arrays, _Run

    tx = {
        "sgd lr=nan": optax.sgd(float("nan")),
        "adam b1=nan": optax.adam(1e-3, b1=float("nan")),
        "adamw weight_decay=inf": optax.adamw(1e-3, weight_decay=float("inf")),
    }[tx_name]
    run = _Run("grpo", 8, tx=tx)
    before = jax.tree.map(np.array, run.state.actor_params)
    metrics = run.update(_arrays())
    assert np.isfinite(metrics["policy_loss"]) and np.isfinite(metrics["grad_norm"])
    assert metrics["skipped"] == 1.0 and int(run.state.skipped_updates) == 1
    assert run.state.version == 0
    after = jax.tree.map(np.asarray, run.state.actor_params)
    assert all(jax.tree.leaves(jax.tree.map(np.array_equal, before, after)))


def test_error_line_of_an_actor_error():
    """A user error raised in a Ray actor (the vLLM path's rollout manager scores the rewards)
    arrives as a RayTaskError that is also an instance of its cause's type: the one line is the
    cause's message, not Ray's multi-line header."""
    from jaxloop.errors import error_line, is_user_error
    from jaxloop.rollout.producer import RewardError

    cause = RewardError("reward function 'm:f' raised KeyError: 'x'")

    class FakeRayTaskError(RewardError):  # what ray.exceptions.RayTaskError.as_instanceof_cause
        def __init__(self):
            super().__init__("ray::RolloutManager.produce() (pid=1)\n  File ...\nTraceback")
            self.cause = cause

    err = FakeRayTaskError()
    assert is_user_error(err)
    assert error_line(err) == f"error: {cause}"
    assert error_line(RuntimeError("")) == "error: RuntimeError"
