"""Sharded training on 8 fake CPU devices: every mesh gives the parameters of one device (fp32,
<= 1e-5 relative, exported with conversion.to_hf) and the same first-update tokens; a checkpoint
saved on one mesh continues on another; parameters are really sharded; bad meshes are one-line
errors."""

import os
import shutil

import jax
import numpy as np
import pytest

from conversion.to_hf import main as to_hf
from jaxloop.config import parse_args
from jaxloop.io.hf import checkpoint_files, read_safetensors
from jaxloop.parallel import mesh as shd
from jaxloop.train.build import actor_config
from jaxloop.train.cli import main as train_main
from jaxloop.train.setup import TrainSetup
from tests.train.helpers import TINY, run_train

MESHES = {
    "dp2-fsdp2-tp2": ("--config.mesh.data=2", "--config.mesh.fsdp=2", "--config.mesh.tensor=2"),
    "fsdp8": ("--config.mesh.fsdp=8",),
    # the tiny model has 2 KV heads: over tensor=4 they are replicated
    "dp2-tp4": ("--config.mesh.data=2", "--config.mesh.fsdp=1", "--config.mesh.tensor=4"),
}
BASE = (
    *TINY,
    "--config.total_updates=2",
    "--config.checkpoint_every=1",
    "--config.rollout.max_new_tokens=3",
    # a reward that varies with every sampled character: advantages (and so updates) are non-zero
    "--config.data.reward=tests.train.rewards:char_code_reward",
)
TOL = 1e-5


@pytest.fixture(scope="module")
def straight_run(tmp_path_factory, env, one_device_env):
    """run(algorithm, mesh name or None for one device) -> (run_dir, rows) of the 2-update run:
    each made once per module (the fsdp8 PPO run is both a mesh under test and the straight run
    the moved checkpoints are compared with)."""
    runs = {}

    def run(algorithm, name):
        if (algorithm, name) not in runs:
            run_dir = tmp_path_factory.mktemp(f"{algorithm}-{name or 'single'}")
            mesh, target_env = (MESHES[name], env) if name else ((), one_device_env)
            rows = run_train(run_dir, f"{algorithm}.py", *BASE, *mesh, env=target_env)
            runs[algorithm, name] = run_dir, rows
        return runs[algorithm, name]

    return run


def _export(run_dir, out, role="actor", step=None) -> dict[str, np.ndarray]:
    args = ["--checkpoint", str(run_dir), "--out", str(out), "--dtype", "float32", "--role", role]
    if step is not None:
        args += ["--step", str(step)]
    assert to_hf(args) == 0
    tensors = {}
    for file in checkpoint_files(out):
        tensors.update({name: np.array(arr) for name, arr in read_safetensors(file)})
    return tensors


def _assert_close(got: dict, want: dict, what: str) -> float:
    """Per tensor ||got - want|| / ||want||. (An elementwise max is the wrong yardstick after Adam
    steps: an entry whose gradient is ~0 moves by about +-lr either way, so fp32 summation order
    alone gives it a 1e-5 difference; a sharding bug shows up as O(1) in either measure.)"""
    assert got.keys() == want.keys()
    worst = 0.0
    for name in want:
        rel = np.linalg.norm(got[name] - want[name]) / max(np.linalg.norm(want[name]), 1e-30)
        worst = max(worst, float(rel))
    assert worst <= TOL, f"{what}: relative difference {worst:.3g} > {TOL}"
    return worst


def _roles(algorithm):
    return ("actor",) if algorithm == "grpo" else ("actor", "critic")


# PPO (actor and critic) on every mesh; the other algorithms on the mixed one, which shards
# every axis (the meshes differ in placement only, the algorithms in the math on top of it)
@pytest.mark.parametrize(
    "algorithm,meshes",
    [
        ("ppo", tuple(MESHES)),
        ("grpo", ("dp2-fsdp2-tp2",)),
        ("dppo", ("dp2-fsdp2-tp2",)),
        ("flow_dppo", ("dp2-fsdp2-tp2",)),
    ],
)
def test_meshes_equal_one_device(tmp_path, algorithm, meshes, straight_run):
    single, rows = straight_run(algorithm, None)
    want = {role: _export(single, tmp_path / f"single-{role}", role) for role in _roles(algorithm)}
    for name in meshes:
        run_dir, mesh_rows = straight_run(algorithm, name)
        assert mesh_rows[0]["tokens_checksum"] == rows[0]["tokens_checksum"], name
        for role in _roles(algorithm):
            got = _export(run_dir, tmp_path / f"{name}-{role}", role)
            _assert_close(got, want[role], f"{algorithm} {name} {role}")
    # the update moved the parameters: the comparison is not between two initialisations
    init = _export(single, tmp_path / "single-step1", "actor", step=1)
    assert any(np.abs(init[k] - want["actor"][k]).max() > 1e-6 for k in init)


