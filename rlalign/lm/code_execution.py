"""A code-execution reward: run each completion's program against its row's tests, in a sandbox,
and score it from values checked outside the sandbox, never from an exit code.

    reward = code_execution({prompt: "assert add(2, 3) == 5"}, case_timeout_s=4, memory_mb=512)
    reward(prompts, completions)   # 1.0 where every test passes, else 0.0 (partial_credit: the share passed)
    reward(prompts, completions, test=[...], entry_point=[...])   # the rows' own columns, any format below

The program is the last fenced code block of the completion (```python ... ``` or ``` ... ```),
or the whole completion when it has none. It runs in :class:`rlalign.lm.sandbox.Sandbox` (its own
namespaces, a private filesystem, no network, limits on time, memory, processes and output).

The tests come in the formats the datasets ship them in (``code_format``, "auto" by the row's columns):

==========  ======================================================  ===================================
format      columns                                                 a case
==========  ======================================================  ===================================
asserts     ``tests``: Python with top-level ``assert`` statements  one assert (``a and b``: two)
mbpp        ``test_list`` (assert strings), ``test_setup_code``,    one assert, as in asserts
            ``test_imports``
humaneval   ``test`` (``def check(candidate)``), ``entry_point``    a statement of check with an assert
stdio       ``input_output`` (APPS, TACO), ``verification_info``,   one run on one input
            ``public_tests`` (CodeContests), or ``tests`` as JSON
call        the same with ``fn_name``                               one call
==========  ======================================================  ===================================

Each case has ``case_timeout_s`` CPU seconds; the program's own start ``timeout_s``. CPU seconds,
not wall-clock seconds: a slow or busy host does not fail a correct program. The wall clock is a
backstop only (``wall_factor`` times the CPU limit), and a run that reaches it is run again, then
counted and left out (:class:`CodeExecutionReward`), never scored as a failure unless asked
(``on_timeout="zero"``). The humaneval, stdio and call
formats are scored as rlalign.lm.code_formats describes; the asserts and mbpp formats as follows.

How a score is made, so that a program cannot forge it. The prompt's tests are parsed here, outside
the sandbox: every top-level ``assert`` is a test case (``assert a and b``: two), every other
statement is setup code. Each case is split in two. The sub-expressions that need the program (calls
of its functions, names it defines: ``f(2)``, ``area(r)``) go into the sandbox; the rest of the
assert (literals, arithmetic, comparisons, ``and`` / ``or`` / ``not``, and a few pure builtins such
as ``abs``, ``len``, ``sorted``, ``math.isclose``) stays here. A harness runs the program, then the
setup, then each sub-expression, and reports its ``repr`` on a pipe; here each value is parsed back
as a Python literal and the rest of the assert is evaluated on it. So:

- an early exit (``os._exit``, ``sys.exit``, a signal, an ``atexit`` handler) reports nothing: 0;
- a test that raises or passes its time limit, an exception the program swallows, or a value that is
  not a plain literal (an object whose ``__eq__`` always answers True) fails that test; patching
  ``math.isclose`` or ``builtins`` inside the sandbox changes nothing here;
- a program that writes reports itself sees only the sub-expressions (``f(2)``), never the expected
  values or the operators applied to them, so it must produce the values a solution would; a report
  with a missing, repeated or extra test, or one cut off at the size cap, scores 0 for every test.

A test's weakness stays its own: ``assert is_prime(7)`` is passed by any function returning True.
"""

from __future__ import annotations

import ast
import functools
import json
import math
import os
import threading
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from rlalign.lm.code_formats import FORBID_PROCESSES, IO_COLUMNS, CallTests, CheckTests, Job, StdioTests, TestsError, WallTimeout, check_tests, extract_code, io_tests, run_limits
from rlalign.lm.reward_calls import UNSCORED
from rlalign.lm.sandbox import Sandbox, SandboxLimits, SandboxUnavailable

