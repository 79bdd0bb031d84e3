"""scripts/bench_peers.py's pure parts (no peer, no jaxloop run): arguments, the rotated order,
the command lines (the jaxloop one through the trainer's dry run), and the medians, ratios and
JSON line from synthetic per-update records."""

import importlib.util
import json
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "bench_peers.py"


@pytest.fixture(scope="module")
def bp():
    spec = importlib.util.spec_from_file_location("bench_peers", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_peers"] = module
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop("bench_peers", None)


@pytest.mark.parametrize("model", ["A", "B"])
def test_jaxloop_command_line_is_a_valid_run(bp, model, tmp_path, capsys):
    """The benchmark's jaxloop command passes the trainer's own checks (a dry run)."""
    from jaxloop.train.cli import main

    args = bp.jaxloop_train_args(model, 3, [], str(tmp_path / "run"))
    assert main([*args, "--dry-run"]) == 0, capsys.readouterr().err


def test_defaults(bp, monkeypatch):
    monkeypatch.setenv("TRL_PYTHON", "/x/trl/python")
    monkeypatch.delenv("TUNIX_PYTHON", raising=False)
    a = bp.parse_args([])
    assert a.systems == ["jaxloop", "tunix", "trl"]
    assert a.models == ["A", "B"]
    assert (a.updates, a.drop, a.reps) == (14, 2, 3)
    assert a.jaxloop_python == sys.executable
    assert a.trl_python == "/x/trl/python"
    assert a.tunix_python == "/work/peers/tunix-venv/bin/python"
    assert a.variants == {} and a.jaxloop_extra == []


def test_variants_and_jaxloop_args(bp):
    a = bp.parse_args(
        [
            "--systems=jaxloop,jaxloop:flat,trl_passive,tunix_pl16",
            "--models=A",
            "--variant=flat=--config.model.loop_budget=2@0,3@4,--config.learner.pack_tokens=64",
            "--jaxloop-arg=--config.optim.lr=0.002",
            "--jaxloop-arg=--config.model.remat=full",
        ]
    )
    assert a.variants == {
        "flat": ["--config.model.loop_budget=2@0,3@4", "--config.learner.pack_tokens=64"]
    }
    assert a.jaxloop_extra == ["--config.optim.lr=0.002", "--config.model.remat=full"]
    base = bp.jaxloop_train_args("A", 14, bp.system_extra(a, "jaxloop"), "RUN")
    flat = bp.jaxloop_train_args("A", 14, bp.system_extra(a, "jaxloop:flat"), "RUN")
    assert base[:2] == ["--config", "grpo.py"]
    keys = [x.split("=", 1)[0] for x in base[2:]]
    assert len(keys) == len(set(keys))  # an override replaces the workload's value
    assert "--config.optim.lr=0.002" in base and "--config.optim.lr=0.001" not in base
    assert "--config.model.remat=full" in base and "--config.model.remat=none" not in base
    assert (
        "--config.learner.pack_tokens=64" in flat and "--config.learner.pack_tokens=64" not in base
    )
    assert "--config.model.loop_budget=2@0,3@4" in flat
    for arg in (
        "--config.model.num_layers=2",
        "--config.model.num_loops=2",
        "--config.model.hidden_size=256",
        "--config.updates_per_rollout=1",
        "--config.warm_start.sft_steps=0",
        "--config.data.num_digits=8",
        "--config.data.reward=format",
        "--config.rollout.max_new_tokens=32",
        "--config.eval_every=None",
        "--config.checkpoint_every=None",
        "--config.progress=false",
        "--config.total_updates=14",
        "--config.run_dir=RUN",
    ):
        assert arg in base
    b = bp.jaxloop_train_args("B", 5, [], "R")
    assert "--config.model.num_layers=4" in b and "--config.model.num_loops=1" in b


@pytest.mark.parametrize(
    "argv",
    [
        ["--systems=jaxloop,pytorch"],
        ["--systems=jaxloop:nope"],
        ["--systems=trl,trl"],
        ["--models=C"],
        ["--variant=x=--model.a=1"],
        ["--variant=--config.a=1"],
        ["--jaxloop-arg=--dry-run"],
        ["--updates=2", "--drop=2"],
    ],
)
def test_refused_arguments(bp, argv, capsys):
    with pytest.raises(SystemExit) as err:
        bp.parse_args(argv)
    assert err.value.code == 2


def test_order_rotates_per_repeat(bp):
    systems = ["jaxloop", "tunix", "trl"]
    order = bp.schedule(3, ["A", "B"], systems)
    assert len(order) == 3 * 2 * 3
    assert [s for rep, m, s in order if (rep, m) == (0, "A")] == ["jaxloop", "tunix", "trl"]
    assert [s for rep, m, s in order if (rep, m) == (1, "B")] == ["tunix", "trl", "jaxloop"]
    assert [s for rep, m, s in order if (rep, m) == (2, "A")] == ["trl", "jaxloop", "tunix"]
    for pos in range(3):  # every system in every position once, per model
        assert sorted(order[rep * 6 + pos][2] for rep in range(3)) == sorted(systems)
    assert bp.schedule(2, ["A"], ["jaxloop"]) == [(0, "A", "jaxloop"), (1, "A", "jaxloop")]


def test_environments(bp, monkeypatch):
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    trl = bp.system_env("trl", 2, "cpu")
    passive = bp.system_env("trl_passive", 2, "cpu")
    jl = bp.system_env("jaxloop:x", 2, "cpu")
    assert trl["OMP_NUM_THREADS"] == "2" and "OMP_WAIT_POLICY" not in trl
    assert passive["OMP_WAIT_POLICY"] == "PASSIVE"
    assert jl["JAX_PLATFORMS"] == "cpu" and "OMP_WAIT_POLICY" not in jl
    assert [bp.kind(s) for s in ("jaxloop", "jaxloop:a", "tunix_pl16", "trl_passive")] == [
        "jaxloop",
        "jaxloop",
        "tunix",
        "trl",
    ]


def _jaxloop_rows(n, gen, old, upd):
    return [
        {
            "update": i,
            "time_generate": gen + (5.0 if i == 0 else 0.0),  # compilation: dropped
            "time_old_logprobs": old,
            "time_update": upd,
            "time_total": gen + old + upd + 0.01,
            "response_length": 25.0,
            "num_samples": 64.0,
        }
        for i in range(n)
    ]


def _trl_steps(n, rollout, upd):
    return [
        {
            "step": i,
            "rollout_s": rollout,
            "generate_s": rollout - 0.01,
            "update_s": upd,
            "step_s": rollout + upd,
            "completion_tokens": 1600,
        }
        for i in range(n)
    ]


def _tunix_rows(n, gen, upd):
    rows = [
        {
            "update": i,
            "time_generate": gen - 0.02,
            "time_gen_and_adv": gen,
            "time_update": upd,
            "time_total": gen + upd,
            "generated_tokens": 1500.0,
        }
        for i in range(n)
    ]
    return rows + [{"summary": True, "framework": "tunix"}]


def test_medians_ratios_and_json_line(bp):
    drop, n = 2, 4
    runs = []
    for rep, upd in enumerate((0.6, 0.8)):  # jaxloop's update: 0.6, then 0.8 -> median 0.7
        runs.append(
            {
                "rep": rep,
                "model": "A",
                "system": "jaxloop",
                "rc": 0,
                "wall_s": 30.0,
                "records": bp.records_jaxloop(_jaxloop_rows(n, 0.2, 0.1, upd)),
            }
        )
        runs.append(
            {
                "rep": rep,
                "model": "A",
                "system": "trl",
                "rc": 0,
                "wall_s": 20.0,
                "records": bp.records_trl(_trl_steps(n, 0.25, 0.35)),
            }
        )
        runs.append(
            {
                "rep": rep,
                "model": "A",
                "system": "tunix",
                "rc": 0,
                "wall_s": 25.0,
                "records": bp.records_tunix(_tunix_rows(n, 0.4, 0.5)),
            }
        )
    runs.append(  # a failed run counts as failed and adds no updates
        {
            "rep": 2,
            "model": "A",
            "system": "trl",
            "rc": 1,
            "wall_s": 1.0,
            "records": bp.records_trl(_trl_steps(n, 9.0, 9.0)),
        }
    )
    summary = bp.aggregate(runs, drop)
    jl, trl, tunix = (summary["A"][s] for s in ("jaxloop", "trl", "tunix"))
    assert jl["generate"]["median"] == pytest.approx(0.2)  # update 0's 5.2 s was dropped
    assert jl["generate"]["n"] == 2 * (n - drop)
    assert jl["update"]["median"] == pytest.approx(0.7)
    assert jl["learner"]["median"] == pytest.approx(0.8)
    assert jl["total"]["median"] == pytest.approx(1.01)
    assert jl["tokens"]["median"] == pytest.approx(1600)
    assert jl["run_medians_total"] == pytest.approx([0.91, 1.11])
    assert trl["old_logprobs"] is None and tunix["old_logprobs"] is None
    assert trl["generate"]["median"] == pytest.approx(0.25)  # not 9.0: the failed run is out
    assert (trl["runs_ok"], trl["runs_failed"]) == (2, 1)
    assert tunix["generate"]["median"] == pytest.approx(0.4)  # generate + rewards + advantages
    assert tunix["engine"]["median"] == pytest.approx(0.38)

    ratio = bp.ratios(summary)
    assert set(ratio["A"]) == {"jaxloop/trl", "jaxloop/tunix"}
    r = ratio["A"]["jaxloop/trl"]
    assert r["generate"] == pytest.approx(0.2 / 0.25)
    assert r["update"] == pytest.approx(0.7 / 0.35)
    assert r["learner"] == pytest.approx(0.8 / 0.35)
    assert r["total"] == pytest.approx(1.01 / 0.6)
    assert "old_logprobs" not in r  # the peers run no such pass
    assert ratio["A"]["jaxloop/tunix"]["total"] == pytest.approx(1.01 / 0.9)

    table = bp.markdown(summary, ratio)
    assert "| A | jaxloop | 0.200 | 0.100 | 0.700 | 0.800 | 1.010 (" in table
    assert "| A | trl | 0.250 | - | 0.350 | 0.350 | 0.600 (0.600-0.600) | 1600 | 4 | 2/3 |" in table
    assert "| A | jaxloop/trl | 0.80 | - | 2.00 | 2.29 | 1.68 |" in table

    line = bp.json_line(summary, ratio, {"load_before": [0.5, 0.4, 0.3]})
    assert "\n" not in line
    data = json.loads(line)
    assert data["load_before"] == [0.5, 0.4, 0.3]
    assert data["medians"]["A"]["jaxloop"]["update"] == pytest.approx(0.7)
    assert data["medians"]["A"]["trl"]["old_logprobs"] is None
    assert data["ratios"]["A"]["jaxloop/tunix"]["update"] == pytest.approx(1.4)
    assert data["failed_runs"] == {"A/trl": 1}


def test_variant_ratios_against_jaxloop(bp):
    def run(system, upd):
        rows = _jaxloop_rows(3, 0.2, 0.1, upd)
        return {"model": "B", "system": system, "rc": 0, "wall_s": 1.0, "records": rows}

    runs = [run("jaxloop", 0.6), run("jaxloop:fast", 0.3)]
    for r in runs:
        r["records"] = bp.records_jaxloop(r["records"])
    ratio = bp.ratios(bp.aggregate(runs, 1))
    assert list(ratio["B"]) == ["jaxloop:fast/jaxloop"]
    assert ratio["B"]["jaxloop:fast/jaxloop"]["update"] == pytest.approx(0.5)
    assert ratio["B"]["jaxloop:fast/jaxloop"]["old_logprobs"] == pytest.approx(1.0)


def test_print_commands(bp, capsys, tmp_path):
    argv = ["--print-commands", "--reps=1", "--models=B", "--work", str(tmp_path)]
    assert bp.main([*argv, "--systems=trl_passive,tunix_pl16,jaxloop"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert [x.split()[-3] for x in out if x.startswith("# ")] == [
        "trl_passive",
        "tunix_pl16",
        "jaxloop",
    ]
    trl, tunix, jl = (x for x in out if not x.startswith("# "))
    assert "trl_grpo.py" in trl and f"--prep {tmp_path}/prep/B" in trl and "--threads 2" in trl
    assert "--max-prompt-length 16" in tunix and "--num-layers 4" in tunix
    assert "--reward format" in tunix
    assert "-m jaxloop.train --config grpo.py" in jl and "--config.model.num_layers=4" in jl
    assert not any(tmp_path.iterdir())  # nothing was run or written
