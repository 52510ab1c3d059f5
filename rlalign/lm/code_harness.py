"""The two processes of a code sandbox run for the check, stdio, call and asserts formats (rlalign.lm.code_formats, rlalign.lm.code_execution).

This file runs inside the sandbox, on the standard library only, started by the sandbox's boot.py:

    python -I -S boot.py <report fd> harness.py checker            (the first process: the checker)
    python -I -S boot.py <in fd>,<out fd> harness.py server <mode>  (a server the checker restarts: the program)

The checker makes itself not dumpable (so the program, the same user, can neither ptrace it, read
its memory, nor open its descriptors), forks its first server (:func:`fork_server`: a fork costs a
small part of a fresh interpreter's start), and only then reads its job from stdin (a Python literal
written by the trainer): the nonce, the requests, HumanEval's check never were in the memory the
server was forked from, and the server drops every descriptor of the checker's (the job's stdin, the
report) before it waits for its mode; a server that replaces one killed after a timeout is a fresh
interpreter, started as the second line above (the checker's memory then holds the job). It asks it for each case (a call, or one run of the program on one
input) with a limit of CPU seconds per case (killing and restarting the server when it is passed),
and writes one line per case on fd 3: ``<nonce>\\t<case>\\t<status>\\t<payload>``; a long line that
would pass what the trainer's report cap leaves becomes a short ``too_long`` one, so none is lost.

Time. A case's limit is CPU time: what the program's process ran, read from its CPU-time clock
(``clock_getcpuclockid``), so a host that runs it slowly does not fail it. It is read while the
checker waits and again when the answer has come (in the stdio mode, the child's rusage once it has
ended): a case whose answer took more fails, however it was produced. The program's processes may
signal no other process (:func:`forbid_processes`), so they cannot stop the one timing them. The wall clock is a
backstop only, ``wall_factor`` times longer: a case that reaches it reports ``wall`` and the run
stops there, and the trainer runs it again (rlalign.lm.code_execution). In the stdio mode the server
watches the CPU clock of the child running the case. The program may start threads (its process's
clock counts them) but no process (:func:`forbid_processes`); time it spends waiting (sleeping,
blocked) counts against the wall backstop only. In the check mode it runs
the dataset's ``check`` function itself, the program's functions replaced by proxies that ask the
server, and reports whether each case statement passed.

The server runs the program: in the call and check modes it executes it once (``__name__`` is
"solution", so a ``__main__`` block does not run) and answers calls with the value as text
(rlalign.lm.code_values.wire: its ``repr``, or a tagged literal for a numpy, collections or
namedtuple value); in the asserts mode it executes it as ``__main__``, then the tests' setup code in
its globals, and answers each case with the texts of its expressions' values (rlalign.lm.code_execution);
in the stdio mode it forks a child per case that runs the program as ``__main__`` with the case's
input on stdin, and answers with the exit code and what it wrote on stdout.

Values are read back, here and in the trainer, by rlalign.lm.code_values.unwire, which builds only
plain literals and the types that module lists; in the sandbox that module runs first, in this one's globals.
"""

import builtins
import os
import sys

if __name__ != "__main__":  # in the sandbox rlalign.lm.code_values ran first, in these globals (rlalign.lm.code_formats.HARNESS)
    from rlalign.lm.code_values import TYPED, allow_long_ints, is_unknown, literal, unwire, wire

PR_SET_DUMPABLE = 4
MAX_LINE = 4 << 20  # longest answer line the checker reads from the server, unless its job sets each case's
REPORT_SHORT = 512  # a report line this long is always written: the trainer's report budget keeps room for one per case
# the syscall numbers forbid_processes filters, by architecture: AUDIT_ARCH, clone, clone3, the other calls that
# start a process, those that signal a process given as their first argument (kill, tgkill, rt_sigqueueinfo,
# rt_tgsigqueueinfo), those that may signal another process and are never needed (tkill, pidfd_send_signal), fcntl, ioctl
_ARCH_SYSCALLS = {"x86_64": (0xC000003E, 56, 435, (57, 58), (62, 234, 129, 297), (200, 424), 72, 16),
                  "aarch64": (0xC00000B7, 220, 435, (), (129, 131, 138, 240), (130, 424), 25, 29)}
