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
        ["--workload=bogus"],
        ["--matmul-n=0"],
        ["--curve", "--jaxloop-arg=--config.rollout.max_new_tokens=8"],
        ["--curve", "--variant=x=--config.prompts_per_update=4", "--systems=jaxloop:x"],
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
    assert [s for rep, m, _, s in order if (rep, m) == (0, "A")] == ["jaxloop", "tunix", "trl"]
    assert [s for rep, m, _, s in order if (rep, m) == (1, "B")] == ["tunix", "trl", "jaxloop"]
    assert [s for rep, m, _, s in order if (rep, m) == (2, "A")] == ["trl", "jaxloop", "tunix"]
    for pos in range(3):  # every system in every position once, per model
        assert sorted(order[rep * 6 + pos][3] for rep in range(3)) == sorted(systems)
    assert bp.schedule(2, ["A"], ["jaxloop"]) == [
        (0, "A", None, "jaxloop"),
        (1, "A", None, "jaxloop"),
    ]


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
    assert "trl_grpo.py" in trl and f"--prep {tmp_path}/prep/B_p8" in trl and "--threads 2" in trl
    assert "--max-new-tokens 32 --prompts-per-step 8 --group 8 --lr 0.001" in trl
    assert "--max-prompt-length 16" in tunix and "--num-layers 4" in tunix
    assert "--reward format" in tunix
    assert "-m jaxloop.train --config grpo.py" in jl and "--config.model.num_layers=4" in jl
    assert not any(tmp_path.iterdir())  # nothing was run or written


# ---- --workload long, --curve and the limit (issue 38) ----
def test_long_workload_keys_and_levers(bp):
    short, long = bp.setting_keys("short"), bp.setting_keys("long")
    assert short == {**bp.WORKLOAD, "micro_batch_size": 64}  # today's workload unchanged
    assert "learner.pack_tokens" not in short
    assert long["rollout.max_new_tokens"] == 256 and long["optim.lr"] == 1e-5
    assert long["learner.pack_tokens"] == 384 >= long["data.max_prompt_tokens"] + 256
    at64 = bp.setting_keys("long", (64, 16))
    assert at64["learner.pack_tokens"] == 16 + 64 and at64["micro_batch_size"] == 128
    assert bp.setting_keys("long", (128, 8))["learner.pack_tokens"] == 384
    assert bp.setting_keys("long", (512, 8))["learner.pack_tokens"] == 16 + 512
    assert at64["prompts_per_update"] == 16


@pytest.mark.parametrize("workload", ["short", "long"])
def test_long_and_curve_command_lines_are_valid_runs(bp, workload, tmp_path, capsys):
    """Every jaxloop command of the long workload and of the curve's largest points passes the
    trainer's checks (pack_tokens against the prompt limit, micro-batches)."""
    from jaxloop.train.cli import main

    for setting in [None, (256, 8), (32, 32)]:
        args = bp.jaxloop_train_args("A", 3, [], str(tmp_path / "run"), workload, setting)
        assert main([*args, "--dry-run"]) == 0, capsys.readouterr().err


def test_curve_points_and_schedule(bp):
    points = bp.curve_points()
    assert points == [(32, 8), (64, 8), (128, 8), (256, 8), (32, 16), (32, 32)]
    a = bp.parse_args(["--curve", "--models=A", "--systems=jaxloop,trl", "--reps=2"])
    order = bp.schedule(a.reps, a.models, a.systems, a.settings)
    assert len(order) == 2 * 6 * 2
    assert [(st, s) for rep, _, st, s in order if rep == 0][:2] == [
        ((32, 8), "jaxloop"),
        ((32, 8), "trl"),
    ]
    assert [s for rep, _, st, s in order if (rep, st) == (1, (256, 8))] == ["trl", "jaxloop"]
    assert bp.parse_args(["--workload=long"]).settings == [(256, 8)]
    assert bp.parse_args([]).settings == [(32, 8)]


def test_growth_factors(bp):
    assert bp.growth_factors([1.0, 2.0, 3.0, 3.0]) == [2.0, 1.5, 1.0]
    assert bp.growth_factors([1.0, None, 4.0]) == [None, None]
    assert bp.growth_factors([2.0]) == []


def test_flops_counting(bp):
    shape = bp.SHAPE
    # q, o: 256 x 256; k, v: 256 x 128; gate, up, down: 256 x 512
    assert bp.layer_params(shape) == 2 * 65536 + 2 * 32768 + 3 * 131072
    n = 4 * bp.layer_params(shape) + 256 * 64  # four layer applications and the LM head
    flops = bp.train_flops(shape, 4, tokens=6400, rows=64)  # 100 tokens per sample
    assert flops == pytest.approx(6 * n * 6400 + 12 * 4 * 256 * 6400 * 100)
    # model A (2 layers x 2 loops) counts as many FLOPs as B and the peers (4 layers)
    records = [{"index": 0, "tokens": 1000.0, "prompt_tokens": 640, "learner": 2.0, "total": 4.0}]
    bp.add_work(records, "A", (32, 8))
    r = records[0]
    assert r["real_tokens"] == 1640
    assert r["flops"] == pytest.approx(bp.train_flops(shape, 4, 1640, 64))
    assert r["flop_per_s"] == pytest.approx(r["flops"] / 2.0)
    assert r["s_per_1k_tokens"] == pytest.approx(4.0)
    no_prompts = [{"index": 0, "tokens": 10.0, "learner": 1.0, "total": 1.0}]
    bp.add_work(no_prompts, "B", (32, 8))
    assert "flops" not in no_prompts[0]  # nothing counted from half the tokens


