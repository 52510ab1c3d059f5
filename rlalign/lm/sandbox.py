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
- a clean environment (``PATH``, ``HOME=/tmp``, ``LANG``), stdin closed (or a given input), and stdout
  and stderr read up to ``max_output_kb`` each and a report pipe (fd 3) up to ``max_report_kb``, never
  buffered whole; no other descriptor of the trainer's reaches the program.

How a run starts. By default (``FORK_SERVER``, where this machine allows nested namespaces) it is
forked from a server inside a bwrap sandbox, in namespaces, tmpfs and limits made for it
(:mod:`rlalign.lm.sandbox_fork`: about 11 ms of CPU for a short program on the 2-vCPU machine of
benchmarks/RESULTS.md). Otherwise, or with ``fork_server=False``, each run is a fresh bwrap and
interpreter (about 22 ms, most of it bwrap's and the interpreter's own start): the trainer never forks
itself (a fork of a process holding torch copies its page tables); it spawns ``/bin/sh`` (vfork +
exec), which joins the run's cgroup, sets the resource limits and execs bwrap, which starts
``python -I -S boot.py``. ``-S`` skips ``site`` (whose ``.pth`` files may import anything on each
start); :data:`_BOOT` puts the installation's site-packages on ``sys.path`` instead, defines
``exit`` / ``quit``, moves the report pipe to fd 3, closes every other inherited descriptor, marks
the report as started (a run whose Python never started is an error, not a zero score, and no
program can fake that) and runs the program as ``__main__``.

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
import shutil
import signal
import site
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

from rlalign.lm.sandbox_fork import fork_server_available, servers_for
from rlalign.lm.sandbox_os import (  # noqa: F401  (_cgroups_work: tests ask it)
    _STARTED, ISOLATION, NOBODY, SandboxLimits, SandboxResult, SandboxUnavailable, _bwrap_mounts, _Cgroup, _cgroups_work, _python, pump, run_cpu_seconds,
    setup_command,
)

__all__ = ["SandboxLimits", "SandboxResult", "SandboxUnavailable", "Sandbox", "isolation_available"]

FORK_SERVER = True  # Sandbox's default: fork each run from a server (sandbox_fork), where this machine allows it


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



class Sandbox:
    """Runs programs isolated as the module docstring describes.

    Raises:
        SandboxUnavailable: at construction, when bubblewrap cannot isolate here and ``allow_weak`` is False.
    """

    def __init__(self, limits: SandboxLimits = SandboxLimits(), allow_weak: bool = False, fork_server: bool | None = None):
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
        use_servers = FORK_SERVER if fork_server is None else fork_server
        self.servers = servers_for(limits) if use_servers and self.missing is None and fork_server_available() is None else None

    def run(self, files: dict[str, str], argv: list[str], stdin: bytes | None = None, timeout_s: float | None = None,
            cpu_s: float | None = None) -> SandboxResult:
        """Write ``files`` into a fresh directory, run ``python <argv>`` there in the sandbox (``stdin``
        on its standard input, else nothing), and return its exit code and capped outputs; the
        directory and every process are gone afterwards. ``timeout_s`` replaces the limits' wall time;
        ``cpu_s`` their CPU seconds per process (rounded up; None: the larger of the limits' and
        ``timeout_s``). With a fork server (the default where nested namespaces work) the run is forked
        from one, in namespaces and filesystems of its own (:mod:`rlalign.lm.sandbox_fork`)."""
        if self.servers is not None:
            return self.servers.run({**files, "boot.py": _BOOT}, argv, stdin, timeout_s, cpu_s)  # boot.py: for the Pythons a run starts
        workdir = Path(tempfile.mkdtemp(prefix="rlalign-sandbox-"))
        group = _Cgroup(self.limits) if self.cgroups else None
        report_read = report_write = -1
        try:
            for name, text in {**files, "boot.py": _BOOT}.items():
                (workdir / name).write_text(text)
            report_read, report_write = os.pipe()
            started = time.monotonic()
            proc = subprocess.Popen(
                self._command(workdir, report_write, argv, group, run_cpu_seconds(self.limits, timeout_s, cpu_s)), cwd=workdir, env=self._env(workdir),
                stdin=subprocess.DEVNULL if stdin is None else subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                pass_fds=(report_write,), start_new_session=True, preexec_fn=_weak_child_setup(self.limits, group) if self.missing else None,
            )
            os.close(report_write)
            report_write = -1
            caps = (self.limits.max_output_kb * 1024, self.limits.max_output_kb * 1024, self.limits.max_report_kb * 1024)
            deadline = started + (self.limits.timeout_s if timeout_s is None else timeout_s)
            outputs, timed_out = _read_capped(proc, report_read, stdin, deadline, caps)
            report_read = -1
            if timed_out:
                _kill_tree(proc, group)
            code = proc.wait()
            if group:
                group.kill()  # anything left in the tree (the PID namespace already took it with bwrap)
            stdout, stderr, report = outputs
            if not report.startswith(_STARTED) and not timed_out:  # boot.py never ran: nothing of the program's could
                what = "bubblewrap could not start the sandbox" if self.missing is None else "the weak sandbox could not start Python"
                raise SandboxUnavailable(f"{what}: {stderr[:300].decode(errors='replace').strip()}")
            return SandboxResult(None if timed_out else code, stdout, stderr, report[len(_STARTED):], timed_out, time.monotonic() - started)
        finally:
            for fd in (report_read, report_write):
                if fd >= 0:
                    os.close(fd)
            if group:
                group.close()
            shutil.rmtree(workdir, ignore_errors=True)

    def _command(self, workdir: Path, report_fd: int, argv: list[str], group: _Cgroup | None = None, cpu_s: int | None = None) -> list[str]:
        """``sh`` joining the cgroup and setting the limits (``cpu_s``: CPU seconds per process; None:
        the limits'), then exec'ing (bwrap, then) ``python -I -S boot.py``."""
        limits = self.limits
        setup = setup_command(limits, group, limits.cpu_s if cpu_s is None else cpu_s)
        python = [_python(), "-I", "-S", "boot.py", f"+{report_fd}", *argv]
        if self.missing is not None:
            return [*setup, *python]
        size = str(limits.tmp_mb * 2**20)
        return [
            *setup, shutil.which("bwrap"), *_bwrap_mounts(),
            "--proc", "/proc", "--dev", "/dev", "--size", size, "--tmpfs", "/tmp", "--size", size, "--tmpfs", "/dev/shm",
            "--ro-bind", str(workdir), "/sandbox", "--chdir", "/sandbox", *ISOLATION, "--die-with-parent", "--", *python,
        ]

    def _env(self, workdir: Path) -> dict[str, str]:
        return {"PATH": "/usr/bin:/bin", "HOME": str(workdir), "TMPDIR": str(workdir), "LANG": "C.UTF-8"}