_SET_OWNER = (8, 15, 0x8901, 0x8902)  # F_SETOWN, F_SETOWN_EX (fcntl); FIOSETOWN, SIOCSPGRP (ioctl): who gets an fd's SIGIO


def seccomp_program(arch, pid):
    """The BPF program of :func:`forbid_processes` for ``arch`` (a row of :data:`_ARCH_SYSCALLS`) in process
    ``pid``: a list of (code, jt, jf, k), jumps resolved from labels (forward only, as BPF's are)."""
    audit_arch, clone, clone3, others, signals, never, fcntl, ioctl = arch
    ld, jeq, jge, jset, ret = 0x20, 0x15, 0x35, 0x45, 0x06  # BPF_LD|W|ABS, BPF_JMP|{JEQ,JGE,JSET}|K, BPF_RET|K
    rows = [(ld, None, None, 4), (jeq, None, "deny", audit_arch), (ld, None, None, 0), (jge, "deny", None, 0x40000000),  # another ABI: nothing
            (jeq, "nosys", None, clone3), (jeq, "clone", None, clone)]
    rows += [(jeq, "deny", None, number) for number in (*others, *never)]
    rows += [(jeq, "self", None, number) for number in signals]
    rows += [(jeq, "fcntl", None, fcntl), (jeq, "ioctl", None, ioctl), (ret, None, None, 0x7FFF0000)]
    blocks = {"clone": [(ld, None, None, 16), (jset, "allow", "deny", 0x00010000)],  # clone's flags: CLONE_THREAD, a thread
              "self": [(ld, None, None, 16), (jeq, "allow", "deny", pid)],  # a signal to this process (its threads) only
              "fcntl": [(ld, None, None, 24), *[(jeq, "deny", None, cmd) for cmd in _SET_OWNER[:2]], (ret, None, None, 0x7FFF0000)],
              "ioctl": [(ld, None, None, 24), *[(jeq, "deny", None, cmd) for cmd in _SET_OWNER[2:]], (ret, None, None, 0x7FFF0000)],
              "allow": [(ret, None, None, 0x7FFF0000)], "deny": [(ret, None, None, 0x00050001)], "nosys": [(ret, None, None, 0x00050026)]}
    labels = {}
    for name, block in blocks.items():
        labels[name] = len(rows)
        rows += block
    return [(code, 0 if jt is None else labels[jt] - i - 1, 0 if jf is None else labels[jf] - i - 1, k) for i, (code, jt, jf, k) in enumerate(rows)]


def forbid_processes():
    """A seccomp filter on this process and everything it execs: no new process, and no signal to
    another one. fork, vfork and a clone without CLONE_THREAD fail with EPERM; clone3, whose flags a
    filter cannot read, fails with ENOSYS (so the C library falls back to clone); any syscall of
    another ABI (i386, x32) fails. A thread is allowed: it is part of the process, whose CPU-time
    clock counts it; a process would run outside that clock. kill, tgkill and the sigqueue calls
    reach this process only, tkill and pidfd_send_signal nothing, and no descriptor's SIGIO may be
    sent to another process (fcntl F_SETOWN, ioctl FIOSETOWN): so the program cannot stop the
    process that times it (its checker, or the stdio server) while it works. Returns False where
    this architecture's numbers are not known or the kernel refuses the filter (nothing installed)."""
    import ctypes  # noqa: PLC0415 - only where a program runs

    arch = _ARCH_SYSCALLS.get(os.uname().machine)
    if arch is None:
        return False
    program = seccomp_program(arch, os.getpid())

    class Filter(ctypes.Structure):
        _fields_ = [("code", ctypes.c_ushort), ("jt", ctypes.c_ubyte), ("jf", ctypes.c_ubyte), ("k", ctypes.c_uint)]

    class Program(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(Filter))]

    filters = (Filter * len(program))(*[Filter(*row) for row in program])
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(38, 1, 0, 0, 0) != 0:  # PR_SET_NO_NEW_PRIVS
        return False
    return libc.prctl(22, 2, ctypes.byref(Program(len(program), filters)), 0, 0) == 0  # PR_SET_SECCOMP, SECCOMP_MODE_FILTER


# ----------------------------------------------------------------------------------------------
# The checker (trusted: the trainer's code, never the program's)
# ----------------------------------------------------------------------------------------------


