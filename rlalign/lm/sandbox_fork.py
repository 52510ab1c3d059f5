"""Sandboxed runs forked from a server inside a sandbox: each program still gets namespaces, a
filesystem and limits of its own, at a small part of what a fresh bwrap and interpreter cost.

    servers = ForkServers(limits)
    result = servers.run({"main.py": source}, ["main.py"], stdin=None, timeout_s=None)   # a SandboxResult

A server is a bwrap sandbox made as :class:`rlalign.lm.sandbox.Sandbox` makes a fresh run's (user,
PID, mount, network, IPC and UTS namespaces, uid nobody, no capabilities, read-only system mounts,
a clean environment, a cgroup capping memory and processes, the address-space, file-size and
open-file limits), with its root and ``/dev`` read-only too, so that no run can leave a file there
for the next. It runs ``python -I -S -c`` :data:`_SERVER`, which imports what a run needs, then
waits on a Unix socket. It serves one run at a time (the pool starts one server per concurrent run),
so its cgroup's caps are that run's. A run:

1. The trainer sends the server six pipe ends over the socket (``SCM_RIGHTS``): request, stdin,
   stdout, stderr, report (fd 3) and status. The server forks a *keeper* and closes its copies, so
   the server never reads a program, and no program's bytes are in the memory the next run forks.
2. The keeper reads the request (files, argv, limits). It enters new user, mount, PID, network, IPC
   and UTS namespaces, nested in the server's, and maps its one user. Then it forks the run's
   *init*, PID 1 of the new PID namespace.
3. Init makes itself and the program the first the kernel kills when the cgroup runs out of memory
   (``oom_score_adj`` 1000). It makes every mount private and mounts size-capped tmpfs of its own:
   ``/tmp``, ``/dev/shm``, an empty read-only ``/proc``, and ``/sandbox`` holding the run's files
   (then read-only). It moves the run's pipes to 0-3, closes every other descriptor, and forks the
   *program*, PID 2. Then it drops Python's SIGINT handler (a PID 1 without handlers gets no signal
   from inside its namespace) and reaps.
4. The program calls ``setsid`` (no terminal to reach) and drops every capability, bounding set
   included, with ``no_new_privs``. It sets the run's resource limits (CPU seconds and address space per process,
   file size, open files, no core) and a clean environment. Then it boots as a fresh run does (the
   started mark on fd 3, the installation's site-packages, ``exit``) and runs the script as
   ``__main__``. It exits as the interpreter would where a program can see it: non-daemon threads
   joined, ``atexit`` handlers, the script's globals released (so their finalizers run), the
   standard streams flushed (a failed flush exits 120, as Python does). It skips tearing down the
   server's modules.
5. Init reaps orphans until the program exits, then exits with the program's status (128 + N for
   signal N), and the PID namespace and everything in it die with it. The keeper kills init at the
   wall-time limit and writes the status (or ``timeout``) to the status pipe. The trainer keeps its
   own deadline a little later, and at that deadline kills the whole server.

How a run differs from a fresh sandbox's:
- The program's interpreter is a fork of the server's: the modules the server imported are already
  in ``sys.modules`` (standard library only; ``sys.flags`` and ``sys.path`` are a fresh run's).
- ``/proc`` is empty. A new proc cannot be mounted under bwrap's, whose ``/proc/sys`` and other
  entries are covered, and the server's proc would show the server.
- The cgroup's memory cap also counts the idle server (about 10 MB).
- Where nested user namespaces are refused, :func:`fork_server_available` says why and
  :class:`rlalign.lm.sandbox.Sandbox` starts each run fresh.
"""

from __future__ import annotations

import atexit
import functools
import json
import os
import resource
import shutil
import signal
import site
import socket
import subprocess
import sys
import tempfile
import threading
import time

from rlalign.lm.sandbox_os import (
    _STARTED, ISOLATION, SandboxLimits, SandboxResult, SandboxUnavailable, _bwrap_mounts, _Cgroup, _cgroups_work, _python, pump, run_cpu_seconds,
    setup_command,
)

__all__ = ["ForkServers", "fork_server_available"]

GRACE_S = 2.0  # the trainer's deadline after the keeper's: a server that misses it is killed whole

