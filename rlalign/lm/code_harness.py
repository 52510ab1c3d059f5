"""The two processes of a code sandbox run for the check, stdio and call formats (rlalign.lm.code_formats).

This file runs inside the sandbox, on the standard library only, started by the sandbox's boot.py:

    python -I -S boot.py <report fd> harness.py checker            (the first process: the checker)
    python -I -S boot.py <in fd>,<out fd> harness.py server <mode>  (started by the checker: the program)

The checker reads its job from stdin (a Python literal written by the trainer), makes itself not
dumpable (so the program, the same user, can neither ptrace it, read its memory, nor open its
descriptors), starts the server, asks it for each case (a call, or one run of the program on one
input) with a limit of CPU seconds per case (killing and restarting the server when it is passed),
and writes one line per case on fd 3: ``<nonce>\\t<case>\\t<status>\\t<payload>``.

Time. A case's limit is CPU time: what the program's process ran, read from its CPU-time clock
(``clock_getcpuclockid``), so a host that runs it slowly does not fail it. The wall clock is a
backstop only, ``wall_factor`` times longer: a case that reaches it reports ``wall`` and the run
stops there, and the trainer runs it again (rlalign.lm.code_execution). In the stdio mode the server
watches the CPU clock of the child running the case. The program may start threads (its process's
clock counts them) but no process (:func:`forbid_processes`); time it spends waiting (sleeping,
blocked) counts against the wall backstop only. In the check mode it runs
the dataset's ``check`` function itself, the program's functions replaced by proxies that ask the
server, and reports whether each case statement passed.

The server runs the program: in the call and check modes it executes it once (``__name__`` is
"solution", so a ``__main__`` block does not run) and answers calls with the ``repr`` of the value;
in the stdio mode it forks a child per case that runs the program as ``__main__`` with the case's
input on stdin, and answers with the exit code and what it wrote on stdout.

:func:`literal` is also what the trainer parses reported values with.
"""

import _ast
import builtins
import os
import sys

PR_SET_DUMPABLE = 4
MAX_LINE = 4 << 20  # longest answer line the checker reads from the server
MAX_STDOUT = 1 << 20  # stdout kept of one stdio case
# (AUDIT_ARCH, clone, clone3, the other syscalls that start a process) of the architectures whose numbers are known here
_ARCH_SYSCALLS = {"x86_64": (0xC000003E, 56, 435, (57, 58)), "aarch64": (0xC00000B7, 220, 435, ())}


def forbid_processes():
    """A seccomp filter on this process and everything it execs: no new process. fork, vfork and a
    clone without CLONE_THREAD fail with EPERM; clone3, whose flags a filter cannot read, fails with
    ENOSYS (so the C library falls back to clone); any syscall of another ABI (i386, x32) fails. A
    thread is allowed: it is part of the process, whose CPU-time clock counts it; a process would
    run outside that clock. Returns False where this architecture's numbers are not known or the
    kernel refuses the filter (nothing installed)."""
    import ctypes  # noqa: PLC0415 - only where a program runs

    arch = _ARCH_SYSCALLS.get(os.uname().machine)
    if arch is None:
        return False
    audit_arch, clone, clone3, others = arch
    load, jeq, jge, jset, ret = 0x20, 0x15, 0x35, 0x45, 0x06  # BPF_LD|W|ABS, BPF_JMP|{JEQ,JGE,JSET}|K, BPF_RET|K
    allow, eperm, enosys, m = 0x7FFF0000, 0x00050001, 0x00050026, len(others)
    program = [(load, 0, 0, 4), (jeq, 1, 0, audit_arch), (ret, 0, 0, eperm),  # another ABI: nothing
               (load, 0, 0, 0), (jge, m + 6, 0, 0x40000000), (jeq, m + 6, 0, clone3), (jeq, m + 1, 0, clone)]
    program += [(jeq, m + 3 - i, 0, number) for i, number in enumerate(others)]
    program += [(ret, 0, 0, allow), (load, 0, 0, 16), (jset, 0, 1, 0x00010000), (ret, 0, 0, allow), (ret, 0, 0, eperm), (ret, 0, 0, enosys)]
    # clone's flags (args[0]'s low word): CLONE_THREAD allowed ^, else denied; then the answers to clone3 and the rest

    class Filter(ctypes.Structure):
        _fields_ = [("code", ctypes.c_ushort), ("jt", ctypes.c_ubyte), ("jf", ctypes.c_ubyte), ("k", ctypes.c_uint)]

    class Program(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(Filter))]

    filters = (Filter * len(program))(*[Filter(*row) for row in program])
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(38, 1, 0, 0, 0) != 0:  # PR_SET_NO_NEW_PRIVS
        return False
    return libc.prctl(22, 2, ctypes.byref(Program(len(program), filters)), 0, 0) == 0  # PR_SET_SECCOMP, SECCOMP_MODE_FILTER