class _Stop(BaseException):
    """A case failed and the score is all or nothing: the remaining cases need not run."""


class _Wall(BaseException):
    """A call reached the wall-clock backstop: the run stops, and the trainer runs it again."""


class _NotAValue(BaseException):
    """A call returned a value not rebuilt here (rlalign.lm.code_values): its case fails, whatever the check catches."""


class _TooLong(BaseException):
    """A call's answer passed its size cap: its case fails, counted apart (the trainer's ``output_cut``)."""


def cpu_seconds(pid):
    """CPU seconds process ``pid`` has run so far (its CPU-time clock), or None when it has ended."""
    import time  # noqa: PLC0415 - only where a case is timed

    try:
        return time.clock_gettime(((~pid) << 3) | 2)  # MAKE_PROCESS_CPUCLOCK(pid, CPUCLOCK_SCHED)
    except OSError:
        return None


class Server:
    """The program's process, asked one request at a time; killed and restarted after a timeout."""

    def __init__(self, mode, start_cpu, case_cpu, wall_factor, forked=None):
        self.mode, self.pid, self.loaded, self.timed_out = mode, None, "", None
        self.start_cpu, self.case_cpu, self.wall_factor = start_cpu, case_cpu, wall_factor
        self.forked = forked  # (pid, requests, answers) of the server :func:`fork_server` forked before the job was read, or None

    def start(self):
        self.buffer = b""
        if self.forked is not None:  # the first server: forked, waiting for its mode (then it runs the program)
            (self.pid, self.requests, self.answers), self.forked = self.forked, None
            try:
                write_all(self.requests, (repr((self.mode, self.case_cpu)) + "\n").encode())
                line = self.read(self.start_cpu, MAX_LINE, since=0.0)  # its CPU from the fork on: nothing of the program's ran before
            except OSError:
                line = None
        else:
            line = self.spawn()
        self.loaded = "ready" if line == "ready" else self.timed_out if self.timed_out in ("wall", "timeout") else (line or "its process ended").replace("\t", ": ")

    def spawn(self):
        """Start a fresh interpreter as the server (after a timeout killed the last one); its first line."""
        request_read, self.requests = os.pipe()
        self.answers, answer_write = os.pipe()
        os.set_inheritable(request_read, True)
        os.set_inheritable(answer_write, True)
        argv = [sys.executable, "-I", "-S", "boot.py", "%d,%d" % (request_read, answer_write), "harness.py", "server", self.mode, repr(self.case_cpu)]
        actions = [(os.POSIX_SPAWN_OPEN, 0, "/dev/null", os.O_RDONLY, 0), (os.POSIX_SPAWN_DUP2, 2, 1)]
        self.pid = os.posix_spawn(sys.executable, argv, dict(os.environ), file_actions=actions, setpgroup=0)
        os.close(request_read)
        os.close(answer_write)
        return self.read(self.start_cpu, MAX_LINE)

    def ask(self, request, max_line=MAX_LINE):
        """(status, payload) of one request: ("ok", ...), ("error", what went wrong), ("too_long", why)
        when its answer passed ``max_line`` bytes (or the program's output its cap), or ("wall", "")
        when the program's start or this request reached the wall-clock backstop (not its CPU limit)."""
        if self.pid is None:
            self.start()
        if self.loaded == "wall":
            return "wall", ""
        if self.loaded != "ready":
            return "error", "program: " + self.loaded
        try:
            write_all(self.requests, (request + "\n").encode())
            line = self.read(self.case_cpu, max_line)
        except OSError:  # it closed its end: it has ended
            line = None
        if line is None:
            what = self.timed_out or "the program's process ended"
            self.kill()
            return ("wall", "") if what == "wall" else ("too_long", "an answer over %d bytes" % max_line) if what == "too_long" else ("error", what)
        status, _, payload = line.partition("\t")
        return (status, payload) if status in ("ok", "too_long") else ("error", payload or status)

    def read(self, cpu_limit, max_line, since=None):
        """The next answer line, or None: when the server's process has run ``cpu_limit`` CPU seconds
        since the call (or since its CPU clock read ``since``; ``timed_out`` "timeout"), checked while waiting and again when the answer has
        come (a program that stops this process while it works is caught then), at ``wall_factor``
        times that in wall-clock seconds ("wall"), past ``max_line`` bytes ("too_long"), or at the end of the pipe."""
        import select  # noqa: PLC0415 - only where a server runs
        import time  # noqa: PLC0415

        deadline = time.monotonic() + cpu_limit * self.wall_factor
        self.timed_out = None
        poller = select.poll()
        poller.register(self.answers, select.POLLIN)
        start = (cpu_seconds(self.pid) or 0.0) if since is None else since
        while b"\n" not in self.buffer:
            used = (cpu_seconds(self.pid) or start) - start
            left = deadline - time.monotonic()
            if used >= cpu_limit or left <= 0:
                self.timed_out = "timeout" if used >= cpu_limit else "wall"
                return None
            if not poller.poll(min(left, cpu_limit - used, 0.5) * 1000 + 1):  # CPU time passes no faster than the wall clock a thread
                continue
            chunk = os.read(self.answers, 1 << 16)
            if not chunk:
                return None
            self.buffer += chunk
            if self.buffer.find(b"\n", 0, max_line + 1) < 0 and len(self.buffer) > max_line:
                self.timed_out = "too_long"
                return None
        if (cpu_seconds(self.pid) or start) - start >= cpu_limit:  # the CPU its answer took, however long this process waited
            self.timed_out = "timeout"
            return None
        line, _, self.buffer = self.buffer.partition(b"\n")
        return line.decode("utf-8", "replace")

    def kill(self):
        if self.forked is not None:  # never asked: killed as a started one
            (self.pid, self.requests, self.answers), self.forked = self.forked, None
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