_SERVER = r'''
import builtins, ctypes, gc, json, os, resource, select, signal, socket, sys, types
LIBC = ctypes.CDLL(None, use_errno=True)
SITE, STARTED = %r, %r
NEWNS, NEWUTS, NEWIPC, NEWUSER, NEWPID, NEWNET = 0x20000, 0x4000000, 0x8000000, 0x10000000, 0x20000000, 0x40000000
RDONLY, NOSUID, NODEV, REMOUNT, REC, PRIVATE = 1, 2, 4, 32, 16384, 1 << 18
PR_CAPBSET_DROP, PR_SET_NO_NEW_PRIVS = 24, 38

class CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]

class CapData(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]

def check(result, what):
    if result != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")

def mount(source, target, fstype, flags, data=None):
    check(LIBC.mount(source.encode(), target.encode(), fstype and fstype.encode(), flags, data and data.encode()), "mount " + target)

def read_all(fd):
    chunks = []
    while chunk := os.read(fd, 1 << 16):
        chunks.append(chunk)
    os.close(fd)
    return b"".join(chunks)

def keeper(fds):
    request_fd, io, status_fd = fds[0], fds[1:5], fds[5]
    try:
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        request = json.loads(read_all(request_fd))
        uid, gid = os.getuid(), os.getgid()
        check(LIBC.unshare(NEWUSER | NEWNS | NEWPID | NEWNET | NEWIPC | NEWUTS), "unshare")
        for name, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"), ("gid_map", f"{gid} {gid} 1")):
            with open("/proc/self/" + name, "w") as file:
                file.write(text)
        init = os.fork()
    except Exception as err:
        os.write(status_fd, f"error {err!r}".encode())
        os._exit(1)
    if init == 0:
        os.close(status_fd)
        run_init(request, io)
    for fd in io:
        os.close(fd)
    pidfd = os.pidfd_open(init)
    poller = select.poll()
    poller.register(pidfd, select.POLLIN)
    timed_out = not poller.poll(request["timeout_s"] * 1000)
    if timed_out:
        os.kill(init, signal.SIGKILL)
    _, status = os.waitpid(init, 0)
    os.write(status_fd, b"timeout" if timed_out else b"exit %%d" %% os.waitstatus_to_exitcode(status))
    os._exit(0)

def run_init(request, io):
    try:
        with open("/proc/self/oom_score_adj", "w") as file:  # before /proc is covered: init and the program die first on OOM
            file.write("1000")
        mount("none", "/", None, REC | PRIVATE)
        size = request["tmp_bytes"]
        for path in ("/tmp", "/dev/shm"):
            mount("tmpfs", path, "tmpfs", NOSUID | NODEV, f"size={size},mode=1777")
        mount("tmpfs", "/proc", "tmpfs", RDONLY | NOSUID | NODEV, "size=4096,mode=555")
        mount("tmpfs", "/sandbox", "tmpfs", NOSUID | NODEV, f"size={size},mode=755")
        for name, text in request["files"].items():
            with open(os.path.join("/sandbox", name), "w") as file:
                file.write(text)
        mount("none", "/sandbox", None, REMOUNT | RDONLY | NOSUID | NODEV)
        moved = [os.dup(fd) for fd in io]  # out of 0-3 first, so that no move overwrites one still to move
        for target, fd in enumerate(moved):
            os.dup2(fd, target)
        os.closerange(4, 1 << 20)
        program = os.fork()
    except Exception as err:
        os.write(io[2], f"the sandbox's init failed: {err!r}\n".encode())
        os._exit(125)
    if program == 0:
        run_program(request)
    signal.signal(signal.SIGINT, signal.SIG_DFL)  # a PID 1 without handlers: no signal from inside its namespace reaches it
    while True:
        pid, status = os.wait()
        if pid == program:
            os._exit(os.WEXITSTATUS(status) if os.WIFEXITED(status) else 128 + os.WTERMSIG(status))

def run_program(request):
    try:
        os.setsid()
        for cap in range(64):
            LIBC.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0)
        check(LIBC.capset(ctypes.byref(CapHeader(0x20080522, 0)), (CapData * 2)()), "capset")
        check(LIBC.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no_new_privs")
        for limit, value in request["rlimits"]:
            resource.setrlimit(limit, (value, value))
        os.chdir("/sandbox")
        os.environ.clear()
        os.environ.update(PATH="/usr/bin:/bin", HOME="/tmp", LANG="C.UTF-8", PWD="/sandbox")
    except Exception as err:
        os.write(2, f"the sandbox's program setup failed: {err!r}\n".encode())
        os._exit(125)
    os.write(3, STARTED)
    gc.enable()
    sys.path.extend(SITE)
    def exit(code=None):
        raise SystemExit(code)
    builtins.exit = builtins.quit = exit
    sys.argv = request["argv"]
    main = types.ModuleType("__main__")
    main.__file__, main.__builtins__ = sys.argv[0], builtins
    sys.modules["__main__"] = main
    code = 0
    try:
        with open(sys.argv[0]) as file:
            source = file.read()
        exec(compile(source, sys.argv[0], "exec"), main.__dict__)
    except SystemExit as exit_:
        code = exit_code(exit_)
    except BaseException as err:
        sys.excepthook(type(err), err, err.__traceback__.tb_next)
        code = 1
    finish(code, main)

def exit_code(exit_):
    if exit_.code is None or isinstance(exit_.code, int):
        return (exit_.code or 0) & 255
    print(exit_.code, file=sys.stderr)
    return 1

def finish(code, main):
    # what the interpreter's own exit does that a program can see: non-daemon threads joined, atexit
    # handlers run, the program's globals released (their finalizers run: a file object it never
    # closed is flushed), the standard streams flushed; the rest of a shutdown (tearing down the
    # server's modules) is skipped: the namespace ends with the process
    try:
        if "threading" in sys.modules:
            sys.modules["threading"]._shutdown()
        import atexit
        atexit._run_exitfuncs()
        main.__dict__.clear()
    except SystemExit as exit_:
        code = exit_code(exit_)
    except BaseException as err:
        sys.excepthook(type(err), err, err.__traceback__)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            code = code or 120
    os._exit(code)

def serve(sock):
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)
    while True:
        message, fds, _, _ = socket.recv_fds(sock, 16, 6)
        if not message:
            return
        if len(fds) != 6:
            for fd in fds:
                os.close(fd)
            continue
        if os.fork() == 0:
            sock.close()
            keeper(fds)
        for fd in fds:
            os.close(fd)

gc.disable()  # the server's objects stay untouched by collections, so that its forks share their pages
gc.freeze()
serve(socket.socket(fileno=int(sys.argv[1])))
''' % ([p for p in site.getsitepackages([sys.base_prefix]) if os.path.isdir(p)], _STARTED)


