"""`python -m jaxloop.launch --num-processes N [--devices-per-process K] [--ray] -- <train args>`

Starts N trainer processes that form one JAX distributed job (`jax.distributed.initialize`
through the `dist.*` config keys: coordinator address, process count, process id). Every process
runs the same SPMD program; JAX's own runtime does the collectives.

- Without --ray: N processes on this machine (tests, one node with several accelerators).
  --devices-per-process K gives each process K fake CPU devices (XLA's host-platform device
  count): 2 processes x 4 devices make the 8-device mesh of the tests.
- With --ray: one process per node of a Ray cluster (`--ray-address`, default: the local or
  `RAY_ADDRESS` cluster), placed by a placement group (STRICT_SPREAD: one per node; `--ray-strategy`
  PACK puts them on one node), the coordinator on the node of process 0. Ray only places the
  processes; it is not on the training path. Each bundle asks for 1 CPU, --gpus-per-process GPUs
  and the --ray-resources (NAME=AMOUNT: a custom resource that marks trainer nodes). The launch
  prints each process's node id, ip and resources; a placement not ready within
  --ray-placement-timeout-s (default 120) is refused (one line, exit 2). JAXLOOP_*, XLA_* and
  JAX_* variables of the launch's environment reach every process.

The exit code is the first failing process's (0 when all succeed); a failure stops the others.
With --ray the launch repeats that process's error as one line of its own, `error: trainer process
R on node ID (IP) exited with code C: <its error>` (Ray's log stream may not deliver a process's
last lines before the launch exits). A process lost with its node (Ray: its actor died) stops the
others too: one `error: ...` line naming the process and node, exit code 1; rerunning the command
resumes from the last checkpoint.
A bad launch command line (no `--`, --num-processes < 1...) is one `error: ...` line, exit code 2.
"""

from __future__ import annotations

import argparse
import math
import os
import signal
import socket
import subprocess
import sys
import threading
import time