__all__ = [
    "extract_code", "TestCase", "TestsError", "parse_tests", "AssertTests", "code_tests", "CODE_FORMATS", "CODE_COLUMNS",
    "CodeExecutionReward", "code_execution", "run_program",
]

CODE_FORMATS = ("auto", "asserts", "mbpp", "humaneval", "stdio", "call")
CODE_COLUMNS = ("tests", "test", "entry_point", "test_list", "test_setup_code", "test_imports", *IO_COLUMNS, "private_tests", "generated_tests", "fn_name")


# Runs inside the sandbox: the program, the setup, then each case's expression(s), each under its
# limit of CPU seconds (ITIMER_PROF: the time this process ran, not the time the host took to run
# it); one report line per case on fd 3: "<index>\t<kind>\t<repr of the list of the values' reprs>".
# A program that swallows the TimeoutError gets a second alarm soon after, which fails its case and
# ends the run; one that turns the alarm off meets RLIMIT_CPU. The wall-clock backstop is the
# sandbox's, outside: no line of this report (which the program can write to) can claim it. The
# program may start no process (forbid_processes): its CPU time would escape the alarm; threads count.
# Written by rlalign, not the policy; no import beyond the interpreter's own start and ctypes.
_HARNESS = FORBID_PROCESSES + """import _signal, os
def _main():
    with open("cases.py") as file:
        start_cpu, case_cpu, stop, cases = eval(file.read(), {"__builtins__": {}})
    forbid_processes()
    running = ["-1", 0]  # the report index of what runs, and the CPU alarms it has had
    def over_cpu(*_):
        running[1] += 1
        if running[1] > 1:  # the first TimeoutError was swallowed
            os.write(3, (running[0] + "\\terror\\tTimeoutError\\n").encode())
            os._exit(0)
        _signal.setitimer(_signal.ITIMER_PROF, 0.5)
        raise TimeoutError
    def limit(index, cpu):
        running[0], running[1] = index, 0
        _signal.signal(_signal.SIGPROF, over_cpu)
        _signal.setitimer(_signal.ITIMER_PROF, cpu)
    scope = {"__name__": "__main__", "__builtins__": __builtins__}
    sources = []
    for name in ("program.py", "setup.py"):  # both read before the program runs
        with open(name) as file:
            sources.append((name, file.read()))
    for name, source in sources:
        limit("-1", start_cpu)
        try:
            exec(compile(source, name, "exec"), scope)
            _signal.setitimer(_signal.ITIMER_PROF, 0)
        except BaseException as err:
            _signal.setitimer(_signal.ITIMER_PROF, 0)
            os.write(3, ("-1\\terror\\t" + name + ": " + type(err).__name__ + "\\n").encode())
            return
    for index, expressions in enumerate(cases):
        limit(str(index), case_cpu)
        try:
            values = [repr(eval(compile(expression, "test_%d" % index, "eval"), scope)) for expression in expressions]
            _signal.setitimer(_signal.ITIMER_PROF, 0)
            line = "%d\\tok\\t%r\\n" % (index, values)
        except BaseException as err:
            _signal.setitimer(_signal.ITIMER_PROF, 0)
            line = "%d\\terror\\t%s\\n" % (index, type(err).__name__)
            if stop:
                os.write(3, line.encode())
                return
        os.write(3, line.encode())
_main()
os._exit(0)  # the report is whole: no atexit handler or thread of the program's may hold the run
"""


