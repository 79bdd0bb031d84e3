"""CPU seconds of a whole process tree: `python scripts/cpu_time.py CMD ARGS...`.

Runs CMD as a child subreaper (Linux), so every descendant, including daemons such as Ray's raylet
and its workers, is reaped here when it exits; prints one line with the wall time and the user +
system CPU seconds of everything CMD started. How docs/contributing.md measured that the
real-engine tests mostly wait (their CPU seconds are a fraction of their wall time)."""

import ctypes
import os
import resource
import subprocess
import sys
import time

PR_SET_CHILD_SUBREAPER = 36
ORPHAN_WAIT_S = 60  # descendants still running after CMD exits get this long to finish


def main(argv: list[str]) -> int:
    if not argv:
        print("usage: python scripts/cpu_time.py CMD [ARGS...]", file=sys.stderr)
        return 2
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    start = time.time()
    code = subprocess.Popen(argv).wait()
    wall = time.time() - start
    deadline = time.time() + ORPHAN_WAIT_S
    while time.time() < deadline:
        try:
            if os.waitpid(-1, os.WNOHANG)[0] == 0:
                time.sleep(0.5)
        except ChildProcessError:
            break
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = usage.ru_utime + usage.ru_stime
    print(f"cpu_time: exit {code}, wall {wall:.0f} s, cpu {cpu:.0f} s (user {usage.ru_utime:.0f})")
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