@pytest.mark.parametrize("algorithm", ["ppo"])  # actor and critic (and their optimizer states)
def test_checkpoint_moves_between_meshes(tmp_path, algorithm, env, one_device_env, straight_run):
    """Saved on fsdp=8 after update 1; update 2 on data=2 x tensor=4 (and on one device) equals
    the run that never stopped."""
    straight, _ = straight_run(algorithm, "fsdp8")
    want = {
        role: _export(straight, tmp_path / f"straight-{role}", role) for role in _roles(algorithm)
    }
    # the run stopped after update 1 on fsdp=8, once; each target resumes its own copy of it
    stopped = tmp_path / "stopped"
    run_train(stopped, f"{algorithm}.py", *BASE, *MESHES["fsdp8"], "--config.stop_after=1", env=env)
    for name, target_env, mesh in (
        ("dp2-tp4", env, MESHES["dp2-tp4"]),
        ("one-device", one_device_env, ()),
    ):
        moved = tmp_path / name
        shutil.copytree(stopped, moved)
        rows = run_train(moved, f"{algorithm}.py", *BASE, *mesh, env=target_env)
        assert [r["update"] for r in rows] == [0, 1]
        for role in _roles(algorithm):
            got = _export(moved, tmp_path / f"{name}-{role}", role)
            _assert_close(got, want[role], f"{algorithm} resumed on {name} {role}")


def _config(*overrides: str):
    """ppo.py with TINY's and then these `--config.key=value`, parsed as the command line is."""
    return parse_args(["--config", "ppo.py", *TINY, *overrides])


def test_fsdp8_shards_parameter_bytes():
    """With fsdp=8 no device holds more than 1/8 of the actor's, the critic's or the optimizer
    state's bytes plus the replicated vectors; on one device the same check fails."""
    cfg = _config("--config.mesh.fsdp=8")
    model_cfg = actor_config(cfg)
    training = TrainSetup(cfg, model_cfg, shd.make_mesh(fsdp=8))
    state = training.fresh_state()
    for tree in (state.actor_params, state.critic_params, state.actor_opt):
        shd.assert_params_sharded(tree, 8)
    held = shd.per_device_bytes(state.actor_params)
    total = sum(x.nbytes for x in jax.tree.leaves(state.actor_params))
    assert len(held) == 8 and max(held.values()) < total / 4
    single = TrainSetup(cfg, model_cfg, shd.make_mesh(fsdp=1, devices=jax.devices()[:1]))
    with pytest.raises(AssertionError, match="holds"):
        shd.assert_params_sharded(single.fresh_state().actor_params, 8)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["--config.mesh.data=3"], "does not divide 8 devices"),
        (["--config.mesh.fsdp=3"], "mesh data=1 x fsdp=3 x tensor=1 = 3 devices, but 8 are"),
        (["--config.mesh.fsdp=2", "--config.mesh.tensor=-1", "--config.mesh.data=-1"], "at most"),
        (
            ["--config.mesh.fsdp=1", "--config.mesh.tensor=8", "--config.model.num_heads=4"],
            "mesh.tensor=8 does not divide the model's query heads (4)",
        ),
        (
            [
                "--config.mesh.fsdp=2",
                "--config.mesh.tensor=4",
                "--config.model.intermediate_size=66",
            ],
            "MLP width",
        ),
        (["--config.mesh.fsdp=8", "--config.micro_batch_size=4"], "micro_batch_size=4 is not"),
        (
            [
                "--config.mesh.fsdp=8",
                "--config.prompts_per_update=3",
                "--config.n_samples_per_prompt=2",
            ],
            "samples per update=6 is not divisible",
        ),
    ],
)
def test_bad_mesh_is_one_line_error(tmp_path, capsys, overrides, message):
    run_dir = tmp_path / "run"
    code = train_main(["--config", "ppo.py", f"--config.run_dir={run_dir}", *overrides])
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert len(err.splitlines()) == 1 and err.startswith("error: ") and message in err, err
    assert not os.path.exists(run_dir)


def test_embedded_sampler_generates_with_the_trainer_arrays(tmp_path):
    """Publication into the embedded sampler is zero-copy: after publish() the engine holds the
    train state's own (sharded) arrays, and generates on the mesh."""
    from jaxloop.rollout.types import PromptRequest, SamplingConfig
    from jaxloop.train.loop import Trainer

    cfg = _config("--config.mesh.fsdp=8", f"--config.run_dir={tmp_path / 'run'}")
    trainer = Trainer(cfg)
    try:
        trainer.publish()
        engine = trainer.producer.engine
        served = {id(x) for x in jax.tree.leaves(engine._state)}
        assert served == {id(x) for x in jax.tree.leaves(trainer.state.actor_params)}
        q = trainer.state.actor_params["blocks"]["q_proj"]
        assert "fsdp" in q.sharding.spec and len(q.addressable_shards) == 8
        requests = [PromptRequest((1, 5, 6), seed=k, group_id=k, sample_index=k) for k in range(3)]
        samples = engine.generate(requests, SamplingConfig(max_new_tokens=4))
        assert [len(s.response_ids) for s in samples] == [4, 4, 4]
        assert all(s.policy_version == 0 for s in samples)
    finally:
        trainer.producer.close()
        trainer.checkpointer.close()