# Functions the check outside the sandbox may call on reported values: pure, on plain literals.
_OUTSIDE_FUNCTIONS = {
    "abs": abs, "round": round, "len": len, "min": min, "max": max, "sum": sum, "sorted": sorted, "set": set, "frozenset": frozenset,
    "list": list, "tuple": tuple, "dict": dict, "str": str, "int": int, "float": float, "bool": bool, "all": all, "any": any,
    "isinstance": isinstance, "range": range, "reversed": reversed, "zip": zip, "enumerate": enumerate, "math.isclose": math.isclose, "math.sqrt": math.sqrt, "math.floor": math.floor, "math.ceil": math.ceil,
}
_OUTSIDE_NODES = (ast.Constant, ast.Tuple, ast.List, ast.Set, ast.Dict, ast.UnaryOp, ast.BinOp, ast.BoolOp, ast.Compare, ast.IfExp,
                  ast.Subscript, ast.Slice, ast.keyword, ast.Load, ast.operator, ast.unaryop, ast.boolop, ast.cmpop)


@dataclass(frozen=True)
class TestCase:
    """One top-level assert, split in two: ``expressions``, the sub-expressions that need the program
    (calls of its functions, names it defines), evaluated in the sandbox; and ``check``, the rest of
    the assert (literals, operators, comparisons, a few pure builtins) with ``__leaf_<k>`` in place
    of expression k, evaluated here on the reported values. The expected values stay here."""

    expressions: tuple[str, ...]
    check: str

    def passes(self, values: list[object]) -> bool:
        scope = {"__builtins__": {}, **{f"__leaf_{k}": v for k, v in enumerate(values)}, **_OUTSIDE_FUNCTIONS, "math": _Math}
        try:
            return bool(eval(self.check, scope))  # noqa: S307 - the check holds the tests' own operators on plain literals
        except Exception:  # e.g. 3 < "a", a wrong type for len
            return False


class _Math:
    """``math.<name>`` in a check: only the pure functions of :data:`_OUTSIDE_FUNCTIONS` and the constants of :data:`_MATH_CONSTANTS`."""

    isclose, sqrt, floor, ceil = math.isclose, math.sqrt, math.floor, math.ceil
    pi, e, tau, inf, nan = math.pi, math.e, math.tau, math.inf, math.nan


_MATH_CONSTANTS = ("pi", "e", "tau", "inf", "nan")  # math.<constant>: evaluated here, so a program cannot redefine an expected value


def _setup_names(statements: list[ast.stmt]) -> set[str]:
    """The names the tests' setup code binds: its functions, classes, imports and assigned names."""
    names = set()
    for node in (n for statement in statements for n in ast.walk(statement)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.alias):
            names.add((node.asname or node.name).split(".")[0])
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
    return names


def _untrusted_leaf(leaves: list[str], setup_names: set[str]) -> str | None:
    """The first leaf that is not a call of the program's own function (a name the setup code does not bind), else None.
    Everything a leaf computes runs in the sandbox, where the program could redefine it (``math.pi = 0``, an
    ``expected`` of the setup code, a comprehension, a helper of the setup code or a module's function): only the
    program's own answers may come from there, every expected value must be computed here."""
    for leaf in leaves:
        node = ast.parse(leaf, mode="eval").body
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id not in setup_names):
            return leaf
    return None


def _split(node: ast.expr, leaves: list[str]) -> ast.expr:
    """``node`` with every sub-expression that needs the program replaced by ``__leaf_<k>`` (its source appended to ``leaves``)."""
    if isinstance(node, ast.Name) and node.id in _OUTSIDE_FUNCTIONS:  # e.g. the int of isinstance(x, int)
        return node
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "math" and node.attr in _MATH_CONSTANTS:
        return node
    if isinstance(node, ast.Call):
        name = ast.unparse(node.func)
        if name in _OUTSIDE_FUNCTIONS:
            return ast.Call(node.func, [_split(arg, leaves) for arg in node.args], [ast.keyword(k.arg, _split(k.value, leaves)) for k in node.keywords])
    elif isinstance(node, _OUTSIDE_NODES) and not isinstance(node, ast.Starred):
        for field, value in ast.iter_fields(node):
            if isinstance(value, ast.expr):
                setattr(node, field, _split(value, leaves))
            elif isinstance(value, list):
                setattr(node, field, [_split(v, leaves) if isinstance(v, ast.expr) else v for v in value])
        return node
    leaves.append(ast.unparse(node))
    return ast.Name(f"__leaf_{len(leaves) - 1}", ast.Load())