def test_matmul_limit_is_the_best_rate(bp):
    ms = [{"jax": {"gflop_per_s": 100.0}, "torch": {"error": "x"}}, {"jax": {"gflop_per_s": 120.0}}]
    assert bp.matmul_limit(ms) == pytest.approx(120e9)
    assert bp.matmul_limit([{"jax": {"error": "no"}}]) is None


def test_matmul_probe_counts_2n3():
    spec = importlib.util.spec_from_file_location("bench_matmul", SCRIPT.parent / "bench_matmul.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.matmul_flops(2048) == 2 * 2048**3


def _long_rows(n, lengths):
    rows = _jaxloop_rows(n, 1.0, 0.0, 2.0)
    for r in rows:
        r.update(
            response_tokens=float(sum(lengths)),
            response_length_min=float(min(lengths)),
            response_length_median=float(sorted(lengths)[len(lengths) // 2]),
            response_length_max=float(max(lengths)),
            response_at_cap=sum(x == 256 for x in lengths) / len(lengths),
            prompt_tokens=10.0 * len(lengths),
        )
    return rows


def test_length_stats_work_table_and_curve(bp, tmp_path):
    lengths = [3, 40, 60, 256]
    runs = []
    for setting, total_scale in (((32, 8), 1.0), ((64, 8), 1.8), ((32, 16), 1.5)):
        rows = _long_rows(3, lengths)
        for r in rows:
            r["time_total"] *= total_scale
        records = bp.records_jaxloop(rows)
        bp.add_work(records, "A", setting)
        group = bp.group_label("A", setting, True)
        runs.append({"model": "A", "group": group, "system": "jaxloop", "rc": 0, "wall_s": 1.0})
        runs[-1]["records"] = records
        steps = _trl_steps(3, 1.0, 3.0)
        for st in steps:
            st.update(len_min=2.0, len_median=45.0, len_max=256.0, at_cap=0.02, prompt_tokens=40)
        trl = bp.records_trl(steps)
        bp.add_work(trl, "A", setting)
        runs.append({**runs[-1], "system": "trl", "records": trl})
    summary = bp.aggregate(runs, 1)
    jl = summary["A t32p8"]["jaxloop"]
    assert jl["tokens"]["median"] == 359 and jl["len_max"]["median"] == 256
    assert jl["at_cap"]["median"] == 0.25 and jl["real_tokens"]["median"] == 399
    assert jl["flop_per_s"]["median"] == pytest.approx(bp.train_flops(bp.SHAPE, 4, 399, 64) / 2.0)
    table = bp.work_markdown(summary, 10e9)
    assert "| A t32p8 | jaxloop | 359 | 3 / 60 / 256 | 25.0% |" in table
    share = bp.train_flops(bp.SHAPE, 4, 399, 64) / 2.0 / 10e9
    assert f"{share:.1%} |" in table and "(10 GFLOP/s)" in table
    line = json.loads(bp.json_line(summary, {}, {"work": bp.work_json(summary, 10e9)}))
    assert line["work"]["A t32p8"]["trl"]["len_median"] == 45.0
    assert line["work"]["A t32p8"]["jaxloop"]["of_limit"] == pytest.approx(share, abs=1e-4)

    curve = bp.curve_data(summary, ["A"], ["jaxloop", "trl"])
    tokens = curve["A"]["jaxloop"]["tokens"]
    assert tokens["x"] == [32, 64, 128, 256]
    assert tokens["seconds"][:2] == pytest.approx([3.01, 3.01 * 1.8])
    assert tokens["seconds"][2:] == [None, None]  # not measured here
    assert tokens["growth"][0] == pytest.approx(1.8) and tokens["growth"][1:] == [None, None]
    assert curve["A"]["jaxloop"]["prompts"]["growth"][0] == pytest.approx(1.5)
    text = bp.curve_markdown(curve)
    assert "| A | jaxloop | 3.010 s | 5.418 s (x1.80) | - | - |" in text
    assert "| A | jaxloop | 3.010 s | 4.515 s (x1.50) | - |" in text
    png = tmp_path / "curve.png"
    assert bp.plot_curve(curve, png) and png.stat().st_size > 1000


def test_tunix_prompt_tokens_from_the_prep(bp, tmp_path):
    prompts = [{"ids": [1] * n} for n in (10, 11, 12, 13)]
    (tmp_path / "prompts.json").write_text(json.dumps(prompts))
    records = bp.records_tunix(_tunix_rows(2, 0.4, 0.5))
    bp.add_prompt_tokens(records, tmp_path, prompts=2, samples=8)
    assert [r["prompt_tokens"] for r in records] == [8 * 21, 8 * 25]


def test_jaxloop_only_end_to_end_reports_lengths_and_the_limit(tmp_path):
    """A real (tiny) run: jaxloop's dry run, the jax matmul probe, two updates of 8 new tokens;
    the JSON line carries the length spread, the learner's FLOP/s and its share of the limit."""
    import subprocess

    argv = [sys.executable, str(SCRIPT), "--models=B", "--systems=jaxloop", "--reps=1"]
    argv += ["--updates=2", "--drop=1", "--matmul-n=256", "--work", str(tmp_path)]
    argv += ["--jaxloop-arg=--config.rollout.max_new_tokens=8"]
    p = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    line = json.loads(p.stdout.strip().splitlines()[-1])
    work = line["work"]["B"]["jaxloop"]
    assert 1 <= work["len_min"] <= work["len_median"] <= work["len_max"] <= 8
    assert 0 <= work["at_cap"] <= 1 and 8 <= work["tokens"] <= 64 * 8
    assert work["learner_gflop_per_s"] > 0 and 0 < work["of_limit"] < 1
    assert line["matmul_gflop_per_s"]["jax"][0] > 0 and "torch" not in line["matmul_gflop_per_s"]
    assert "| B | jaxloop |" in p.stdout and "of the limit" in p.stdout
