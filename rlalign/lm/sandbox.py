"""Run an untrusted program where it can neither see nor harm the trainer, the machine or the network.

    sandbox = Sandbox(SandboxLimits(timeout_s=5, memory_mb=512))
    result = sandbox.run({"main.py": source}, ["main.py"])   # exit code, capped stdout / stderr / report

Threat model: the program is hostile (an RL policy finds every exploit a reward leaves open). Each
run gets, with bubblewrap (``bwrap``, from the distribution's packages):

- its own user, PID, mount, network, IPC and UTS namespaces: it sees only its own processes (not
  the trainer's ``/proc/<pid>/environ``, nor any process to signal), has no network at all (no
  loopback service, no abstract Unix socket of the host), and runs as an unprivileged user;
- a filesystem of its own: the system's ``/usr`` and the base Python installation read-only (with
  that installation's own site-packages, not the trainer's virtual environment), the program's files
  read-only in ``/sandbox``, a private size-capped ``/tmp`` and ``/dev/shm``, and nothing else (no home
  directory, no project source, no host socket, no ``/etc`` secrets);
- limits: wall time (the whole process tree is killed at ``timeout_s``, none survives: the PID
  namespace dies with its first process), CPU seconds and address space per process, file size,
  open files; and, in a cgroup where the machine lets us make one (v1 or v2), the total memory and
  the number of processes of the whole tree (without a cgroup, the PID namespace and the wall-time
  kill bound a fork bomb);
- a clean environment (``PATH``, ``HOME=/tmp``, ``LANG``), stdin closed, and stdout and stderr read up
  to ``max_output_kb`` each and a report pipe (fd 3) up to ``max_report_kb``, never buffered whole.

Where bwrap cannot isolate (not installed, or namespaces refused), :class:`Sandbox` refuses to
run unless ``allow_weak=True``, and then warns once naming what is missing: the weak mode is a
subprocess with the resource limits above, leading its own process group and (where allowed) in a new network
namespace, which a hostile program can escape.
"""

from __future__ import annotations

import ctypes
import functools
import os
import resource
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
import warnings
from dataclasses import dataclass
from pathlib import Path

from rlalign.errors import RLAlignError

__all__ = ["SandboxLimits", "SandboxResult", "SandboxUnavailable", "Sandbox", "isolation_available"]

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


@functools.cache
def isolation_available() -> str | None:
    """None when bubblewrap can isolate a program on this machine, else what is missing."""
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        return "bubblewrap (bwrap) is not installed"
    probe = subprocess.run([bwrap, *_bwrap_mounts(), "--unshare-all", "--uid", str(NOBODY), "--gid", str(NOBODY), "--", _python(), "-I", "-c", "pass"],
                           capture_output=True, timeout=60)
    if probe.returncode != 0:
        return f"bwrap cannot create its namespaces here ({probe.stderr.decode(errors='replace').strip()[:200]})"
    return None


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

    def __init__(self, limits: SandboxLimits):
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
                (path / "pids.max").write_text(str(limits.max_processes + 2))  # + bwrap's two processes
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
                (pids_dir / "pids.max").write_text(str(limits.max_processes + 2))  # + bwrap's two processes
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
        self.kill()
        for path in self.dirs:
            for _ in range(50):  # a killed process leaves its cgroup a moment later
                try:
                    path.rmdir()
                    break
                except OSError:
                    time.sleep(0.01)


@functools.cache
def _cgroups_work() -> bool:
    group = _Cgroup(SandboxLimits())
    works = bool(group)
    group.close()
    return works