def parse_tests(tests: str) -> tuple[str, list[TestCase]]:
    """(setup code, test cases) of a prompt's test code; see the module docstring.

    Raises:
        TestsError: when it is not Python, or has no top-level ``assert``.
    """
    try:
        module = ast.parse(tests)
    except SyntaxError as err:
        raise TestsError(f"tests are not valid Python ({err.msg}, line {err.lineno}): {tests[:200]!r}") from None
    setup, cases = [], []
    setup_names = _setup_names(module.body)  # once for every case
    for statement in module.body:
        if not isinstance(statement, ast.Assert):
            if any(isinstance(node, ast.Assert) for node in ast.walk(statement)):  # it would run in the program's process, unchecked
                raise TestsError(f"an assert inside a {type(statement).__name__.lower()} statement (line {statement.lineno}) runs with the program, "
                                 f"which could skip it: write each case as a top-level assert: {tests[:200]!r}")
            setup.append(ast.unparse(statement))
            continue
        parts = statement.test.values if isinstance(statement.test, ast.BoolOp) and isinstance(statement.test.op, ast.And) else [statement.test]
        for part in parts:  # `assert a and b` is two cases
            leaves: list[str] = []
            source = ast.unparse(part)
            split = ast.fix_missing_locations(_split(part, leaves))
            untrusted = _untrusted_leaf(leaves, setup_names)
            if untrusted is not None:
                raise TestsError(f"assert {source} (line {statement.lineno}): {untrusted} would be computed next to the program, which "
                                 f"could redefine it; a case may only call the program's functions, its expected values literals: {tests[:200]!r}")
            cases.append(TestCase(tuple(leaves), ast.unparse(split)))
    if not cases:
        raise TestsError(f"tests have no top-level assert statement, so nothing could be checked: {tests[:200]!r}")
    return "\n".join(setup) + "\n", cases


def score_report(report: bytes, cases: list[TestCase]) -> list[bool]:
    """Which cases passed, from the harness's report lines: exactly one line per case. Any line that is
    malformed, names no case, or repeats one, and any case without a line, fails the whole report."""
    results: dict[int, bool] = {}
    for line in report.decode(errors="replace").splitlines():
        index_text, _, rest = line.partition("\t")
        kind, _, payload = rest.partition("\t")
        try:
            index = int(index_text)
        except ValueError:
            return [False] * len(cases)
        if index in results or not 0 <= index < len(cases):
            return [False] * len(cases)
        results[index] = kind == "ok" and _passes(cases[index], payload)
    if len(results) != len(cases):
        return [False] * len(cases)
    return [results[i] for i in range(len(cases))]


def _settled(report: bytes, n_cases: int, stop: bool) -> bool:
    """Whether a report cut short still decides the score: every case has its line, or (``stop``,
    all or nothing) one case failed."""
    lines = [line.split("\t") for line in report.decode(errors="replace").splitlines()]
    done = {parts[0] for parts in lines if len(parts) >= 2}
    return len(done) >= n_cases or (stop and any(parts[1] != "ok" for parts in lines if len(parts) >= 2))


def _passes(case: TestCase, payload: str) -> bool:
    try:
        texts = ast.literal_eval(payload)  # the list of the values' reprs
        if not isinstance(texts, list) or not all(isinstance(text, str) for text in texts):
            return False
        values = [ast.literal_eval(text) for text in texts]
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):  # not a plain literal: an object the program made up
        return False
    return len(values) == len(case.expressions) and case.passes(values)