class _Server:
    """One server process (in its bwrap sandbox and cgroup) and the trainer's end of its socket."""

    def __init__(self, limits: SandboxLimits):
        self.limits = limits
        self.group = _Cgroup(limits, extra_processes=5) if _cgroups_work() else None
        self.sock, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.log = tempfile.TemporaryFile()
        self.info, info_write = os.pipe()  # bwrap writes {"child-pid": N} there: its PID 1, whose death ends the whole namespace
        os.set_blocking(self.info, False)
        setup = setup_command(limits, self.group, "unlimited")  # CPU seconds are each run's, set in the run
        bwrap = [shutil.which("bwrap"), *_bwrap_mounts(), "--proc", "/proc", "--dev", "/dev", "--tmpfs", "/tmp", "--tmpfs", "/dev/shm", "--dir", "/sandbox",
                 "--remount-ro", "/dev", "--remount-ro", "/", "--chdir", "/", *ISOLATION, "--info-fd", str(info_write)]
        try:
            self.proc = subprocess.Popen([*setup, *bwrap, "--", _python(), "-I", "-S", "-c", _SERVER, str(theirs.fileno())], stdin=subprocess.DEVNULL,
                                         stdout=subprocess.DEVNULL, stderr=self.log, pass_fds=(theirs.fileno(), info_write), start_new_session=True)
        except BaseException:
            self.close()
            raise
        finally:
            theirs.close()
            os.close(info_write)

    def run(self, files: dict[str, str], argv: list[str], stdin: bytes | None, timeout_s: float, cpu_s: float | None = None) -> SandboxResult:
        """One run (module docstring). Raises SandboxUnavailable when the server or the run's setup failed."""
        limits = self.limits
        rlimits = [(resource.RLIMIT_AS, limits.memory_mb * 2**20), (resource.RLIMIT_CPU, run_cpu_seconds(limits, timeout_s, cpu_s)),
                   (resource.RLIMIT_FSIZE, limits.max_file_mb * 2**20), (resource.RLIMIT_NOFILE, limits.max_open_files), (resource.RLIMIT_CORE, 0)]
        request = json.dumps({"files": files, "argv": argv, "timeout_s": timeout_s, "tmp_bytes": limits.tmp_mb * 2**20, "rlimits": rlimits}).encode()
        pipes = [os.pipe() for _ in range(6)]  # request, stdin, stdout, stderr, report, status
        theirs = [pipes[0][0], pipes[1][0], *(w for _, w in pipes[2:])]
        ours = [pipes[0][1], pipes[1][1], *(r for r, _ in pipes[2:])]
        started = time.monotonic()
        try:
            try:
                socket.send_fds(self.sock, [b"r"], theirs)
            except OSError as err:
                raise SandboxUnavailable(f"the sandbox server is gone ({err}){self._log()}") from err
            finally:
                for fd in theirs:
                    os.close(fd)
            try:
                _write_all(ours[0], request)
            except BrokenPipeError as err:
                raise SandboxUnavailable(f"the sandbox server did not take the run{self._log()}") from err
            os.close(ours[0])
            ours[0] = -1
            deadline = started + timeout_s + GRACE_S
            caps = (limits.max_output_kb * 1024, limits.max_output_kb * 1024, limits.max_report_kb * 1024)

            def close_stdin() -> None:
                os.close(ours[1])
                ours[1] = -1

            (stdout, stderr, report), late = pump(tuple(ours[2:5]), caps, ours[1], stdin or b"", deadline, close_stdin)
            (status,), late = pump((ours[5],), (64,), None, b"", deadline, lambda: None) if not late else ((b"",), True)
        finally:
            for fd in ours:
                if fd >= 0:
                    os.close(fd)
        if late:  # the keeper missed its own deadline: nothing of this server is trusted again
            self.close()
            return SandboxResult(None, stdout, stderr, report[len(_STARTED):], True, time.monotonic() - started)
        if status == b"timeout":
            return SandboxResult(None, stdout, stderr, report[len(_STARTED):], True, time.monotonic() - started)
        if report.startswith(_STARTED) and not status.startswith(b"exit "):  # the program ran, and its keeper was killed (the run's cgroup out of memory)
            self.close()
            return SandboxResult(128 + signal.SIGKILL, stdout, stderr, report[len(_STARTED):], False, time.monotonic() - started)
        if not status.startswith(b"exit ") or not report.startswith(_STARTED):  # the program never started: nothing of its could do this
            what = status.decode(errors="replace") or "no status"
            message = f"the sandbox server could not start the run ({what}): {stderr[:300].decode(errors='replace').strip()}{self._log()}"
            self.close()
            raise SandboxUnavailable(message)
        return SandboxResult(int(status[5:]), stdout, stderr, report[len(_STARTED):], False, time.monotonic() - started)

    @property
    def alive(self) -> bool:
        return self.sock.fileno() >= 0 and self.proc.poll() is None

    def _log(self) -> str:
        self.log.seek(0)
        text = self.log.read(2000).decode(errors="replace").strip()
        return f"; the server said: {text}" if text else ""

    def close(self) -> None:
        """End the server and everything it started: its socket closed, then bwrap's PID 1 (the whole
        namespace dies with it), bwrap's process group and the cgroup killed."""
        if self.sock.fileno() < 0:
            return
        self.sock.close()
        try:
            init = json.loads(os.read(self.info, 4096) or b"{}").get("child-pid")
        except (OSError, ValueError):
            init = None
        os.close(self.info)
        proc = getattr(self, "proc", None)
        for kill, pid in ((os.kill, init), (os.killpg, proc and proc.pid)):
            try:
                kill(pid, signal.SIGKILL) if pid else None
            except (ProcessLookupError, PermissionError):
                pass
        if proc is not None:
            proc.wait()
        if self.group:
            self.group.close()
        self.log.close()


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