TRAIN = [sys.executable, "-m", "jaxloop.train"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def process_args(train_args: list[str], coordinator: str, n: int, rank: int) -> list[str]:
    return [
        *train_args,
        f"--config.dist.coordinator_address={coordinator}",
        f"--config.dist.num_processes={n}",
        f"--config.dist.process_id={rank}",
    ]


def process_env(devices_per_process: int | None, base: dict | None = None) -> dict:
    env = dict(os.environ if base is None else base)
    if devices_per_process:
        flags = [f for f in env.get("XLA_FLAGS", "").split() if "device_count" not in f]
        flags.append(f"--xla_force_host_platform_device_count={devices_per_process}")
        env["XLA_FLAGS"] = " ".join(flags)
        env.setdefault("JAX_PLATFORMS", "cpu")
    return env


def _relay(stream, prefix: str) -> None:
    for line in iter(stream.readline, ""):
        sys.stderr.write(prefix + line)
    stream.close()


def launch_local(train_args: list[str], n: int, devices_per_process: int | None) -> int:
    coordinator = f"127.0.0.1:{free_port()}"
    env = process_env(devices_per_process)
    procs, relays = [], []
    for rank in range(n):
        # process 0 talks to the terminal; the others' output is relayed with their rank
        quiet = rank > 0
        proc = subprocess.Popen(
            TRAIN + process_args(train_args, coordinator, n, rank),
            env=env,
            stdout=subprocess.PIPE if quiet else None,
            stderr=subprocess.STDOUT if quiet else None,
            text=True,
        )
        procs.append(proc)
        if quiet:
            relay = threading.Thread(target=_relay, args=(proc.stdout, f"[process {rank}] "))
            relay.start()
            relays.append(relay)
    code = 0
    pending = list(procs)
    while pending:
        for proc in list(pending):
            try:
                rc = proc.wait(timeout=0.5)
            except subprocess.TimeoutExpired:
                continue
            pending.remove(proc)
            if rc != 0 and code == 0:
                code = rc
                for other in pending:  # one failed: the collective job cannot go on
                    other.terminate()
    for relay in relays:
        relay.join()
    return code


def _die_with_parent() -> None:
    """In the trainer process before exec: SIGKILL when the Ray worker that started it dies (its
    node lost, or the launcher's ray.kill), so no trainer process outlives its actor and waits on
    a collective whose peers are gone."""
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def _trainer_process_class(ray):
    @ray.remote
    class TrainerProcess:
        def where(self) -> tuple[str, str]:
            return ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address()

        def address(self) -> str:
            return f"{ray.util.get_node_ip_address()}:{free_port()}"

        def run(self, args: list[str], env: dict) -> tuple[int, str]:
            """The trainer's exit code and its last `error: ...` line. Its stderr reaches the
            launch through Ray's log stream, which may not deliver the last lines before the
            launch exits: the launcher repeats the error line itself."""
            proc = subprocess.Popen(
                TRAIN + args,
                env={**os.environ, **env},
                stderr=subprocess.PIPE,
                text=True,
                preexec_fn=_die_with_parent,
            )
            last_error = ""
            for line in iter(proc.stderr.readline, ""):
                sys.stderr.write(line)
                if line.startswith("error: "):
                    last_error = line.strip()
            return proc.wait(), last_error

    return TrainerProcess


def _place(ray, n: int, strategy: str, resources: dict[str, float], timeout_s: float):
    """A placement group of n bundles, ready within timeout_s or a one-line refusal (Ray itself
    would wait forever for nodes that may never join)."""
    from ray.util.placement_group import placement_group, remove_placement_group

    group = placement_group([dict(resources) for _ in range(n)], strategy=strategy)
    ready, _ = ray.wait([group.ready()], timeout=timeout_s)
    if ready:
        return group
    remove_placement_group(group)
    fits = [
        node
        for node in ray.nodes()
        if node["Alive"] and all(node["Resources"].get(k, 0) >= v for k, v in resources.items())
    ]
    raise LaunchPlacementError(
        f"cannot place {n} trainer processes ({strategy}, {_resources_text(resources)} each) "
        f"within {timeout_s:g} s (--ray-placement-timeout-s): {len(fits)} live node(s) of "
        f"{sum(node['Alive'] for node in ray.nodes())} have those resources"
    )


def _resources_text(resources: dict[str, float]) -> str:
    return "{" + ", ".join(f"{k}: {v:g}" for k, v in resources.items()) + "}"


def _wait_all(ray, runs: dict, actors: list, where: list[tuple[str, str]]) -> int:
    """The first failing process's exit code (0 when all succeed). A process that fails, or whose
    actor is lost with its node, stops the others at once: a collective job cannot go on, and its
    survivors would otherwise wait on JAX's heartbeat timeout."""
    pending = list(runs)
    while pending:
        done, pending = ray.wait(pending, num_returns=1)
        rank = runs[done[0]]
        lost, error = None, ""
        try:
            code, error = ray.get(done[0])
        except ray.exceptions.RayActorError as err:
            lost, code = err, 1
        if code != 0:
            for actor in actors:
                ray.kill(actor)  # its trainer process dies with it (_die_with_parent)
        if lost is not None:
            node, ip = where[rank]
            print(
                f"error: trainer process {rank} on node {node} ({ip}) was lost: "
                f"{_loss_cause(ray, node, lost)}; stopped the other processes (rerun the same "
                "command to resume from the last checkpoint)",
                file=sys.stderr,
            )
        elif code != 0:
            node, ip = where[rank]
            what = error.removeprefix("error: ") or "see its output above"
            print(
                f"error: trainer process {rank} on node {node} ({ip}) exited with code {code}: "
                f"{what}",
                file=sys.stderr,
            )
        if code != 0:
            return code
    return 0


def _loss_cause(ray, node_id: str, err: BaseException, wait_s: float = 10.0) -> str:
    """Why an actor was lost, for the error line: its node declared dead by the head (waited for
    briefly: an unreachable actor is reported before its node's health checks run out)."""
    deadline = time.monotonic() + wait_s
    while True:
        if not any(n["NodeID"] == node_id and n["Alive"] for n in ray.nodes()):
            return f"its node is dead ({type(err).__name__})"
        if time.monotonic() > deadline:
            return f"its actor stopped answering, node still alive ({type(err).__name__})"
        time.sleep(0.5)


def launch_ray(
    train_args: list[str],
    n: int,
    address: str,
    strategy: str,
    resources: dict[str, float],
    devices_per_process: int | None = None,
    placement_timeout_s: float = 120.0,
) -> int:
    import logging

    import ray
    from ray.util.placement_group import remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    ray.init(
        address=address or None,
        log_to_driver=True,
        include_dashboard=False,
        logging_level=logging.WARNING,
    )
    group = None
    try:
        group = _place(ray, n, strategy, resources, placement_timeout_s)
        custom = {k: v for k, v in resources.items() if k not in ("CPU", "GPU")}
        actors = [
            _trainer_process_class(ray)
            .options(
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    group, placement_group_bundle_index=rank
                ),
                num_cpus=resources.get("CPU", 1),
                num_gpus=resources.get("GPU", 0),
                resources=custom,
            )
            .remote()
            for rank in range(n)
        ]
        where = ray.get([actor.where.remote() for actor in actors])
        for rank, (node, ip) in enumerate(where):
            print(
                f"jaxloop.launch: trainer process {rank} on node {node} ({ip}), "
                f"resources {_resources_text(resources)}",
                flush=True,
            )
        coordinator = ray.get(actors[0].address.remote())
        passthrough = {
            k: v for k, v in os.environ.items() if k.startswith(("XLA_", "JAX_", "JAXLOOP_"))
        }
        passthrough = process_env(devices_per_process, passthrough)
        runs = {
            actor.run.remote(process_args(train_args, coordinator, n, rank), passthrough): rank
            for rank, actor in enumerate(actors)
        }
        return _wait_all(ray, runs, actors, where)
    finally:
        if group is not None:
            remove_placement_group(group)
        ray.shutdown()