@dataclass(frozen=True)
class AssertTests:
    """The asserts (and mbpp) format: setup code and the top-level asserts split by :func:`parse_tests`."""

    setup: str
    cases: tuple[TestCase, ...]

    def run(self, job: Job) -> list[bool]:
        """Which cases passed. Raises WallTimeout when the run reached its wall-clock backstop."""
        expressions = [list(case.expressions) for case in self.cases]
        files = {"harness.py": _HARNESS, "program.py": job.program, "setup.py": self.setup,
                 "cases.py": repr((job.start_timeout_s, job.case_timeout_s, job.stop, expressions))}
        wall, cpu = run_limits(job, len(self.cases))
        result = job.sandbox.run(files, ["harness.py"], timeout_s=wall, cpu_s=cpu)
        passed = score_report(result.report, list(self.cases))
        if result.timed_out and not (any(passed) or _settled(result.report, len(self.cases), job.stop)):
            raise WallTimeout(f"the run reached its wall-clock backstop of {wall:g} s within its CPU limits")
        return passed


def code_tests(row: Mapping[str, object] | str, code_format: str = "auto") -> AssertTests | CheckTests | StdioTests | CallTests:
    """A row's tests (its columns, or a ``tests`` text) in ``code_format``, or in the format its
    columns name ("auto": ``test`` + ``entry_point`` humaneval, ``test_list`` mbpp, ``input_output`` /
    ``verification_info`` / ``public_tests`` or JSON ``tests`` stdio or call, ``tests`` asserts).

    Raises:
        TestsError: naming the missing column when the row has none the format needs, or when its tests cannot be checked.
    """
    row = {"tests": row} if isinstance(row, str) else row
    try:
        key = json.dumps({c: row[c] for c in CODE_COLUMNS if row.get(c) is not None}, sort_keys=True)
    except TypeError:  # not JSON data: parsed afresh each time
        return _code_tests(row, code_format)
    return _cached_code_tests(key, code_format)


@functools.lru_cache(maxsize=4096)
def _cached_code_tests(key: str, code_format: str):
    return _code_tests(json.loads(key), code_format)


def _code_tests(row: Mapping[str, object], code_format: str):
    if code_format not in CODE_FORMATS:
        raise ValueError(f"code_format {code_format!r} is none of {', '.join(CODE_FORMATS)}")
    fmt = _detect(row) if code_format == "auto" else code_format
    need = {"asserts": ("tests",), "mbpp": ("test_list",), "humaneval": ("test", "entry_point")}.get(fmt, ())
    missing = [column for column in need if row.get(column) is None]
    if missing:
        raise TestsError(f"{fmt} tests need the column{'s' if len(missing) > 1 else ''} {' and '.join(map(repr, missing))}"
                         + (f"; the row has {sorted(row)}" if row else ""))
    if fmt == "asserts":
        return AssertTests(*_frozen(parse_tests(str(row["tests"]))))
    if fmt == "mbpp":
        listed = row["test_list"]
        asserts = [str(line) for line in listed] if isinstance(listed, (list, tuple)) else [str(listed)]
        lines = [*(str(line) for line in row.get("test_imports") or ()), str(row.get("test_setup_code") or ""), *asserts]
        return AssertTests(*_frozen(parse_tests("\n".join(lines))))
    if fmt == "humaneval":
        return check_tests(str(row["test"]), str(row["entry_point"]))
    tests = io_tests(row)
    if fmt == "call" and not isinstance(tests, CallTests):
        raise TestsError("call tests need a function name (fn_name in input_output, a fn_name column, or functional test cases)")
    if fmt == "stdio" and isinstance(tests, CallTests):
        raise TestsError(f"the row's cases are calls of {tests.fn_name!r}, not stdin/stdout runs (code_format: call)")
    return tests


