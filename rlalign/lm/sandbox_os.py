"""What both ways of starting a sandboxed program share (:mod:`rlalign.lm.sandbox` starts a fresh
bwrap per program, :mod:`rlalign.lm.sandbox_fork` forks it from a server inside one): the limits and
result of a run, the read-only mounts, the cgroup of a run's tree, the shell that applies the limits
before bwrap, and the reading of a run's pipes up to their caps."""

from __future__ import annotations

import atexit
import functools
import math
import os
import select
import signal
import sys
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from rlalign.errors import RLAlignError

NOBODY = 65534  # the unprivileged user inside the sandbox


class SandboxUnavailable(RLAlignError, RuntimeError):
    """This machine cannot isolate untrusted programs, and the weak mode was not asked for."""


@dataclass(frozen=True)
class SandboxLimits:
    """What one run may use."""

    timeout_s: float = 5.0  # wall time of the whole tree
    cpu_s: int = 10  # CPU seconds per process
    memory_mb: int = 512  # the whole tree (cgroup), and each process's address space
    max_processes: int = 32
    max_open_files: int = 64
    max_file_mb: int = 16  # largest file a process may write
    max_output_kb: int = 64  # kept of stdout and of stderr
    max_report_kb: int = 4096  # kept of the report pipe (fd 3)
    tmp_mb: int = 64  # size of the private /tmp and /dev/shm


@dataclass
class SandboxResult:
    exit_code: int | None  # None when the run was killed at the timeout
    stdout: bytes
    stderr: bytes
    report: bytes  # what the program wrote to fd 3
    timed_out: bool
    seconds: float


def _python() -> str:
    return os.path.realpath(sys.executable)


def _bwrap_mounts() -> list[str]:
    """Read-only system and Python directories: enough to run ``python -I``, and nothing else of the host."""
    args = ["--ro-bind", "/usr", "/usr", "--symlink", "usr/bin", "/bin", "--symlink", "usr/lib", "/lib", "--symlink", "usr/lib64", "/lib64",
            "--ro-bind-try", "/etc/ld.so.cache", "/etc/ld.so.cache", "--ro-bind-try", "/etc/alternatives", "/etc/alternatives"]
    home = os.path.realpath(sys.base_prefix)
    if not home.startswith("/usr/"):
        args += ["--ro-bind", home, home]
    return args


class _Cgroup:
    """A cgroup for one run's process tree, capping its total memory and process count (v2, or v1's
    memory and pids controllers), or None-like when this process may not create one."""

    def __init__(self, limits: SandboxLimits, extra_processes: int = 2):
        self.dirs: list[Path] = []
        name = f"rlalign-sandbox-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        memory = str(limits.memory_mb * 2**20)
        try:
            if Path("/sys/fs/cgroup/cgroup.controllers").is_file():  # v2 (unified)
                own = Path("/sys/fs/cgroup") / Path("/proc/self/cgroup").read_text().strip().split("::", 1)[-1].lstrip("/")
                path = own / name
                path.mkdir()
                self.dirs = [path]
                (path / "memory.max").write_text(memory)
                (path / "memory.swap.max").write_text("0") if (path / "memory.swap.max").exists() else None
                (path / "pids.max").write_text(str(limits.max_processes + extra_processes))  # + bwrap's two processes (and a fork server's three)
            else:  # v1
                memory_dir, pids_dir = Path("/sys/fs/cgroup/memory") / name, Path("/sys/fs/cgroup/pids") / name
                memory_dir.mkdir()
                self.dirs.append(memory_dir)
                pids_dir.mkdir()
                self.dirs.append(pids_dir)
                (memory_dir / "memory.limit_in_bytes").write_text(memory)
                swap = memory_dir / "memory.memsw.limit_in_bytes"
                if swap.exists():
                    swap.write_text(memory)
                (pids_dir / "pids.max").write_text(str(limits.max_processes + extra_processes))  # + bwrap's two processes (and a fork server's three)
        except OSError:
            self.close()
            self.dirs = []

    def __bool__(self) -> bool:
        return bool(self.dirs)

    def join(self) -> None:
        """In the child before exec: move this process (and so everything it starts) into the cgroup."""
        for path in self.dirs:
            (path / "cgroup.procs").write_text(str(os.getpid()))

    def kill(self) -> None:
        for path in self.dirs:
            try:
                for pid in (path / "cgroup.procs").read_text().split():
                    os.kill(int(pid), signal.SIGKILL)
            except (OSError, ValueError):
                pass

    def close(self) -> None:
        """Kill what is left and remove the cgroup; one whose last process is still leaving (a killed
        process leaves a moment later) is removed by a later close, or at exit, without waiting here."""
        self.kill()
        with _LEAVING_LOCK:
            _LEAVING.extend(self.dirs)
            _remove_empty(_LEAVING)


_LEAVING: list[Path] = []  # cgroups of finished runs whose processes were still leaving
_LEAVING_LOCK = threading.Lock()