def literal(text: str):
    """The plain Python literal ``text`` (what ``ast.literal_eval`` accepts, plus ``inf`` and ``nan`` as
    ``repr`` writes them), built without running any code. Raises ValueError, TypeError, SyntaxError,
    RecursionError or MemoryError on anything else."""
    return _literal(compile(text, "<value>", "eval", _ast.PyCF_ONLY_AST).body, 0)


def _literal(node, depth):
    if depth > 200:
        raise ValueError("literal nested too deep")
    kind = type(node)
    if kind is _ast.Constant and node.value is not Ellipsis:
        return node.value
    if kind in (_ast.List, _ast.Tuple, _ast.Set):
        items = [_literal(item, depth + 1) for item in node.elts]
        return list(items) if kind is _ast.List else tuple(items) if kind is _ast.Tuple else set(items)
    if kind is _ast.Dict and None not in node.keys:
        return {_literal(k, depth + 1): _literal(v, depth + 1) for k, v in zip(node.keys, node.values)}
    if kind is _ast.Name and node.id in ("inf", "nan"):
        return float(node.id)
    if kind is _ast.UnaryOp and type(node.op) in (_ast.USub, _ast.UAdd):
        value = _literal(node.operand, depth + 1)
        if type(value) in (int, float, complex):
            return -value if type(node.op) is _ast.USub else value
    if kind is _ast.BinOp and type(node.op) in (_ast.Add, _ast.Sub):  # complex numbers: 1+2j
        left, right = _literal(node.left, depth + 1), _literal(node.right, depth + 1)
        if type(left) in (int, float) and type(right) is complex:
            return left + right if type(node.op) is _ast.Add else left - right
    if kind is _ast.Call and type(node.func) is _ast.Name and node.func.id in ("set", "frozenset") and not node.keywords and len(node.args) <= 1:
        items = _literal(node.args[0], depth + 1) if node.args else ()
        if type(items) in (list, tuple, set):
            return set(items) if node.func.id == "set" else frozenset(items)
    raise ValueError("not a plain literal: " + type(node).__name__)


# ----------------------------------------------------------------------------------------------
# The checker (trusted: the trainer's code, never the program's)
# ----------------------------------------------------------------------------------------------


class _Stop(BaseException):
    """A case failed and the score is all or nothing: the remaining cases need not run."""


class _Wall(BaseException):
    """A call reached the wall-clock backstop: the run stops, and the trainer runs it again."""


def cpu_seconds(pid):
    """CPU seconds process ``pid`` has run so far (its CPU-time clock), or None when it has ended."""
    import time  # noqa: PLC0415 - only where a case is timed

    try:
        return time.clock_gettime(((~pid) << 3) | 2)  # MAKE_PROCESS_CPUCLOCK(pid, CPUCLOCK_SCHED)
    except OSError:
        return None