def _detect(row: Mapping[str, object]) -> str:
    if row.get("test") is not None or row.get("entry_point") is not None:
        return "humaneval"
    if row.get("test_list") is not None:
        return "mbpp"
    if any(row.get(column) is not None for column in IO_COLUMNS):
        return "io"
    tests = row.get("tests")
    if tests is None:
        raise TestsError(f"the row has no code tests: none of the columns tests, test + entry_point, test_list, {', '.join(IO_COLUMNS)}"
                         + (f" (it has {sorted(row)})" if row else ""))
    if isinstance(tests, (list, dict)) or (isinstance(tests, str) and tests.lstrip()[:1] in ("[", "{")):
        return "io"  # JSON test cases (DeepCoder, LiveCodeBench), not Python: stdio or call
    return "asserts"


def _frozen(parsed: tuple[str, list[TestCase]]) -> tuple[str, tuple[TestCase, ...]]:
    return parsed[0], tuple(parsed[1])


_GUARD_CHECKED: set[SandboxLimits] = set()


def check_process_guard(sandbox: Sandbox) -> None:
    """Raise :class:`SandboxUnavailable` unless a program in ``sandbox`` is stopped from starting a process
    (the per-case CPU limits count the program's own process only). Checked once per set of limits."""
    if sandbox.limits in _GUARD_CHECKED:
        return
    probe = FORBID_PROCESSES + "import os\nguarded = forbid_processes()\ntry:\n    os.fork() or os._exit(0)\n    guarded = False\nexcept OSError:\n    pass\n" \
        "os.write(3, b'guarded' if guarded else b'open')\n"
    result = sandbox.run({"main.py": probe}, ["main.py"])
    if result.report != b"guarded":
        raise SandboxUnavailable(
            f"cannot stop a program from starting processes here (a seccomp filter, {os.uname().machine}): its CPU time would escape the "
            f"per-case limits ({result.report.decode(errors='replace') or result.stderr[-200:].decode(errors='replace')})"
        )
    _GUARD_CHECKED.add(sandbox.limits)