def _remove_empty(paths: list[Path]) -> None:
    for path in list(paths):
        try:
            path.rmdir()
        except FileNotFoundError:
            pass
        except OSError:
            continue
        paths.remove(path)


@atexit.register
def _remove_leaving() -> None:
    for _ in range(50):
        with _LEAVING_LOCK:
            _remove_empty(_LEAVING)
            if not _LEAVING:
                return
        time.sleep(0.02)


@functools.cache
def _cgroups_work() -> bool:
    group = _Cgroup(SandboxLimits())
    works = bool(group)
    group.close()
    return works



# The shell between the trainer and bwrap: $1-$4 the limits (address space in kB, CPU seconds, file
# size in 512-byte blocks, open files), $5 $6 the cgroup.procs files to join ("-": none). It exits
# when it cannot, before anything of the program runs.
_SETUP = """join() { [ "$1" = - ] || echo $$ > "$1" || exit 125; }
join "$5"; join "$6"
ulimit -v "$1" && ulimit -t "$2" && ulimit -f "$3" && ulimit -n "$4" && ulimit -c 0 || exit 125
shift 6
exec "$@"
"""


def run_cpu_seconds(limits: SandboxLimits, timeout_s: float | None, cpu_s: float | None) -> int:
    """The CPU seconds per process of one run: ``cpu_s`` when given, else the limits' raised to the
    run's wall time ``timeout_s``; whole seconds (RLIMIT_CPU's unit), rounded up."""
    if cpu_s is not None:
        return max(1, math.ceil(cpu_s))
    return max(limits.cpu_s, math.ceil(timeout_s or 0))


def setup_command(limits: SandboxLimits, group: _Cgroup | None, cpu_s: int | str) -> list[str]:
    """:data:`_SETUP` with ``limits`` (``cpu_s``: CPU seconds per process, or ``"unlimited"``) and
    ``group``'s cgroup.procs files; the command to exec follows it."""
    procs = [str(path / "cgroup.procs") for path in group.dirs] if group else []
    return ["/bin/sh", "-c", _SETUP, "sh", str(limits.memory_mb * 1024), str(cpu_s), str(limits.max_file_mb * 2048), str(limits.max_open_files),
            *(procs + ["-", "-"])[:2]]


# bwrap's isolation of every sandbox, fresh or fork server: all namespaces, the unprivileged user,
# setsid (no terminal to reach), no capabilities, a clean environment
ISOLATION = ["--unshare-all", "--uid", str(NOBODY), "--gid", str(NOBODY), "--new-session", "--cap-drop", "ALL",
             "--clearenv", "--setenv", "PATH", "/usr/bin:/bin", "--setenv", "HOME", "/tmp", "--setenv", "LANG", "C.UTF-8"]

# What boot code writes first on a run's report pipe: a run whose report does not begin with it never
# reached Python, which the program cannot fake (it runs later, and can only add).
_STARTED = b"\x00"


def pump(fds: tuple[int, ...], caps: tuple[int, ...], stdin_fd: int | None, stdin: bytes, deadline: float,
         close_stdin: Callable[[], None]) -> tuple[tuple[bytes, ...], bool]:
    """Write ``stdin`` to ``stdin_fd`` (then ``close_stdin()``; None: nothing to write) while reading
    ``fds``, each cut at its cap in ``caps`` (the rest read and dropped), until every one of them
    closes or the deadline; returns what was kept of each and whether the deadline came first. Closes
    nothing of ``fds``."""
    streams = {fd: bytearray() for fd in fds}
    cap_of = dict(zip(fds, caps))
    poller = select.poll()  # not select(): a trainer may hold more than FD_SETSIZE descriptors
    for fd in fds:
        poller.register(fd, select.POLLIN)
    to_write = memoryview(stdin)
    if stdin_fd is not None and not to_write:
        close_stdin()
        stdin_fd = None
    elif stdin_fd is not None:
        os.set_blocking(stdin_fd, False)
        poller.register(stdin_fd, select.POLLOUT)
    open_fds = set(fds)
    while open_fds:
        left = deadline - time.monotonic()
        if left <= 0:
            return tuple(bytes(streams[fd]) for fd in fds), True
        for fd, _ in poller.poll(min(left, 0.5) * 1000):
            if fd == stdin_fd:
                try:
                    written = os.write(fd, to_write[:65536])
                except BlockingIOError:
                    continue
                except BrokenPipeError:  # it stopped reading: the rest is dropped
                    written = len(to_write)
                to_write = to_write[written:]
                if not to_write:
                    poller.unregister(fd)
                    close_stdin()
                    stdin_fd = None
                continue
            chunk = os.read(fd, 65536)
            if not chunk:
                open_fds.discard(fd)
                poller.unregister(fd)
            elif len(streams[fd]) < cap_of[fd]:
                streams[fd].extend(chunk[: cap_of[fd] - len(streams[fd])])
    if stdin_fd is not None:  # every output closed before it read all its input
        close_stdin()
    return tuple(bytes(streams[fd]) for fd in fds), False