# The first Python the sandbox runs (``python -I -S boot.py <fds> <script> <args>``): the
# installation's site-packages on sys.path (without running .pth files), ``exit`` / ``quit`` as site
# would define them, the descriptors <fds> (comma-separated) moved to 3, 4, ... and every other
# inherited one closed, then <script> run as __main__ with sys.argv = [<script>, <args>]. With <fds>
# "+<fd>" (a run's report pipe) it first writes _STARTED there: a run whose report does not begin
# with it never reached Python, which the program cannot fake (it runs later, and can only add).
_BOOT = """import builtins, os, sys
def _boot():
    fds = [int(fd) for fd in sys.argv[1].lstrip("+").split(",") if fd]
    if len(fds) > 1:  # moved out of the way first, so that no move overwrites a descriptor still to move
        import fcntl
        fds = [fcntl.fcntl(fd, fcntl.F_DUPFD, 16) for fd in fds]
    for target, fd in enumerate(fds, 3):
        if fd != target:
            os.dup2(fd, target)
    os.closerange(3 + len(fds), 1 << 20)
    if sys.argv[1].startswith("+"):
        os.write(3, b"\\x00")
    sys.path.extend(%r)
    def exit(code=None):
        raise SystemExit(code)
    builtins.exit = builtins.quit = exit
    sys.argv = sys.argv[2:]
    with open(sys.argv[0]) as file:
        return compile(file.read(), sys.argv[0], "exec")
exec(_boot(), {"__name__": "__main__", "__file__": sys.argv[0], "__builtins__": builtins})
""" % ([p for p in site.getsitepackages([sys.base_prefix]) if os.path.isdir(p)],)


@functools.cache
def _warn_weak(missing: str) -> None:
    warnings.warn(f"the code sandbox runs in its weak mode ({missing}): a hostile program can read files, see other processes and escape", RuntimeWarning, stacklevel=3)


def _weak_child_setup(limits: SandboxLimits, group: _Cgroup | None):
    """The weak mode's extra steps in the child between fork and exec: a cap on this user's processes
    where no cgroup counts them (root is not held by it), and an empty network namespace where allowed."""

    def setup() -> None:
        if not group and os.getuid() != 0:
            resource.setrlimit(resource.RLIMIT_NPROC, (limits.max_processes, limits.max_processes))
        _try_unshare_network()

    return setup


_LIBC = ctypes.CDLL(None, use_errno=True)  # loaded here: nothing may be imported between fork and exec


def _try_unshare_network() -> None:
    clone_newnet, clone_newuser = 0x40000000, 0x10000000
    if _LIBC.unshare(clone_newnet) != 0:
        _LIBC.unshare(clone_newuser | clone_newnet)


def _read_capped(proc: subprocess.Popen, report_fd: int, stdin: bytes | None, deadline: float, caps: tuple[int, int, int]) -> tuple[tuple[bytes, bytes, bytes], bool]:
    """Write ``stdin`` to the process (then close it) while reading stdout, stderr and the report pipe,
    each cut at its cap in ``caps`` (the rest read and dropped), until every pipe closes or the
    deadline; returns them and whether the deadline came first. Closes every pipe."""
    try:
        outputs, timed_out = pump((proc.stdout.fileno(), proc.stderr.fileno(), report_fd), caps, proc.stdin.fileno() if proc.stdin else None,
                                  stdin or b"", deadline, proc.stdin.close if proc.stdin else lambda: None)
        if not timed_out:  # every pipe closed; the process may still be finishing
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                timed_out = True
    finally:
        os.close(report_fd)
        for pipe in (proc.stdin, proc.stdout, proc.stderr):
            if pipe:
                pipe.close()
    return outputs, timed_out


def _kill_tree(proc: subprocess.Popen, group: _Cgroup | None) -> None:
    """SIGKILL the run's process group (bwrap, and with it its PID namespace) and its cgroup."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    if group:
        group.kill()