class CodeExecutionReward:
    """1.0 when the completion's program passes every test of its row (``partial_credit``: the share
    of tests passed), scored as the module docstring describes. A row's tests are its own columns
    (passed as keywords, :data:`CODE_COLUMNS`), or the ``tests`` value of its prompt text: a ``tests``
    text, or a mapping of the row's columns.

    Time limits are CPU seconds (``timeout_s`` the program's start, ``case_timeout_s`` each case): a
    program over one fails that case, however fast the host. The wall clock is a backstop
    ``wall_factor`` times longer; a run that reaches it within its CPU limits (a host too slow or too
    busy, or a program waiting on something) is not scored from what it reported: it runs once
    more, and if that run reaches it too, the completion is counted in ``reward/code_execution/timed_out``
    and, by ``on_timeout``, left out of training ("skip": :data:`rlalign.lm.reward_calls.UNSCORED`, also
    counted in ``reward/code_execution/failed``) or scored 0 ("zero"). Retried runs are counted in ``reward/code_execution/retried``
    (:meth:`pop_stats`)."""

    name = "code_execution"

    def __init__(
        self, tests: Mapping[str, str | Mapping] | None = None, timeout_s: float = 5.0, memory_mb: int = 512, max_workers: int | None = None,
        partial_credit: bool = False, allow_weak_sandbox: bool = False, code_format: str = "auto", case_timeout_s: float = 4.0,
        wall_factor: float = 10.0, on_timeout: str = "skip",
    ):
        if on_timeout not in ("skip", "zero"):
            raise ValueError(f"on_timeout must be 'skip' or 'zero', got {on_timeout!r}")
        if wall_factor < 1:
            raise ValueError(f"wall_factor must be at least 1 (a backstop longer than the CPU limit), got {wall_factor}")
        self.tests = None if tests is None else dict(tests)
        for row in (self.tests or {}).values():
            if row is not None:
                code_tests(row, code_format)  # bad tests fail here, before training
        self.code_format, self.partial_credit = code_format, partial_credit
        self.timeout_s, self.case_timeout_s, self.wall_factor, self.on_timeout = timeout_s, case_timeout_s, wall_factor, on_timeout
        self.sandbox = Sandbox(SandboxLimits(timeout_s=timeout_s, memory_mb=memory_mb), allow_weak=allow_weak_sandbox)
        if self.sandbox.missing is None:
            check_process_guard(self.sandbox)
        self.max_workers = max_workers or 2 * len(os.sched_getaffinity(0))  # a run waits on its processes part of the time
        self._counts = {"retried": 0, "timed_out": 0}
        self._counts_lock = threading.Lock()

    def _one(self, prompt: str, completion: str, row: Mapping | str):
        job = Job(self.sandbox, extract_code(completion), prompt, self.case_timeout_s, self.timeout_s, stop=not self.partial_credit, wall_factor=self.wall_factor)
        tests = code_tests(row, self.code_format)
        for attempt in range(2):
            try:
                passed = tests.run(job)
                return sum(passed) / len(passed) if self.partial_credit else float(all(passed))
            except WallTimeout:
                self._count("retried" if attempt == 0 else "timed_out")
        return UNSCORED if self.on_timeout == "skip" else 0.0

    def _count(self, key: str) -> None:
        with self._counts_lock:
            self._counts[key] += 1

    def pop_stats(self) -> dict[str, int]:
        """Runs retried and completions timed out since the last call (the trainers log them as reward/<name>/<key>)."""
        with self._counts_lock:
            counts, self._counts = self._counts, {"retried": 0, "timed_out": 0}
        return counts

    def __call__(self, prompts: list[str], completions: list[str], **columns) -> list:
        rows = self._rows(prompts, columns)
        with ThreadPoolExecutor(min(self.max_workers, max(1, len(prompts)))) as pool:
            return list(pool.map(self._one, prompts, completions, rows))

    def _rows(self, prompts: list[str], columns: Mapping[str, list]) -> list[Mapping | str]:
        """Each row's code columns, from the rows' columns when passed, else by its prompt text."""
        present = [column for column in CODE_COLUMNS if column in columns]
        if present:
            return [{c: columns[c][i] for c in present if columns[c][i] is not None} for i in range(len(prompts))]
        if self.tests is None:
            raise KeyError(f"code_execution: no code-test column ({', '.join(CODE_COLUMNS[:5])}, ...) for these prompts")
        for prompt in prompts:
            if self.tests.get(prompt) is None:
                raise KeyError(f"code_execution: no 'tests' for prompt {prompt!r}" if prompt not in self.tests
                               else f"code_execution: prompt {prompt!r} has several tests; pass the rows' columns")
        return [self.tests[prompt] for prompt in prompts]


def code_execution(
    tests: Mapping[str, str | Mapping] | None = None, timeout_s: float = 5.0, memory_mb: int = 512, partial_credit: bool = False,
    allow_weak_sandbox: bool = False, code_format: str = "auto", case_timeout_s: float = 4.0, max_workers: int | None = None,
    wall_factor: float = 10.0, on_timeout: str = "skip",
) -> CodeExecutionReward:
    """The reward function of this module (see :class:`CodeExecutionReward`): ``timeout_s`` limits the
    program's start (its top-level code) in CPU seconds, ``case_timeout_s`` each case."""
    return CodeExecutionReward(tests, timeout_s, memory_mb, max_workers, partial_credit, allow_weak_sandbox, code_format, case_timeout_s, wall_factor, on_timeout)


def run_program(source: str, timeout_s: float = 5.0, memory_mb: int = 512, allow_weak_sandbox: bool = False):
    """Run ``source`` alone in the sandbox; returns its :class:`rlalign.lm.sandbox.SandboxResult`."""
    return Sandbox(SandboxLimits(timeout_s=timeout_s, memory_mb=memory_mb), allow_weak=allow_weak_sandbox).run({"main.py": source}, ["main.py"])
