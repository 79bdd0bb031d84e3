"""Kill -9 anywhere: SIGKILL the trainer at random moments, restart it, and check the result.

    python scripts/chaos.py --algorithm ALL --points 20 [--engine jax|vllm] [--seed 0]

Per algorithm: one uninterrupted reference run (every checkpoint kept), then a chaos run in a run
dir of its own. A *point* is one SIGKILL of the trainer (`scripts/chaos_runner.py`, i.e.
`python -m jaxloop.train` with markers), after which the trainer is restarted in the same run dir.
The moment of each kill is drawn (seeded) from these windows, cycled in a shuffled order:

  time      uniformly over a whole process lifetime (start-up, compilation, restore, training)
  restore   while the restarted trainer restores its checkpoint
  update    at the start of an update                        (widened by JAXLOOP_CHAOS_SLEEP)
  produce   while the rollout is generated (engines running)
  metrics   after an update's metrics row, before its checkpoint (widened)
  save      while orbax writes a checkpoint
  commit    when orbax renames a written checkpoint into place (widened)
  delete    while orbax deletes an old checkpoint, half of it gone (widened)
  publish   while the new policy is published to the engines (widened)

Checks (any failure is reported and makes the exit code 1):
  - after every kill, the newest checkpoint directory in the run dir is complete and equal (array
    bytes and counters / data cursor) to the reference's checkpoint of the same step, and the
    restarted trainer restores exactly that step (or starts fresh when there is none): no
    corrupt or half-written checkpoint is ever chosen;
  - every restart either gets killed by the next point or exits 0;
  - when a chaos run completes, its final checkpoint is identical to the reference's (every
    array's bytes, the counters, the RNG and the data cursor) and metrics.jsonl has exactly one
    row per update 0..N-1, equal to the reference's rows (timings aside): no duplicate or
    missing update. A run that completes before all points are spent is checked, and the
    remaining points go to a fresh run dir (a new round).

With --engine vllm the runs use Ray + one vLLM engine actor (a Ray cluster started here, joined
by every trainer process through rollout.ray_address): a killed trainer's engine actors die with
it, and the restarted trainer gets new ones.

Prints one line per algorithm, e.g. `ppo: 20/20 kills survived, final checkpoint identical, ...`.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

DEVICES = int(os.environ.get("JAXLOOP_CHAOS_DEVICES", "8"))
os.environ.setdefault("XLA_FLAGS", f"--xla_force_host_platform_device_count={DEVICES}")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

REPO = Path(__file__).resolve().parent.parent
RUNNER = REPO / "scripts" / "chaos_runner.py"
ALGORITHMS = ("ppo", "grpo", "dppo", "flow_dppo")
KINDS = ("time", "restore", "update", "produce", "metrics", "save", "commit", "delete", "publish")
SLEEP = 0.5  # seconds the runner sleeps in the widened windows
SLEEPERS = ("update", "metrics", "commit", "delete", "deleting", "publish")
sys.path.insert(0, str(REPO))
from jaxloop.config import TINY_MODEL_OVERRIDES, unit_overrides  # noqa: E402
from jaxloop.metrics import TIMING_METRICS as VOLATILE  # noqa: E402

# A tiny model and batch (divisible by 8 devices), a dense reward so every update moves the
# parameters, checkpoints every 2 updates (a kill between them loses an update that is redone).
TINY = (
    *unit_overrides(),  # the one-token unit setting, not the configs' learning recipe
    *TINY_MODEL_OVERRIDES,
    "--config.eval_every=3",
    "--config.rollout.max_new_tokens=3",
    "--config.checkpoint_every=2",
    "--config.progress=false",
    "--config.data.reward=tests.train.rewards:char_code_reward",
)
VLLM = (  # vLLM's CPU attention needs head_dim >= 32
    "--config.model.hidden_size=64",
    "--config.model.head_dim=32",
    "--config.rollout.engine=vllm",
)


class ChaosFailure(AssertionError):
    pass


# ---- a trainer process and its markers ----
@dataclasses.dataclass
class Event:
    name: str
    n: str
    t: float  # when chaos.py read the line


class Process:
    """A chaos_runner process; a thread reads its stderr (markers and everything else)."""

    def __init__(self, args: list[str], env: dict, log: Path):
        self.events: list[Event] = []
        self.lines: list[str] = []
        self.cond = threading.Condition()
        self.started = time.time()
        self.log = log
        self.proc = subprocess.Popen(
            [sys.executable, str(RUNNER), *args],
            cwd=REPO,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        with open(self.log, "a", encoding="utf-8") as log:
            for line in self.proc.stderr:
                log.write(line)
                parts = line.split()
                with self.cond:
                    self.lines.append(line)
                    if len(parts) == 4 and parts[0] == "CHAOS":
                        self.events.append(Event(parts[1], parts[2], time.time()))
                    self.cond.notify_all()
        with self.cond:
            self.cond.notify_all()

    def wait_for(self, name: str, occurrence: int, timeout: float) -> Event | None:
        """The occurrence-th `name` event (1-based); None when the process ended first."""
        deadline = time.time() + timeout
        with self.cond:
            while True:
                hits = [e for e in self.events if e.name == name]
                if len(hits) >= occurrence:
                    return hits[occurrence - 1]
                if self.proc.poll() is not None and not self.reader.is_alive():
                    return None
                left = deadline - time.time()
                if left <= 0:
                    raise ChaosFailure(f"no {name!r} marker within {timeout:.0f}s")
                self.cond.wait(min(left, 0.5))

    def kill(self) -> bool:
        """SIGKILL (as kill -9); False when it had already exited."""
        if self.proc.poll() is not None:
            return False
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        self.reader.join(timeout=30)
        return True

    def finish(self, timeout: float) -> int:
        code = self.proc.wait(timeout=timeout)
        self.reader.join(timeout=30)
        return code

    def tail(self, n: int = 40) -> str:
        with self.cond:
            return "".join(line for line in self.lines if not line.startswith("CHAOS"))[-4000:]

    def named(self, name: str) -> list[Event]:
        with self.cond:
            return [e for e in self.events if e.name == name]


# ---- checkpoints ----
def finished_steps(run_dir: Path) -> list[int]:
    root = run_dir / "checkpoints"
    if not root.is_dir():
        return []
    return sorted(int(p.name) for p in root.iterdir() if p.name.isdigit() and p.is_dir())


def checkpoint_digest(step_dir: Path) -> dict:
    """{item/leaf: sha256 of dtype, shape and bytes} of every array, and the train_state JSON
    (counters, RNG, data cursor). Raises on an unreadable checkpoint."""
    import numpy as np
    import orbax.checkpoint as ocp

    out: dict = {}
    items = sorted(p for p in step_dir.iterdir() if p.is_dir())
    if not any(p.name == "train_state" for p in items):
        raise ChaosFailure(f"{step_dir}: no train_state")
    for item in items:
        if item.name == "train_state":
            out["train_state"] = json.loads((item / "metadata").read_text())
            continue
        tree = ocp.StandardCheckpointer().restore(item)
        for key, leaf in _flatten(tree, item.name):
            a = np.asarray(leaf)
            h = hashlib.sha256(f"{a.dtype}{a.shape}".encode())
            h.update(a.tobytes())
            out[key] = h.hexdigest()
    return out


def _flatten(tree, prefix):
    if isinstance(tree, dict):
        for k, v in tree.items():
            yield from _flatten(v, f"{prefix}/{k}")
    elif isinstance(tree, list | tuple):
        for i, v in enumerate(tree):
            yield from _flatten(v, f"{prefix}/{i}")
    elif tree is not None:
        yield prefix, tree


def compare_checkpoint(run_dir: Path, ref: Path, step: int, what: str) -> None:
    try:
        got = checkpoint_digest(run_dir / "checkpoints" / str(step))
    except ChaosFailure:
        raise
    except Exception as err:  # noqa: BLE001 - any failure to read is the finding
        raise ChaosFailure(f"{what}: step {step} is unreadable: {type(err).__name__}") from err
    want = checkpoint_digest(ref / "checkpoints" / str(step))
    if got.keys() != want.keys():
        raise ChaosFailure(f"{what}: step {step} items {sorted(got)} != {sorted(want)}")
    bad = [k for k in want if got[k] != want[k]]
    if bad:
        raise ChaosFailure(f"{what}: step {step} differs from the reference in {bad[:5]}")


# ---- metrics ----
def metric_rows(run_dir: Path) -> list[dict]:
    rows = []
    for i, line in enumerate((run_dir / "metrics.jsonl").read_text().splitlines(), 1):
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            raise ChaosFailure(f"metrics.jsonl line {i} is not JSON: {line[:80]!r}") from None
    return rows


def stable(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if not k.startswith(VOLATILE)} for r in rows]


def compare_metrics(run_dir: Path, ref: Path, total: int) -> None:
    rows = metric_rows(run_dir)
    updates = [r["update"] for r in rows]
    if updates != list(range(total)):
        dup = sorted({u for u in updates if updates.count(u) > 1})
        missing = sorted(set(range(total)) - set(updates))
        raise ChaosFailure(f"metrics.jsonl updates: duplicate {dup}, missing {missing}")
    a, b = stable(rows), stable(metric_rows(ref))
    diff = [r["update"] for r, s in zip(a, b, strict=True) if r != s]
    if diff:
        raise ChaosFailure(f"metrics.jsonl rows of updates {diff} differ from the reference")


# ---- one algorithm ----
@dataclasses.dataclass
class Result:
    algorithm: str
    points: int
    survived: int = 0
    rounds: int = 0
    by_kind: dict = dataclasses.field(default_factory=dict)
    restarts_checked: int = 0
    half_deleted_left: int = 0
    engines_replaced: int = 0  # vllm: kills after which every actor of the trainer was gone
    failures: list = dataclasses.field(default_factory=list)

    def line(self) -> str:
        ok = not self.failures and self.survived == self.points
        kinds = ", ".join(f"{k} {v}" for k, v in sorted(self.by_kind.items()))
        head = f"{self.algorithm}: {self.survived}/{self.points} kills survived"
        if ok:
            head += f", final checkpoint identical in {self.rounds}/{self.rounds} round(s)"
            head += f", metrics.jsonl complete and equal, {self.restarts_checked} resumes checked"
            if self.engines_replaced:
                head += f", engines gone after {self.engines_replaced} kills"
        else:
            head += f", FAILED: {self.failures[0]}"
        return f"{head} (kills: {kinds})"


class Chaos:
    def __init__(
        self, algorithm, points, out: Path, seed=0, engine="jax", total=8, env=None, plot=True
    ):
        self.algorithm, self.points, self.out = algorithm, points, out
        self.engine, self.total = engine, total
        self.rng = random.Random(f"{seed}:{algorithm}:{engine}")
        self.env = dict(os.environ if env is None else env)
        self.env.setdefault("XLA_FLAGS", f"--xla_force_host_platform_device_count={DEVICES}")
        self.env.setdefault("JAX_PLATFORMS", "cpu")
        self.env.setdefault("JAX_COMPILATION_CACHE_DIR", str(out.parent / "jax_cache"))
        self.env.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
        for key, value in (
            ("VLLM_ENABLE_V1_MULTIPROCESSING", "0"),
            ("VLLM_CPU_KVCACHE_SPACE", "1"),
            ("HF_HUB_OFFLINE", "1"),
            ("RAY_AUTH_MODE", "disabled"),
            ("TOKENIZERS_PARALLELISM", "false"),
        ):
            self.env.setdefault(key, value)
        if not plot:
            self.env["JAXLOOP_CHAOS_PLOT"] = "0"
        self.timeout = 900 if engine == "vllm" else 600
        self.result = Result(algorithm, points)
        self.logs = out / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.nproc = 0
        self.ray_address = ""
        self.restore_s = 1.0
        self.points_log = out / "points.log"

    def note(self, line: str) -> None:
        with open(self.points_log, "a", encoding="utf-8") as f:
            f.write(line + "\n")

    def args(self, run_dir: Path, keep: int) -> list[str]:
        extra = []
        if self.engine == "vllm":
            extra = [*VLLM, f"--config.rollout.ray_address={self.ray_address}"]
        return [
            "--config",
            f"{self.algorithm}.py",
            f"--config.run_dir={run_dir}",
            f"--config.total_updates={self.total}",
            f"--config.keep_checkpoints={keep}",
            *TINY,
            *extra,
        ]

    def launch(self, run_dir: Path, keep: int = 2, sleep_at: str = "") -> Process:
        """A trainer process; it sleeps SLEEP after the `sleep_at` marker (none: no sleeps)."""
        self.nproc += 1
        log = self.logs / f"{self.nproc:03d}_{run_dir.name}.log"
        env = {**self.env, "JAXLOOP_CHAOS_SLEEP": str(SLEEP if sleep_at else 0)}
        env["JAXLOOP_CHAOS_SLEEP_AT"] = sleep_at
        return Process(self.args(run_dir, keep), env, log)

    # the reference: uninterrupted, every checkpoint kept; its timings size the windows
    def reference(self) -> None:
        self.ref = self.out / "reference"
        shutil.rmtree(self.ref, ignore_errors=True)
        proc = self.launch(self.ref, keep=self.total)
        code = proc.finish(self.timeout)
        if code != 0:
            raise ChaosFailure(f"reference run exited {code}:\n{proc.tail()}")
        self.observe(proc)
        # after compilation (the first update compiles): seconds per update
        updates = proc.named("update")
        self.per_update = (proc.named("saved")[-1].t - updates[1].t) / (len(updates) - 1)
        self.durations = {}
        for begin, end in (("save", "saved"), ("produce", "produced"), ("publish", "published")):
            b, e = proc.named(begin), proc.named(end)
            spans = sorted(y.t - x.t for x, y in zip(b[1:], e[1:], strict=False))
            self.durations[begin] = spans[len(spans) // 2] if spans else SLEEP
        saves = max(len(proc.named("save")), 1)
        self.commits_per_save = max(len(proc.named("commit")) // saves, 1)

    def observe(self, proc: Process) -> None:
        """Start-up seconds (to the first publication) and restore seconds of the last process."""
        first = proc.named("publish")
        if first and proc.events:
            self.startup = first[0].t - proc.events[0].t
        spans = [
            b.t - a.t for a, b in zip(proc.named("restore"), proc.named("restored"), strict=False)
        ]
        self.restore_s = max(spans, default=self.restore_s)

    def remaining(self, run_dir: Path) -> tuple[int, int]:
        """(updates, checkpoint saves) the next process will do."""
        steps = finished_steps(run_dir)
        done = steps[-1] if steps else 0
        updates = self.total - done
        saves = sum(1 for u in range(done + 1, self.total + 1) if u % 2 == 0 or u == self.total)
        return updates, saves

    def plan(self, kind: str, run_dir: Path) -> tuple[str, str, int, float]:
        """(kind, marker, occurrence, delay after the marker) of the next kill."""
        updates, saves = self.remaining(run_dir)
        has_ckpt = bool(finished_steps(run_dir))
        r = self.rng
        if kind == "restore" and not has_ckpt or updates <= 0:
            kind = "time"
        if kind == "delete" and len(finished_steps(run_dir)) + saves <= 2:
            kind = "save"
        if kind == "time":  # start-up (compilation, restore) and the updates left
            span = self.startup + self.per_update * updates
            return kind, "start", 1, r.uniform(0, span)
        if kind == "restore":
            return kind, "restore", 1, r.uniform(0, self.restore_s)
        # early occurrences (the first or second of this process): a run advances a little per
        # kill, so the kills spread over its whole length instead of piling up at the end
        if kind in ("update", "metrics"):
            return kind, kind, r.randint(1, min(updates, 2)), r.uniform(0, SLEEP * 1.2)
        if kind == "produce":
            k = r.randint(1, min(updates, 2))
            return kind, kind, k, r.uniform(0, self.durations["produce"])
        if kind == "publish":
            delay = r.uniform(0, SLEEP + self.durations["publish"])
            return kind, kind, r.randint(1, min(updates + 1, 3)), delay
        if kind == "save":
            return kind, kind, r.randint(1, min(saves, 2)), r.uniform(0, self.durations["save"])
        if kind == "commit":
            k = r.randint(1, min(saves, 2) * self.commits_per_save)
            return kind, kind, k, r.uniform(0, SLEEP * 1.2)
        if kind == "delete":
            marker = r.choice(("delete", "deleting"))
            return kind, marker, 1, r.uniform(0, SLEEP * 1.2)
        raise ValueError(kind)

    def wait_engines_gone(self, timeout: float = 120) -> None:
        """The killed trainer's actors (engines, manager) die with it: none is left alive, so the
        restarted trainer starts new ones."""
        from ray._private import state

        deadline = time.time() + timeout
        while True:
            alive = [a for a in state.actors().values() if a["State"] != "DEAD"]
            if not alive:
                self.result.engines_replaced += 1
                return
            if time.time() > deadline:
                raise ChaosFailure(f"{len(alive)} actor(s) of the killed trainer still alive")
            time.sleep(0.5)

    def check_before_restart(self, run_dir: Path) -> int | None:
        """The newest checkpoint must be complete and equal the reference's; returns its step."""
        steps = finished_steps(run_dir)
        if not steps:
            return None
        compare_checkpoint(run_dir, self.ref, steps[-1], "newest checkpoint after a kill")
        items = lambda s: {p.name for p in (run_dir / "checkpoints" / str(s)).iterdir()}
        self.result.half_deleted_left += sum(items(s) != items(steps[-1]) for s in steps[:-1])
        return steps[-1]

    def check_restore(self, proc: Process, expected: int | None) -> None:
        restores = proc.named("restore")
        if not restores:
            if expected is not None and proc.named("update"):
                raise ChaosFailure(f"checkpoint {expected} was there, but the run started fresh")
            return
        if expected is None or int(restores[0].n) != expected:
            raise ChaosFailure(f"restored step {restores[0].n}; the newest complete is {expected}")
        self.result.restarts_checked += 1

    def check_complete(self, run_dir: Path) -> None:
        steps = finished_steps(run_dir)
        if not steps or steps[-1] != self.total:
            raise ChaosFailure(f"completed run has checkpoints {steps}, not step {self.total}")
        compare_checkpoint(run_dir, self.ref, self.total, "final checkpoint")
        compare_metrics(run_dir, self.ref, self.total)
        self.result.rounds += 1

    def run(self) -> Result:
        self.reference()
        kinds = list(KINDS)
        self.rng.shuffle(kinds)
        point, rnd = 0, 0
        run_dir = self.out / f"chaos_{rnd}"
        shutil.rmtree(run_dir, ignore_errors=True)
        expected = None  # the step the next process must restore
        while point < self.points:
            kind, marker, k, delay = self.plan(kinds[point % len(kinds)], run_dir)
            proc = self.launch(run_dir, sleep_at=marker if marker in SLEEPERS else "")
            event = proc.wait_for(marker, k, self.timeout)
            killed = False
            if event is not None:
                time.sleep(max(0.0, event.t + delay - time.time()))
                killed = proc.kill()
            if not killed:
                code = proc.finish(self.timeout)
                if code != 0:
                    raise ChaosFailure(f"trainer exited {code} (not killed):\n{proc.tail()}")
            self.check_restore(proc, expected)
            self.observe(proc)
            last = proc.events[-1] if proc.events else None
            self.note(
                f"point {point + 1} round {rnd}: {kind} at {marker} #{k} +{delay:.2f}s -> "
                + (f"killed after '{last.name} {last.n}'" if killed else "ran to the end")
            )
            if not killed:  # the run completed before this point's moment: check, new round
                self.check_complete(run_dir)
                rnd += 1
                run_dir = self.out / f"chaos_{rnd}"
                shutil.rmtree(run_dir, ignore_errors=True)
                expected = None
                continue
            point += 1
            self.result.by_kind[kind] = self.result.by_kind.get(kind, 0) + 1
            if self.engine == "vllm":
                self.wait_engines_gone()
            expected = self.check_before_restart(run_dir)
            self.result.survived += 1
        # the last restart runs to the end
        proc = self.launch(run_dir)
        code = proc.finish(self.timeout)
        if code != 0:
            raise ChaosFailure(f"final restart exited {code}:\n{proc.tail()}")
        self.check_restore(proc, expected)
        self.check_complete(run_dir)
        return self.result


