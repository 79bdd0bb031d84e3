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
  processes; it is not on the training path.

The exit code is the first failing process's (0 when all succeed); a failure stops the others.
A bad launch command line (no `--`, --num-processes < 1...) is one `error: ...` line, exit code 2.
"""

from __future__ import annotations

import argparse
import math
import os
import socket
import subprocess
import sys
import threading

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


def launch_ray(
    train_args: list[str],
    n: int,
    address: str,
    strategy: str,
    resources: dict[str, float],
    devices_per_process: int | None = None,
) -> int:
    import ray
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    ray.init(address=address or None, log_to_driver=True, include_dashboard=False)

    @ray.remote
    class TrainerProcess:
        def address(self) -> str:
            return f"{ray.util.get_node_ip_address()}:{free_port()}"

        def run(self, args: list[str], env: dict) -> int:
            return subprocess.run(TRAIN + args, env={**os.environ, **env}).returncode

    group = placement_group([dict(resources) for _ in range(n)], strategy=strategy)
    ray.get(group.ready())
    actors = [
        TrainerProcess.options(
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                group, placement_group_bundle_index=rank
            ),
            num_cpus=resources.get("CPU", 1),
            num_gpus=resources.get("GPU", 0),
        ).remote()
        for rank in range(n)
    ]
    coordinator = ray.get(actors[0].address.remote())
    passthrough = {k: v for k, v in os.environ.items() if k.startswith(("XLA_", "JAX_"))}
    passthrough = process_env(devices_per_process, passthrough)
    codes = ray.get(
        [
            actor.run.remote(process_args(train_args, coordinator, n, rank), passthrough)
            for rank, actor in enumerate(actors)
        ]
    )
    return next((c for c in codes if c != 0), 0)


class LaunchUsageError(ValueError):
    """A bad launch command line (one line, exit 2)."""


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # argparse's own errors: one line, exit 2 (no usage block)
        raise LaunchUsageError(message)


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
    args = p.parse_args(argv[:split])
    if args.num_processes < 1:
        p.error(f"--num-processes must be >= 1 (got {args.num_processes})")
    if args.devices_per_process is not None and args.devices_per_process < 1:
        p.error(f"--devices-per-process must be >= 1 (got {args.devices_per_process})")
    if not (args.gpus_per_process >= 0 and math.isfinite(args.gpus_per_process)):
        p.error(f"--gpus-per-process must be a finite number >= 0 (got {args.gpus_per_process})")
    return args, argv[split + 1 :]


def _main(argv: list[str]) -> int:
    args, train_args = parse(argv)
    if args.ray:
        resources = {"CPU": 1.0}
        if args.gpus_per_process:
            resources["GPU"] = args.gpus_per_process
        return launch_ray(
            train_args,
            args.num_processes,
            args.ray_address,
            args.ray_strategy,
            resources,
            args.devices_per_process,
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