def fork_server():
    """Fork the first server, before the checker reads its job: (pid, requests fd, answers fd), or None
    when the fork fails (the server is then started fresh). The child holds a copy of the checker's
    memory as it was before the job came (the fork server's modules, this file: no nonce, no request, no
    check), and none of its descriptors: stdin (the job, still unread in its pipe) becomes /dev/null,
    stdout stderr (as a fresh server's), the report pipe and the rest are closed, the two pipes of its
    own moved to 3 and 4; it leads a process group of its own. It waits for its mode (:func:`server`);
    the checker is already not dumpable (the child inherits that; it makes itself dumpable again where a
    fresh server would be)."""
    request_read, requests = os.pipe()
    answers, answer_write = os.pipe()
    try:
        pid = os.fork()
    except OSError:
        pid = None
    if pid == 0:
        try:
            import fcntl  # noqa: PLC0415

            os.setpgid(0, 0)
            ends = [fcntl.fcntl(fd, fcntl.F_DUPFD, 16) for fd in (request_read, answer_write)]  # out of the way of 0-4 first
            null = os.open("/dev/null", os.O_RDONLY)
            os.dup2(null, 0)
            os.dup2(2, 1)
            os.dup2(ends[0], 3)  # over the report pipe
            os.dup2(ends[1], 4)
            os.closerange(5, 1 << 20)
            server()
        finally:
            os._exit(0)  # never back into the checker's code
    os.close(request_read)
    os.close(answer_write)
    if pid is None:
        os.close(requests)
        os.close(answers)
        return None
    try:
        os.setpgid(pid, pid)  # as the child does: whichever runs first
    except OSError:
        pass
    return pid, requests, answers