def start_ray() -> str:
    import ray

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(address="local", num_cpus=2, include_dashboard=False)  # private, never a running one
    return ray.get_runtime_context().gcs_address


def run_chaos(
    algorithm: str,
    points: int,
    out: Path,
    *,
    seed: int = 0,
    engine: str = "jax",
    total: int = 8,
    ray_address: str = "",
    env: dict | None = None,
    plot: bool = True,
) -> Result:
    chaos = Chaos(algorithm, points, Path(out) / algorithm, seed, engine, total, env, plot)
    chaos.ray_address = ray_address
    try:
        return chaos.run()
    except ChaosFailure as err:
        chaos.result.failures.append(str(err).splitlines()[0])
        print(str(err), file=sys.stderr)
        return chaos.result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--algorithm", default="ALL", help="ppo | grpo | dppo | flow_dppo | ALL")
    p.add_argument("--points", type=int, default=20, help="kills per algorithm")
    p.add_argument("--engine", default="jax", choices=("jax", "vllm"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--total-updates", type=int, default=8)
    p.add_argument("--out", default="", help="work dir (default: a temporary one, removed)")
    args = p.parse_args(argv)
    algorithms = ALGORITHMS if args.algorithm.upper() == "ALL" else (args.algorithm,)
    out = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="jaxloop_chaos_"))
    address = start_ray() if args.engine == "vllm" else ""
    results = []
    for algorithm in algorithms:
        start = time.perf_counter()
        result = run_chaos(
            algorithm,
            args.points,
            out,
            seed=args.seed,
            engine=args.engine,
            total=args.total_updates,
            ray_address=address,
        )
        results.append(result)
        print(f"{result.line()} [{time.perf_counter() - start:.0f}s]", flush=True)
    if not args.out:
        shutil.rmtree(out, ignore_errors=True)
    return 0 if all(not r.failures and r.survived == r.points for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