class Sandbox:
    """Runs programs isolated as the module docstring describes.

    Raises:
        SandboxUnavailable: at construction, when bubblewrap cannot isolate here and ``allow_weak`` is False.
    """

    def __init__(self, limits: SandboxLimits = SandboxLimits(), allow_weak: bool = False):
        self.limits = limits
        self.missing = isolation_available()
        if self.missing is not None:
            if not allow_weak:
                raise SandboxUnavailable(
                    f"cannot sandbox untrusted code here: {self.missing}. Install bubblewrap (e.g. apt-get install bubblewrap), "
                    "or accept a weak sandbox that a hostile program can escape (allow_weak_sandbox: true)"
                )
            _warn_weak(self.missing)
        self.cgroups = _cgroups_work()

    def run(self, files: dict[str, str], argv: list[str]) -> SandboxResult:
        """Write ``files`` into a fresh directory, run ``python -I <argv>`` there in the sandbox, and
        return its exit code and capped outputs; the directory and every process are gone afterwards."""
        workdir = Path(tempfile.mkdtemp(prefix="rlalign-sandbox-"))
        group = _Cgroup(self.limits) if self.cgroups else None
        try:
            for name, text in files.items():
                (workdir / name).write_text(text)
            report_read, report_write = os.pipe()
            command = self._command(workdir, argv)
            started = time.monotonic()
            proc = subprocess.Popen(
                command, cwd=workdir, env=self._env(workdir), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                pass_fds=tuple(sorted({3, report_write})), preexec_fn=functools.partial(_child_setup, self.limits, group, report_write, self.missing is not None),
            )
            os.close(report_write)
            caps = (self.limits.max_output_kb * 1024, self.limits.max_output_kb * 1024, self.limits.max_report_kb * 1024)
            outputs, timed_out = _read_capped(proc, report_read, started + self.limits.timeout_s, caps)
            if timed_out:
                _kill_tree(proc, group)
            code = proc.wait()
            if group:
                group.kill()  # anything left in the tree (the PID namespace already took it with bwrap)
            if self.missing is None and code != 0 and outputs[1].startswith(b"bwrap:") and not outputs[2]:
                raise SandboxUnavailable(f"bubblewrap could not start the sandbox: {outputs[1][:300].decode(errors='replace').strip()}")
            return SandboxResult(None if timed_out else code, *outputs, timed_out, time.monotonic() - started)
        finally:
            if group:
                group.close()
            shutil.rmtree(workdir, ignore_errors=True)

    def _command(self, workdir: Path, argv: list[str]) -> list[str]:
        python = [_python(), "-I", *argv]
        if self.missing is not None:
            return python
        size = str(self.limits.tmp_mb * 2**20)
        return [
            shutil.which("bwrap"), *_bwrap_mounts(),
            "--proc", "/proc", "--dev", "/dev", "--size", size, "--tmpfs", "/tmp", "--size", size, "--tmpfs", "/dev/shm",
            "--ro-bind", str(workdir), "/sandbox", "--chdir", "/sandbox",
            "--unshare-all", "--uid", str(NOBODY), "--gid", str(NOBODY), "--die-with-parent", "--new-session", "--cap-drop", "ALL",
            "--clearenv", "--setenv", "PATH", "/usr/bin:/bin", "--setenv", "HOME", "/tmp", "--setenv", "LANG", "C.UTF-8",
            "--", *python,
        ]

    def _env(self, workdir: Path) -> dict[str, str]:
        return {"PATH": "/usr/bin:/bin", "HOME": str(workdir), "TMPDIR": str(workdir), "LANG": "C.UTF-8"}


@functools.cache
def _warn_weak(missing: str) -> None:
    warnings.warn(f"the code sandbox runs in its weak mode ({missing}): a hostile program can read files, see other processes and escape", RuntimeWarning, stacklevel=3)


def _child_setup(limits: SandboxLimits, group: _Cgroup | None, report_fd: int, weak: bool) -> None:
    """In the child between fork and exec: its own process group (the tree is killed as one), the
    cgroup, the resource limits, the report pipe at fd 3; in the weak mode an empty network namespace."""
    os.setsid()
    if group:
        group.join()
    memory = limits.memory_mb * 2**20
    for kind, value in (
        (resource.RLIMIT_AS, memory), (resource.RLIMIT_CPU, limits.cpu_s), (resource.RLIMIT_FSIZE, limits.max_file_mb * 2**20),
        (resource.RLIMIT_NOFILE, limits.max_open_files), (resource.RLIMIT_CORE, 0),
    ):
        resource.setrlimit(kind, (value, value))
    if weak and not group and os.getuid() != 0:  # weak mode without a cgroup: cap this user's processes (root is not held by it)
        resource.setrlimit(resource.RLIMIT_NPROC, (limits.max_processes, limits.max_processes))
    if report_fd != 3:
        os.dup2(report_fd, 3)
        os.close(report_fd)
    if weak:
        _try_unshare_network()


_LIBC = ctypes.CDLL(None, use_errno=True)  # loaded here: nothing may be imported between fork and exec


def _try_unshare_network() -> None:
    clone_newnet, clone_newuser = 0x40000000, 0x10000000
    if _LIBC.unshare(clone_newnet) != 0:
        _LIBC.unshare(clone_newuser | clone_newnet)


def _read_capped(proc: subprocess.Popen, report_fd: int, deadline: float, caps: tuple[int, int, int]) -> tuple[tuple[bytes, bytes, bytes], bool]:
    """stdout, stderr and the report pipe, each cut at its cap in ``caps`` (the rest read and dropped),
    until every pipe closes or the deadline; returns them and whether the deadline came first."""
    streams = {proc.stdout.fileno(): bytearray(), proc.stderr.fileno(): bytearray(), report_fd: bytearray()}
    cap_of = dict(zip(streams, caps))
    order = list(streams)
    open_fds = set(streams)
    timed_out = False
    try:
        while open_fds:
            left = deadline - time.monotonic()
            if left <= 0:
                timed_out = True
                break
            ready, _, _ = select.select(list(open_fds), [], [], min(left, 0.5))
            for fd in ready:
                chunk = os.read(fd, 65536)
                if not chunk:
                    open_fds.discard(fd)
                elif len(streams[fd]) < cap_of[fd]:
                    streams[fd].extend(chunk[: cap_of[fd] - len(streams[fd])])
        if not timed_out:  # every pipe closed; the process may still be finishing
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                timed_out = True
    finally:
        os.close(report_fd)
        proc.stdout.close()
        proc.stderr.close()
    return tuple(bytes(streams[fd]) for fd in order), timed_out


def _kill_tree(proc: subprocess.Popen, group: _Cgroup | None) -> None:
    """SIGKILL the run's process group (bwrap, and with it its PID namespace) and its cgroup."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    if group:
        group.kill()