def checker():
    os.set_inheritable(3, False)  # the report pipe never reaches the program
    allow_long_ints()
    import ctypes  # noqa: PLC0415 - before the server starts: the program may never read this process

    unreadable = ctypes.CDLL(None).prctl(PR_SET_DUMPABLE, 0, 0, 0, 0) == 0
    forked = fork_server() if unreadable else None  # before the job is read: the server holds nothing of it
    job = eval(sys.stdin.buffer.read().decode(), {"__builtins__": {}})  # noqa: S307 - a literal the trainer wrote
    nonce, stop, budget = job["nonce"], job["stop"], [job["report_budget"]]

    def report(case, status, payload=""):
        """One report line; a long one that would pass the report's budget (the trainer's cap, less room
        for a short line per case) becomes a short ``too_long`` line: the report is never cut."""
        line = ("%s\t%s\t%s\t%s\n" % (nonce, case, status, payload.replace("\n", " "))).encode("utf-8", "replace")
        if len(line) > REPORT_SHORT and len(line) > budget[0]:
            line = ("%s\t%s\ttoo_long\ta report line of %d bytes, over what is left of the report's cap\n" % (nonce, case, len(line))).encode()
        budget[0] -= len(line) if len(line) > REPORT_SHORT else 0
        write_all(3, line)

    if not unreadable:
        report(-1, "fatal", "cannot make the checker's process unreadable (prctl)")
        return
    server = Server("call" if job["mode"] == "check" else job["mode"], job["start_timeout"], job["case_timeout"], job["wall_factor"], forked)
    try:
        if job["mode"] == "check":
            run_check(job, server, report)
        else:
            for case, (request, max_line) in enumerate(zip(job["requests"], job["max_lines"])):
                status, payload = server.ask(request, max_line)
                report(case, status, payload)
                if status == "wall":
                    break  # the trainer runs it all again
                if stop and (status != "ok" or (job["mode"] == "stdio" and not payload.startswith("0\t"))):
                    report(-1, "stopped", "case %d failed" % case)  # the rest are not reported: the trainer knows why
                    break  # an error, a timeout or a run that did not exit 0 fails whatever the expected values
    finally:
        server.kill()


def run_check(job, server, report):
    """Run the dataset's check function here, each name of ``job["proxied"]`` a proxy asking the server."""

    def proxy(name):
        def call(*args, **kwargs):
            request = wire(("call", name, args, kwargs))
            if is_unknown(request):  # an argument the program's process could not be given (a lambda, a Fraction)
                raise _NotAValue("an argument of a type not sent to the program: " + request[:200])
            status, payload = server.ask(request)
            if status == "wall":
                raise _Wall
            if status == "too_long":
                raise _TooLong(payload)
            if status != "ok":  # the program's exception, by its builtin class where it names one (a check may expect it)
                error = getattr(builtins, payload, None)
                if error in (StopIteration, StopAsyncIteration):  # raised through map() or a for loop it would end it silently
                    error = None
                try:
                    error = error() if isinstance(error, type) and issubclass(error, Exception) else RuntimeError(payload)
                except Exception:  # a class that needs arguments
                    error = RuntimeError(payload)
                raise error
            try:
                return unwire(payload)
            except Exception as err:  # a type not rebuilt here, any text that is no value: never an exception of the program's
                raise _NotAValue(str(err)[:200]) from None

        call.__name__ = name
        return call

    def case(index, error):
        if isinstance(error, _Wall):
            raise error
        status = "pass" if error is None else "too_long" if isinstance(error, _TooLong) else "fail"
        report(index, status, "" if error is None else type(error).__name__ + ": " + str(error)[:200])
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
        report(-1, "stopped", "a case failed")
    except _Wall:
        report(-1, "wall")
    except BaseException as err:  # outside every case: the remaining cases are not reported, so they fail
        report(-1, "error", type(err).__name__ + ": " + str(err)[:200])


# ----------------------------------------------------------------------------------------------
# The server (the program's process)
# ----------------------------------------------------------------------------------------------