class LaunchUsageError(ValueError):
    """A bad launch command line (one line, exit 2)."""


class LaunchPlacementError(LaunchUsageError):
    """A placement the Ray cluster cannot satisfy in time (one line, exit 2)."""


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # argparse's own errors: one line, exit 2 (no usage block)
        raise LaunchUsageError(message)


def _resource_list(text: str) -> dict[str, float]:
    """`trainer_slot=1,memory_slot=0.5` -> {"trainer_slot": 1.0, "memory_slot": 0.5}."""
    from jaxloop.parallel.distributed import parse_resources

    try:
        return parse_resources(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


USAGE = "python -m jaxloop.launch --num-processes N [...] -- <train args>"


def parse(argv: list[str]):
    if "--" not in argv:
        if "-h" in argv or "--help" in argv:
            print(__doc__.strip())
            raise SystemExit(0)
        raise LaunchUsageError(f"no `--` before the training arguments (usage: {USAGE})")
    split = argv.index("--")
    p = _Parser(prog="python -m jaxloop.launch", usage=USAGE)
    p.add_argument("--num-processes", type=int, required=True)
    p.add_argument("--devices-per-process", type=int, default=None, help="fake CPU devices")
    p.add_argument("--ray", action="store_true", help="one process per node of a Ray cluster")
    p.add_argument("--ray-address", default="", help="Ray cluster address (default: auto)")
    p.add_argument("--ray-strategy", default="STRICT_SPREAD", choices=["STRICT_SPREAD", "PACK"])
    p.add_argument("--gpus-per-process", type=float, default=0.0)
    p.add_argument(
        "--ray-resources",
        type=_resource_list,
        default={},
        help="NAME=AMOUNT[,NAME=AMOUNT]: custom Ray resources each process needs",
    )
    p.add_argument(
        "--ray-placement-timeout-s",
        type=float,
        default=120.0,
        help="refuse (exit 2) a placement the cluster cannot satisfy within this time",
    )
    args = p.parse_args(argv[:split])
    if args.num_processes < 1:
        p.error(f"--num-processes must be >= 1 (got {args.num_processes})")
    if args.devices_per_process is not None and args.devices_per_process < 1:
        p.error(f"--devices-per-process must be >= 1 (got {args.devices_per_process})")
    if not (args.gpus_per_process >= 0 and math.isfinite(args.gpus_per_process)):
        p.error(f"--gpus-per-process must be a finite number >= 0 (got {args.gpus_per_process})")
    if not args.ray_placement_timeout_s > 0:
        p.error(f"--ray-placement-timeout-s must be > 0 (got {args.ray_placement_timeout_s})")
    return args, argv[split + 1 :]


def _main(argv: list[str]) -> int:
    args, train_args = parse(argv)
    if args.ray:
        resources = {"CPU": 1.0}
        if args.gpus_per_process:
            resources["GPU"] = args.gpus_per_process
        resources.update(args.ray_resources)
        return launch_ray(
            train_args,
            args.num_processes,
            args.ray_address,
            args.ray_strategy,
            resources,
            args.devices_per_process,
            args.ray_placement_timeout_s,
        )
    return launch_local(train_args, args.num_processes, args.devices_per_process)


def main(argv: list[str] | None = None) -> int:
    """The one exception boundary (jaxloop.errors): a bad launch command line is one `error: ...`
    line and exit code 2 (the trainer processes' own errors are theirs: the exit code is the
    first failing process's)."""
    from jaxloop.errors import run_entry_point

    argv = sys.argv[1:] if argv is None else argv
    return run_entry_point(lambda: _main(argv), extra=(LaunchUsageError,))


if __name__ == "__main__":
    sys.exit(main())
