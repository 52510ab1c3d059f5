"""Programs per second through the code sandbox, next to one plain ``python -c`` per program.

Scores ``--programs`` short completions (two functions, against two asserts) with the code-execution
reward, which runs each in a sandbox of its own (own user, PID, mount, network and IPC namespaces,
private filesystem, resource limits, a cgroup where the machine lets us make one): row ``sandbox``
as it runs by default, forked from a fork server inside bubblewrap (rlalign.lm.sandbox_fork), row
``fresh`` with a fresh bwrap and interpreter per program. In the same script run it runs the same
programs unsandboxed with one
``subprocess.run([python, "-c", program + asserts])`` each, on a thread pool of the same size. A third
row is the floor of any sandbox that starts a fresh interpreter per program: bwrap with the
sandbox's own arguments starting ``python -I -S -c pass``, and nothing else (no files, no cgroup, no
harness, no scoring). Everything starts from this process, with torch imported when it is installed,
as in a training process.

    .venv/bin/python benchmarks/sandbox_throughput.py [--programs 64] [--repeats 5] [--workers N]
    taskset -c 0,1 .venv/bin/python benchmarks/sandbox_throughput.py   # two cores of a larger machine

Prints the median programs/s of each row over the repeats (after one warm-up round), all repeats,
and the ratios; and, where the script can put itself in a cgroup of its own (cgroup v1's cpuacct or
v2), the CPU time each program costs, counted over this process and all it starts (other users of
the machine left out), and the rate that cost allows on the CPUs given: CPUs / (CPU s per program).
"""

from __future__ import annotations

import argparse
import atexit
import os
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

try:
    import torch  # noqa: F401 - a training process has torch loaded
except ImportError:
    torch = None

from rlalign.lm.code_execution import CodeExecutionReward
from rlalign.lm.sandbox import Sandbox, SandboxLimits

TESTS = "assert add(2, 3) == 5\nassert mul(2, 3) == 6"
PROGRAM = "def add(a, b):\n    return a + b\n\ndef mul(a, b):\n    return a * b\n"


class CpuClock:
    """CPU seconds used by this process and everything it starts, from a cgroup it moves itself into."""

    def __init__(self):
        name = f"rlalign-bench-{os.getpid()}"
        v1 = Path("/sys/fs/cgroup/cpuacct")
        if v1.is_dir():
            self.group, self.read = v1 / name, lambda: int((self.group / "cpuacct.usage").read_text()) / 1e9
        else:
            own = Path("/proc/self/cgroup").read_text().strip().split("::", 1)[-1].lstrip("/")
            self.group = Path("/sys/fs/cgroup") / own / name
            self.read = lambda: int((self.group / "cpu.stat").read_text().split()[1]) / 1e6  # usage_usec
        self.group.mkdir()
        (self.group / "cgroup.procs").write_text(str(os.getpid()))
        atexit.register(self.close)

    def close(self) -> None:
        """Back to the cgroup it came from, and this one removed."""
        try:
            (self.group.parent / "cgroup.procs").write_text(str(os.getpid()))
            self.group.rmdir()
        except OSError:
            pass


def clock() -> CpuClock | None:
    try:
        return CpuClock()
    except OSError:
        return None


def sandboxed(n: int, workers: int, fork_server: bool = True) -> float:
    reward = CodeExecutionReward({"p": TESTS}, max_workers=workers)
    reward.sandbox = Sandbox(reward.sandbox.limits, fork_server=fork_server)
    started = time.perf_counter()
    scores = reward(["p"] * n, [PROGRAM] * n)
    seconds = time.perf_counter() - started
    assert scores == [1.0] * n, scores
    return n / seconds


def pool_rate(command: list[str], n: int, workers: int) -> float:
    def one(_):
        return subprocess.run(command, capture_output=True, timeout=30).returncode

    started = time.perf_counter()
    with ThreadPoolExecutor(workers) as pool:
        codes = list(pool.map(one, range(n)))
    seconds = time.perf_counter() - started
    assert codes == [0] * n, codes
    return n / seconds


def floor_command(workdir: Path) -> list[str]:
    """The sandbox's own command line (shell, limits, bwrap and its arguments), starting ``python -I -S -c pass``."""
    command = Sandbox(SandboxLimits())._command(workdir, 3, ["main.py"])
    return command[: command.index("-S") + 1] + ["-c", "pass"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--programs", type=int, default=64, help="programs per round (default 64)")
    parser.add_argument("--repeats", type=int, default=5, help="rounds of each, after one warm-up round (default 5)")
    parser.add_argument("--workers", type=int, default=2 * len(os.sched_getaffinity(0)), help="threads running programs (default: the reward's, 2 per CPU)")
    parser.add_argument("--rows", default="sandbox,fresh,plain,floor", help="which rows (default sandbox,fresh,plain,floor)")
    args = parser.parse_args()
    python = os.path.realpath(sys.executable)
    workdir = Path(tempfile.mkdtemp())
    rows = {
        "sandbox": lambda n: sandboxed(n, args.workers),
        "fresh": lambda n: sandboxed(n, args.workers, fork_server=False),
        "plain": lambda n: pool_rate([python, "-c", PROGRAM + TESTS], n, args.workers),
        "floor": lambda n: pool_rate(floor_command(workdir), n, args.workers),
    }
    rows = {name: rows[name] for name in args.rows.split(",")}
    cpu = clock()  # before the warm-up: the fork servers it starts count too
    for run in rows.values():  # warm-up: the isolation probe, the fork servers, imports, page cache
        run(8)
    rates: dict[str, list[float]] = {name: [] for name in rows}
    cpu_s: dict[str, list[float]] = {name: [] for name in rows}
    for _ in range(args.repeats):  # interleaved, so a busy moment of the machine falls on every row
        for name, run in rows.items():
            used = cpu.read() if cpu else 0.0
            rates[name].append(run(args.programs))
            cpu_s[name].append(((cpu.read() if cpu else 0.0) - used) / args.programs)
    cpus = len(os.sched_getaffinity(0))
    print(f"{cpus} CPUs, {args.workers} workers, {args.programs} programs x {args.repeats} repeats, torch {'loaded' if torch else 'not installed'}")
    median = {name: statistics.median(values) for name, values in rates.items()}
    for name, values in rates.items():
        cost = statistics.median(cpu_s[name])
        per_cpu = f"   CPU {cost * 1e3:5.1f} ms/program: at most {cpus / cost:5.1f} programs/s on {cpus} CPUs" if cpu else ""
        print(f"{name:8s} median {median[name]:6.1f} programs/s{per_cpu}   (all: {', '.join(f'{v:.1f}' for v in values)})")
    if "sandbox" in median and "plain" in median:
        print(f"sandbox / plain python -c: {median['sandbox'] / median['plain']:.2f}")
    if "sandbox" in median and "fresh" in median:
        print(f"sandbox (fork server) / fresh bwrap per program: {median['sandbox'] / median['fresh']:.2f}")
    if "sandbox" in median and "floor" in median:
        print(f"sandbox / floor (bwrap + python -I -S -c pass): {median['sandbox'] / median['floor']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