def server(mode=None, case_cpu=None):
    """Run the program (and, in the asserts mode, the tests' setup code after it, in its globals) and
    answer the checker's requests (fd 3) on fd 4: a call, an expression to evaluate (asserts), or a stdio
    run. Forked by :func:`fork_server` (``mode`` None), it first reads its mode and CPU limit per case there."""
    def answer(text):
        write_all(4, (text.replace("\n", " ") + "\n").encode("utf-8", "replace"))

    requests = open(3, "rb")
    if mode is None:
        mode, case_cpu = literal(requests.readline().decode())
        sys.argv = ["harness.py", "server", mode, repr(case_cpu)]  # as a fresh server's
        if mode != "stdio":  # dumpable, as a fresh server (the stdio one makes itself not)
            import ctypes  # noqa: PLC0415

            ctypes.CDLL(None).prctl(PR_SET_DUMPABLE, 1, 0, 0, 0)
    allow_long_ints()  # for the program's own values too (its stdio children inherit it)
    sources = []
    for name in ("program.py", "setup.py") if mode == "asserts" else ("program.py",):  # all read before the program runs
        with open(name) as file:
            sources.append((name, file.read()))
    scope = {"__name__": "__main__" if mode == "asserts" else "solution", "__builtins__": builtins}
    try:
        if mode == "stdio":  # each case's child runs the program; this process, which times them, stays out of their reach
            import ctypes  # noqa: PLC0415

            ctypes.CDLL(None).prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)
            code = compile(sources[0][1], "program.py", "exec")
        else:
            forbid_processes()
            for name, source in sources:
                exec(compile(source, name, "exec"), scope)
    except BaseException as err:
        answer("error\t" + name + ": " + type(err).__name__)
        return
    answer("ready")
    names = {"__builtins__": {}, "inf": float("inf"), "nan": float("nan"), "set": set, "frozenset": frozenset}
    with requests:
        for line in requests:
            request = unwire(line.decode().rstrip("\n")) if line.startswith(TYPED.encode()) else eval(line, names)  # noqa: S307 - the checker's request: a literal
            if request[0] == "stdio":
                answer(run_stdio(code, request[1], case_cpu, request[2]))
                continue
            try:
                if request[0] == "eval":  # the asserts format: the reprs of a case's expressions
                    answer("ok\t" + repr([wire(eval(compile(expression, "test", "eval"), scope)) for expression in request[1]]))
                else:
                    answer("ok\t" + wire(_function(scope, request[1])(*request[2], **request[3])))
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


def run_stdio(code, text, cpu_limit, max_stdout):
    """Run the program as __main__ in a forked child with ``text`` on stdin: "ok\\t<exit code>\\t<repr of stdout>";
    "error\\tTimeoutError" when the child has run ``cpu_limit`` CPU seconds (read while it runs, and from its
    rusage once it has ended: a child that stopped this process meanwhile is caught then); "too_long\\t..."
    when it wrote more than ``max_stdout`` bytes (it is killed in both cases)."""
    import select  # noqa: PLC0415 - only in the stdio mode
    stdin = os.memfd_create("stdin")
    write_all(stdin, text.encode("utf-8", "replace"))
    os.lseek(stdin, 0, 0)
    out_read, out_write = os.pipe()
    pid = os.fork()
    if pid == 0:
        _run_child(code, stdin, out_write)
    os.close(stdin)
    os.close(out_write)
    out = bytearray()
    ended = os.pidfd_open(pid)
    poller = select.poll()
    poller.register(out_read, select.POLLIN)
    poller.register(ended, select.POLLIN)
    running = reading = True
    verdict = None
    while running and verdict is None:
        used = cpu_seconds(pid) or 0.0  # the child's own CPU time, from 0 at the fork
        if used >= cpu_limit:
            verdict = "error\tTimeoutError"
            break
        for fd, _ in poller.poll(min(cpu_limit - used, 0.5) * 1000 + 1):
            if fd == ended:
                running = False
                continue
            chunk = os.read(out_read, 1 << 16)
            if not chunk:
                poller.unregister(out_read)
                reading = False
            out += chunk
            if len(out) > max_stdout:
                verdict = "too_long\tstdout over %d bytes" % max_stdout
                break
    os.set_blocking(out_read, False)
    while reading and verdict is None:  # what it wrote before it ended (a process it started may still hold the pipe)
        try:
            chunk = os.read(out_read, 1 << 16)
        except BlockingIOError:
            break
        reading = bool(chunk)
        out += chunk
        if len(out) > max_stdout:
            verdict = "too_long\tstdout over %d bytes" % max_stdout
    if verdict is not None:
        os.kill(pid, 9)
    os.close(out_read)
    os.close(ended)
    _, status, usage = os.wait4(pid, 0)
    if verdict is None and usage.ru_utime + usage.ru_stime >= cpu_limit:
        verdict = "error\tTimeoutError"
    return verdict or "ok\t%d\t%r" % (os.waitstatus_to_exitcode(status), out.decode("utf-8", "replace"))


def _run_child(code, stdin, out_write):
    """In the forked child of a stdio case: the program as __main__, its stdin and stdout the case's, then exit as the interpreter would."""
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


if __name__ == "__main__":
    if sys.argv[1:2] == ["checker"]:
        checker()
    elif sys.argv[1:2] == ["server"]:
        server(sys.argv[2], float(sys.argv[3]))