class Server:
    """The program's process, asked one request at a time; killed and restarted after a timeout."""

    def __init__(self, mode, start_cpu, case_cpu, wall_factor):
        self.mode, self.pid, self.loaded, self.timed_out = mode, None, "", None
        self.start_cpu, self.case_cpu, self.wall_factor = start_cpu, case_cpu, wall_factor

    def start(self):
        request_read, self.requests = os.pipe()
        self.answers, answer_write = os.pipe()
        os.set_inheritable(request_read, True)
        os.set_inheritable(answer_write, True)
        argv = [sys.executable, "-I", "-S", "boot.py", "%d,%d" % (request_read, answer_write), "harness.py", "server", self.mode, repr(self.case_cpu)]
        actions = [(os.POSIX_SPAWN_OPEN, 0, "/dev/null", os.O_RDONLY, 0), (os.POSIX_SPAWN_DUP2, 2, 1)]
        self.pid = os.posix_spawn(sys.executable, argv, dict(os.environ), file_actions=actions, setpgroup=0)
        os.close(request_read)
        os.close(answer_write)
        self.buffer = b""
        line = self.read(self.start_cpu)
        self.loaded = "ready" if line == "ready" else "wall" if self.timed_out == "wall" else "timeout" if self.timed_out else (line or "its process ended").replace("\t", ": ")

    def ask(self, request):
        """(status, payload) of one request: ("ok", ...), ("error", what went wrong), or ("wall", "")
        when the program's start or this request reached the wall-clock backstop (not its CPU limit)."""
        if self.pid is None:
            self.start()
        if self.loaded == "wall":
            return "wall", ""
        if self.loaded != "ready":
            return "error", "program: " + self.loaded
        try:
            write_all(self.requests, (request + "\n").encode())
            line = self.read(self.case_cpu)
        except OSError:  # it closed its end: it has ended
            line = None
        if line is None:
            what = "wall" if self.timed_out == "wall" else "timeout" if self.timed_out else "the program's process ended"
            self.kill()
            return ("wall", "") if what == "wall" else ("error", what)
        status, _, payload = line.partition("\t")
        return ("ok", payload) if status == "ok" else ("error", payload or status)

    def read(self, cpu_limit):
        """The next answer line, or None: when the server's process has run ``cpu_limit`` CPU seconds
        since the call (``timed_out`` "cpu"), at ``wall_factor`` times that in wall-clock seconds
        (``timed_out`` "wall"), at the end of the pipe, or past MAX_LINE."""
        import select  # noqa: PLC0415 - only where a server runs
        import time  # noqa: PLC0415

        deadline = time.monotonic() + cpu_limit * self.wall_factor
        self.timed_out = None
        poller = select.poll()
        poller.register(self.answers, select.POLLIN)
        start = cpu_seconds(self.pid) or 0.0
        while b"\n" not in self.buffer:
            used = (cpu_seconds(self.pid) or start) - start
            left = deadline - time.monotonic()
            if used >= cpu_limit or left <= 0:
                self.timed_out = "cpu" if used >= cpu_limit else "wall"
                return None
            if not poller.poll(min(left, cpu_limit - used, 0.5) * 1000 + 1):  # CPU time passes no faster than the wall clock a thread
                continue
            chunk = os.read(self.answers, 1 << 16)
            if not chunk or len(self.buffer) > MAX_LINE:
                return None
            self.buffer += chunk
        line, _, self.buffer = self.buffer.partition(b"\n")
        return line.decode("utf-8", "replace")

    def kill(self):
        if self.pid is not None:
            for kill in (os.killpg, os.kill):  # its group, and itself should it have left the group
                try:
                    kill(self.pid, 9)
                except OSError:
                    pass
            os.close(self.requests)
            os.close(self.answers)
            os.waitpid(self.pid, 0)
            self.pid = None


def write_all(fd, data):
    while data:
        data = data[os.write(fd, data):]