class ForkServers:
    """The idle servers of one set of limits: a run takes one (or starts one) and gives it back."""

    def __init__(self, limits: SandboxLimits):
        self.limits = limits
        self.idle: list[_Server] = []
        self.lock = threading.Lock()

    def run(self, files: dict[str, str], argv: list[str], stdin: bytes | None = None, timeout_s: float | None = None,
            cpu_s: float | None = None) -> SandboxResult:
        with self.lock:
            server = self.idle.pop() if self.idle else None
        if server is None or not server.alive:
            if server is not None:
                server.close()
            server = _Server(self.limits)
        try:
            result = server.run(files, argv, stdin, self.limits.timeout_s if timeout_s is None else timeout_s, cpu_s)
        except BaseException:
            server.close()
            raise
        if server.alive:
            with self.lock:
                self.idle.append(server)
        else:
            server.close()
        return result

    def close(self) -> None:
        with self.lock:
            idle, self.idle = self.idle, []
        for server in idle:
            server.close()


_POOLS: dict[SandboxLimits, ForkServers] = {}
_POOLS_LOCK = threading.Lock()


@atexit.register
def _close_pools() -> None:
    for pool in list(_POOLS.values()):
        pool.close()


def servers_for(limits: SandboxLimits) -> ForkServers:
    """The process's one pool for these limits (every Sandbox of the same limits shares its servers)."""
    with _POOLS_LOCK:
        return _POOLS.setdefault(limits, ForkServers(limits))


@functools.cache
def fork_server_available() -> str | None:
    """None when a fork server isolates runs on this machine (bwrap works and allows nested namespaces), else why not."""
    servers = ForkServers(SandboxLimits(timeout_s=30.0))
    try:
        result = servers.run({"main.py": "import os\nos.write(3, b'ok')\n"}, ["main.py"])
    except (OSError, SandboxUnavailable) as err:
        return f"the fork server cannot start here: {err}"
    finally:
        servers.close()
    return None if result.exit_code == 0 and result.report == b"ok" else f"the fork server's probe run failed: {result}"