def checker():
    os.set_inheritable(3, False)  # the report pipe never reaches the program
    job = eval(sys.stdin.buffer.read().decode(), {"__builtins__": {}})  # noqa: S307 - a literal the trainer wrote
    nonce, stop = job["nonce"], job["stop"]

    def report(case, status, payload=""):
        write_all(3, ("%s\t%s\t%s\t%s\n" % (nonce, case, status, payload.replace("\n", " "))).encode("utf-8", "replace"))

    import ctypes  # noqa: PLC0415 - before the server starts: the program may never read this process

    if ctypes.CDLL(None).prctl(PR_SET_DUMPABLE, 0, 0, 0, 0) != 0:
        report(-1, "fatal", "cannot make the checker's process unreadable (prctl)")
        return
    server = Server("call" if job["mode"] == "check" else job["mode"], job["start_timeout"], job["case_timeout"], job["wall_factor"])
    try:
        if job["mode"] == "check":
            run_check(job, server, report)
        else:
            for case, request in enumerate(job["requests"]):
                status, payload = server.ask(request)
                report(case, status, payload)
                if status == "wall":
                    break  # the trainer runs it all again
                if stop and (status != "ok" or (job["mode"] == "stdio" and not payload.startswith("0\t"))):
                    break  # an error, a timeout or a run that did not exit 0 fails whatever the expected values
    finally:
        server.kill()


def run_check(job, server, report):
    """Run the dataset's check function here, each name of ``job["proxied"]`` a proxy asking the server."""

    def proxy(name):
        def call(*args, **kwargs):
            status, payload = server.ask(repr(("call", name, args, kwargs)))
            if status == "wall":
                raise _Wall
            if status != "ok":  # the program's exception, by its builtin class where it names one (a check may expect it)
                error = getattr(builtins, payload, None)
                if error in (StopIteration, StopAsyncIteration):  # raised through map() or a for loop it would end it silently
                    error = None
                try:
                    error = error() if isinstance(error, type) and issubclass(error, Exception) else RuntimeError(payload)
                except Exception:  # a class that needs arguments
                    error = RuntimeError(payload)
                raise error
            return literal(payload)

        call.__name__ = name
        return call

    def case(index, error):
        if isinstance(error, _Wall):
            raise error
        report(index, "fail" if error is not None else "pass", "" if error is None else type(error).__name__ + ": " + str(error)[:200])
        if error is not None and job["stop"]:
            raise _Stop

    scope = {"__name__": "__check__", "__builtins__": builtins}
    try:
        exec(compile(job["helpers"], "prompt", "exec"), scope)
        scope.update({name: proxy(name) for name in job["proxied"]})
        scope["__rlalign_case"] = case
        exec(compile(job["test"], "test", "exec"), scope)
        scope["check"](scope[job["entry_point"]])
    except _Stop:
        pass
    except _Wall:
        report(-1, "wall")
    except BaseException as err:  # outside every case: the remaining cases are not reported, so they fail
        report(-1, "error", type(err).__name__ + ": " + str(err)[:200])


# ----------------------------------------------------------------------------------------------
# The server (the program's process)
# ----------------------------------------------------------------------------------------------


def server(mode, case_cpu):
    def answer(text):
        write_all(4, (text.replace("\n", " ") + "\n").encode("utf-8", "replace"))

    with open("program.py") as file:
        source = file.read()
    scope = {"__name__": "solution", "__builtins__": builtins}
    try:
        code = compile(source, "program.py", "exec")
        if mode != "stdio":  # this process runs the program (in the stdio mode, each case's child does)
            forbid_processes()
            exec(code, scope)
    except BaseException as err:
        answer("error\t" + type(err).__name__)
        return
    answer("ready")
    names = {"__builtins__": {}, "inf": float("inf"), "nan": float("nan"), "set": set, "frozenset": frozenset}
    with open(3, "rb") as requests:
        for line in requests:
            request = eval(line, names)  # noqa: S307 - the checker's request: a literal
            if request[0] == "stdio":
                answer(run_stdio(code, request[1], case_cpu))
                continue
            try:
                answer("ok\t" + repr(_function(scope, request[1])(*request[2], **request[3])))
            except BaseException as err:
                answer("error\t" + type(err).__name__)


def _function(scope, name):
    """The program's function ``name``: a top-level one, or a method of its class ``Solution`` (LeetCode)."""
    function = scope.get(name)
    if callable(function):
        return function
    if isinstance(scope.get("Solution"), type) and hasattr(scope["Solution"], name):
        return getattr(scope["Solution"](), name)
    raise NameError(name)


def _exit_status(run):
    """0 when ``run()`` returns, the code of a SystemExit, 1 after any other exception (written to stderr)."""
    try:
        run()
        return 0
    except SystemExit as err:
        return err.code if isinstance(err.code, int) else 0 if err.code is None else 1
    except BaseException as err:
        os.write(2, ("%s: %s\n" % (type(err).__name__, err)).encode("utf-8", "replace"))
        return 1


def run_stdio(code, text, cpu_limit):
    """Run the program as __main__ in a forked child with ``text`` on stdin: "ok\\t<exit code>\\t<repr of stdout>",
    or "error\\tTimeoutError" when the child has run ``cpu_limit`` CPU seconds (it is killed)."""
    import select  # noqa: PLC0415 - only in the stdio mode
    stdin = os.memfd_create("stdin")
    write_all(stdin, text.encode("utf-8", "replace"))
    os.lseek(stdin, 0, 0)
    out_read, out_write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.dup2(stdin, 0)
        os.dup2(out_write, 1)
        os.closerange(3, 1 << 20)
        forbid_processes()
        sys.argv = ["program.py"]
        status = _exit_status(lambda: exec(code, {"__name__": "__main__", "__builtins__": builtins}))
        for name, end in (("threading", "_shutdown"), ("atexit", "_run_exitfuncs")):  # as the interpreter's exit does
            if name in sys.modules:
                status = _exit_status(getattr(sys.modules[name], end)) or status
        try:
            sys.stdout.flush()
        except BaseException:
            status = status or 1
        os._exit(status & 0xFF)
    os.close(stdin)
    os.close(out_write)
    out = bytearray()
    ended = os.pidfd_open(pid)
    poller = select.poll()
    poller.register(out_read, select.POLLIN)
    poller.register(ended, select.POLLIN)
    running = reading = True
    while running:
        used = cpu_seconds(pid) or 0.0  # the child's own CPU time, from 0 at the fork
        if used >= cpu_limit:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            os.close(out_read)
            os.close(ended)
            return "error\tTimeoutError"
        for fd, _ in poller.poll(min(cpu_limit - used, 0.5) * 1000 + 1):
            if fd == ended:
                running = False
                continue
            chunk = os.read(out_read, 1 << 16)
            if not chunk:
                poller.unregister(out_read)
                reading = False
            elif len(out) < MAX_STDOUT:
                out += chunk[: MAX_STDOUT - len(out)]
    os.set_blocking(out_read, False)
    while reading:  # what it wrote before it ended (a process it started may still hold the pipe)
        try:
            chunk = os.read(out_read, 1 << 16)
        except BlockingIOError:
            break
        reading = bool(chunk)
        out += chunk[: max(0, MAX_STDOUT - len(out))]
    os.close(out_read)
    os.close(ended)
    _, status = os.waitpid(pid, 0)
    return "ok\t%d\t%r" % (os.waitstatus_to_exitcode(status), out.decode("utf-8", "replace"))


if __name__ == "__main__":
    if sys.argv[1:2] == ["checker"]:
        checker()
    elif sys.argv[1:2] == ["server"]:
        server(sys.argv[2], float(sys.argv[3]))
