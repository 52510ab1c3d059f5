"""Code tests in the formats the datasets ship them in, beside the top-level asserts of
rlalign.lm.code_execution: HumanEval's check functions, stdin/stdout cases and function-call cases.

    tests = io_tests({"input_output": {"inputs": ["1 2\\n"], "outputs": ["3\\n"]}})   # -> StdioTests
    passed = tests.run(Job(sandbox, program, prompt, case_timeout_s=4, start_timeout_s=5, stop=True))

Each run is one sandbox (rlalign.lm.sandbox) holding two processes (rlalign.lm.code_harness): a
checker, written by rlalign, and a server that runs the program and answers the checker's requests.
The checker times each case in CPU seconds (a case over ``case_timeout_s`` fails; its server is
killed and restarted for the next one; a case that reaches the wall-clock backstop, ``wall_factor``
times that, raises :class:`WallTimeout` here) and reports one line per case, prefixed by a random nonce only it and
the trainer know. No exit code makes a score, and where the format allows it the expected values
never enter the sandbox:

- stdio (APPS / TACO / CodeContests / LiveCodeBench / open-r1 / DeepCoder): the checker sends each
  input, the server runs the program on it in a fresh child, and its stdout comes back here to be
  compared with the expected output (:func:`same_output`). A case passes when the program exits 0
  and its output matches.
- call (APPS / TACO with ``fn_name``, LiveCodeBench's functional tests): the server calls the
  function on each case's arguments; the value comes back as text and is rebuilt here
  (:func:`rlalign.lm.code_values.unwire`: plain literals, and numpy, collections and namedtuple
  values as their own types) and compared (:func:`same_value`).
- check (HumanEval: ``def check(candidate)`` with asserts, loops included, and an ``entry_point``):
  here the expected values are written inside ``check``, so ``check`` must run, and it runs in the
  checker, never in the program's process: the program's functions (``candidate``, and any other
  name of the test the prompt does not define) are proxies whose calls go to the server, and only
  the returned values, rebuilt as in the call format, come back. The test's source and the nonce reach
  the checker on its stdin, which it reads before the server starts, and the checker makes itself
  not dumpable, so the program (same user) can neither ptrace it, read its memory, nor open its
  descriptors. Each top-level statement of ``check`` holding an assert or a call of the program is
  one case (a loop of asserts is one case, passing when all its asserts do); ``assert True`` is not
  a case. Helpers the test calls that the prompt defines (HumanEval 32's ``poly``, 38's
  ``encode_cyclic``) are taken from the prompt's code, not from the program, when the prompt parses
  as Python; otherwise they are the program's.

What stays forgeable, by format: any program can return what a weak test accepts (``assert
is_prime(7)`` passes for a function returning True). In the check format a program can still see
the arguments it is called with (it must, to answer), and where the prompt is not Python a helper
the check calls comes from the program. Values cross as copies, of the types rlalign.lm.code_values
rebuilds: a function that mutates its argument in place, or returns an object of another type (a
generator, a class instance), fails a check that relies on it. The call format compares with ``==``
after tuples become lists (APPS, LiveCodeBench); JSON's string keys of dicts are not turned back into ints.
"""

from __future__ import annotations

import ast
import base64
import builtins
import functools
import inspect
import json
import marshal
import re
import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from pathlib import Path

from rlalign.errors import RLAlignError
from rlalign.lm.code_harness import _ARCH_SYSCALLS, _SET_OWNER, REPORT_SHORT, forbid_processes, seccomp_program
from rlalign.lm.code_values import literal, unwire
from rlalign.lm.sandbox import Sandbox
from rlalign.lm.sandbox_os import _STARTED

__all__ = ["Job", "Scores", "WallTimeout", "run_limits", "run_checker", "output_cap", "REPORT_KB", "FORBID_PROCESSES", "CheckTests", "StdioTests", "CallTests", "check_tests", "io_tests", "same_output", "same_value", "IO_COLUMNS", "extract_code"]

_FENCE = re.compile(r"```[ \t]*(?:python|py)?[ \t]*\n(.*?)```", re.DOTALL)


def extract_code(completion: str) -> str:
    """The last fenced code block of ``completion``, or the whole text when there is none."""
    blocks = _FENCE.findall(completion)
    return blocks[-1] if blocks else completion


def _sandbox_harness() -> str:
    """``harness.py`` as the sandbox runs it: rlalign.lm.code_values, then rlalign.lm.code_harness, in
    one set of globals. Both are compiled here, once, and cross as marshalled code: every run starts a
    fresh interpreter, where compiling them took about 4.5 ms of CPU a run (a short program's run now
    takes about 15 ms: ``benchmarks/sandbox_throughput.py``). The sandbox runs this interpreter (its ``sys.executable``),
    so the marshal format is the one it reads."""
    codes = tuple(compile(Path(__file__).with_name(name).read_text(), name, "exec") for name in ("code_values.py", "code_harness.py"))
    blob = base64.b64encode(marshal.dumps(codes)).decode()
    return f"import binascii, marshal\nfor _code in marshal.loads(binascii.a2b_base64({blob!r})):\n    exec(_code)\n"


HARNESS = _sandbox_harness()
# code_harness.forbid_processes as source, for a probe run alone (rlalign.lm.code_execution.check_process_guard)
FORBID_PROCESSES = (f"import os\n_ARCH_SYSCALLS = {_ARCH_SYSCALLS!r}\n_SET_OWNER = {_SET_OWNER!r}\n" + inspect.getsource(seccomp_program) + "\n"
                    + inspect.getsource(forbid_processes) + "\n")
REPORT_KB = 32 << 10  # the report cap (SandboxLimits.max_report_kb) of the code reward's sandbox: the checker keeps within it
OUTPUT_CEILING = 16 << 20  # the most bytes one case's stdout (or returned value) may take, however long its expected one
IO_COLUMNS = ("input_output", "verification_info", "public_tests")  # a row with one of these has stdio or call cases


class TestsError(RLAlignError, ValueError):
    """A row's tests that cannot be checked (a missing column, no case, not Python or not JSON)."""


class WallTimeout(RLAlignError, TimeoutError):
    """A run reached its wall-clock backstop within its CPU limits: the host, or a program waiting on
    something, took the time, so its cases were not all scored (rlalign.lm.code_execution retries it once)."""


@dataclass(frozen=True)
class Job:
    """What one run needs besides the tests: the sandbox, the program, the row's prompt, the limits."""

    sandbox: Sandbox
    program: str
    prompt: str
    case_timeout_s: float  # CPU seconds of one case
    start_timeout_s: float  # CPU seconds of the program's start (its top-level code)
    stop: bool  # stop at the first failed case (all-or-nothing scoring): the rest fail anyway
    wall_factor: float = 10.0  # the wall-clock backstop of a case (or a start), as a multiple of its CPU seconds


@dataclass(frozen=True)
class Scores:
    """One run's result: which cases passed; how many failed for an output (stdout, or a value's
    ``repr``) over its cap (``cut``: :func:`output_cap`); how many have no report line although
    nothing decided them (``unreported``: the checker ended early, e.g. the run out of memory).
    Both are counted by the reward (reward/code_execution/output_cut, .../unreported), never silent."""

    passed: tuple[bool, ...]
    cut: int = 0
    unreported: int = 0


def output_cap(expected: str | bytes) -> int:
    """The most bytes a case's output may take: 4 times its expected output plus 1 MiB (room for
    longer number formats, trailing spaces), at most :data:`OUTPUT_CEILING`; an output past it fails
    its case, counted in ``cut``."""
    size = len(expected.encode("utf-8", "replace") if isinstance(expected, str) else expected)
    return min(OUTPUT_CEILING, 4 * size + (1 << 20))


def run_limits(job: Job, n_cases: int) -> tuple[float, float]:
    """(wall seconds, CPU seconds per process) of one sandbox run of ``n_cases`` cases: CPU enough for
    the start (twice: the program and the setup, or a restarted server) and every case, plus a second
    for the interpreter; the wall ``wall_factor`` times that."""
    cpu = 2 * job.start_timeout_s + n_cases * job.case_timeout_s + 1.0
    return job.wall_factor * cpu, cpu


def run_checker(job: Job, mode: str, n_cases: int, fields: dict, files: dict[str, str] | None = None) -> dict[int, tuple[str, str]]:
    """One sandbox run of the checker (rlalign.lm.code_harness) in ``mode`` ("check", "call", "stdio",
    "asserts"), ``fields`` added to its job, ``files`` to the program's; {case: (status, payload)}
    from its nonce-prefixed report lines. The checker is told how much of the report's cap its long
    lines may take (room left for a short line per case), so no line is lost at the cap.

    Raises:
        WallTimeout: when a case, or the run, reached its wall-clock backstop with cases unscored.
    """
    nonce = secrets.token_hex(16)
    budget = job.sandbox.limits.max_report_kb * 1024 - len(_STARTED) - REPORT_SHORT * (n_cases + 4)
    request = {"mode": mode, "nonce": nonce, "stop": job.stop, "case_timeout": job.case_timeout_s, "start_timeout": job.start_timeout_s,
               "wall_factor": job.wall_factor, "report_budget": budget, **fields}
    wall, cpu = run_limits(job, n_cases)
    files = {"harness.py": HARNESS, "program.py": job.program, **(files or {})}
    result = job.sandbox.run(files, ["harness.py", "checker"], stdin=repr(request).encode(), timeout_s=wall, cpu_s=cpu)
    lines: dict[int, tuple[str, str]] = {}
    for line in result.report.decode("utf-8", "replace").split("\n"):
        parts = line.split("\t", 3)
        if len(parts) != 4 or parts[0] != nonce:
            continue  # not the checker's (it cannot be forged without the nonce)
        if parts[2] == "fatal":
            raise RLAlignError(f"the code checker cannot run here: {parts[3]}")
        if parts[2] == "wall":  # only the checker can say it (the nonce)
            raise WallTimeout(f"a case reached the wall-clock backstop of {job.wall_factor:g} x its {job.case_timeout_s:g} CPU seconds")
        try:
            case = int(parts[1])
        except ValueError:
            continue
        if -1 <= case < n_cases and case not in lines:
            lines[case] = (parts[2], parts[3])  # -1: what ended the check outside every case
    if result.timed_out and not _settled(job, lines, n_cases):
        raise WallTimeout(f"the run reached its wall-clock backstop of {wall:g} s with {n_cases - len(lines)} of {n_cases} cases unscored")
    return lines


def _settled(job: Job, lines: dict[int, tuple[str, str]], n_cases: int) -> bool:
    """Whether the report decides every case: each has its line, the checker said what ended it
    (case -1), or (all or nothing) a case failed."""
    return len(lines.keys() - {-1}) >= n_cases or -1 in lines or (job.stop and any(status not in ("ok", "pass") for status, _ in lines.values()))


def scores(job: Job, lines: dict[int, tuple[str, str]], n_cases: int, passes) -> Scores:
    """:class:`Scores` of a report's ``lines``, ``passes(case, status, payload)`` deciding each case that has one."""
    passed = tuple(case in lines and bool(passes(case, *lines[case])) for case in range(n_cases))
    cut = sum(status == "too_long" for case, (status, _) in lines.items() if case >= 0)
    unreported = 0 if _settled(job, lines, n_cases) else n_cases - len(lines.keys() - {-1})
    return Scores(passed, cut, unreported)


# ----------------------------------------------------------------------------------------------
# check functions (HumanEval)
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CheckTests:
    """HumanEval's ``test`` (a module defining ``check(candidate)``) and ``entry_point``: ``test`` is
    the module with each case statement of ``check`` wrapped to report itself; ``free`` the names the
    test reads without defining them (the program's, or the prompt's helpers)."""

    test: str
    entry_point: str
    free: tuple[str, ...]
    n_cases: int

    def run(self, job: Job) -> Scores:
        helpers, defined = prompt_helpers(job.prompt, self.entry_point)
        proxied = [self.entry_point, *(name for name in self.free if name not in defined and name != self.entry_point)]
        lines = run_checker(job, "check", self.n_cases, {"helpers": helpers, "test": self.test, "entry_point": self.entry_point, "proxied": proxied})
        return scores(job, lines, self.n_cases, lambda case, status, payload: status == "pass")


def check_tests(test: str, entry_point: str) -> CheckTests:
    """HumanEval's columns as :class:`CheckTests`.

    Raises:
        TestsError: when ``test`` is not Python, defines no ``check``, or ``check`` has no case.
    """
    if not str(entry_point).isidentifier():
        raise TestsError(f"entry_point {entry_point!r} is not a function name")
    try:
        module = ast.parse(test)
    except SyntaxError as err:
        raise TestsError(f"the test is not valid Python ({err.msg}, line {err.lineno}): {test[:200]!r}") from None
    checks = [s for s in module.body if isinstance(s, ast.FunctionDef) and s.name == "check" and s.args.args]
    if not checks:
        raise TestsError(f"the test defines no check(candidate) function: {test[:200]!r}")
    check = checks[-1]
    free = _free_names(module) - {check.args.args[0].arg}
    program_names = free | {check.args.args[0].arg, entry_point}
    body, n_cases = [], 0
    for statement in check.body:
        if _is_case(statement, program_names):
            statement = _reporting(statement, n_cases)
            n_cases += 1
        body.append(statement)
    if not n_cases:
        raise TestsError(f"check has no assert and no call of the program: {test[:200]!r}")
    check.body = body
    module.body = [s for s in module.body if not _calls_check(s)]  # check runs once, by the checker
    return CheckTests(ast.unparse(ast.fix_missing_locations(module)), str(entry_point), tuple(sorted(free)), n_cases)


def _reporting(statement: ast.stmt, case: int) -> ast.Try:
    """``try: <statement> except BaseException as e: __rlalign_case(case, e) else: __rlalign_case(case, None)``."""

    def report(error: ast.expr) -> ast.Expr:
        return ast.Expr(ast.Call(ast.Name("__rlalign_case", ast.Load()), [ast.Constant(case), error], []))

    handler = ast.ExceptHandler(ast.Name("BaseException", ast.Load()), "__rlalign_error", [report(ast.Name("__rlalign_error", ast.Load()))])
    return ast.Try([statement], [handler], [report(ast.Constant(None))], [])


def _free_names(module: ast.Module) -> set[str]:
    """Names the module reads and binds nowhere (scopes ignored), builtins excepted."""
    loaded, bound = set(), set()
    for node in ast.walk(module):
        if isinstance(node, ast.Name):
            (loaded if isinstance(node.ctx, ast.Load) else bound).add(node.id)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            bound.add(node.name)
        elif isinstance(node, ast.arg):
            bound.add(node.arg)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            bound.update((alias.asname or alias.name).split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ExceptHandler) and node.name:
            bound.add(node.name)
    return loaded - bound - set(dir(builtins))


def _is_case(statement: ast.stmt, program_names: set[str]) -> bool:
    """A statement of check that checks something: an assert of more than a constant, or a call of the program."""
    for node in ast.walk(statement):
        if isinstance(node, ast.Assert) and not isinstance(node.test, ast.Constant):
            return True
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in program_names:
            return True
    return False


def _calls_check(statement: ast.stmt) -> bool:
    return isinstance(statement, ast.Expr) and isinstance(statement.value, ast.Call) and isinstance(statement.value.func, ast.Name) and statement.value.func.id == "check"


@functools.lru_cache(maxsize=1024)
def prompt_helpers(prompt: str, entry_point: str) -> tuple[str, frozenset[str]]:
    """(source, names) of what the prompt's code defines besides ``entry_point`` (imports, functions,
    classes, assignments), when the prompt (or its last fenced code block) parses as Python; else ("", {})."""

    for text in (prompt, extract_code(prompt)):
        try:
            module = ast.parse(text)
        except (SyntaxError, ValueError):
            continue
        kept = [s for s in module.body if isinstance(s, (ast.Import, ast.ImportFrom, ast.FunctionDef, ast.ClassDef, ast.Assign))
                and getattr(s, "name", None) != entry_point]
        names = {n.id for s in kept if isinstance(s, ast.Assign) for t in s.targets for n in ast.walk(t) if isinstance(n, ast.Name)}
        names |= {s.name for s in kept if isinstance(s, (ast.FunctionDef, ast.ClassDef))}
        names |= {(a.asname or a.name).split(".")[0] for s in kept if isinstance(s, (ast.Import, ast.ImportFrom)) for a in s.names}
        return ast.unparse(ast.Module(kept, [])), frozenset(names)
    return "", frozenset()


# ----------------------------------------------------------------------------------------------
# stdin/stdout and function-call cases
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class StdioTests:
    """Inputs for the program's stdin and the outputs expected on its stdout (kept here)."""

    inputs: tuple[str, ...]
    outputs: tuple[str, ...]

    def run(self, job: Job) -> Scores:
        caps = [output_cap(expected) for expected in self.outputs]  # stdout bytes; its repr, escapes and all, at most 4 times that
        requests = [repr(("stdio", text, cap)) for text, cap in zip(self.inputs, caps)]
        lines = run_checker(job, "stdio", len(requests), {"requests": requests, "max_lines": [4 * cap + 64 for cap in caps]})
        return scores(job, lines, len(requests), lambda case, status, payload: status == "ok" and _stdio_passes(payload, self.outputs[case]))


def _stdio_passes(payload: str, expected: str) -> bool:
    code, _, stdout = payload.partition("\t")
    try:
        return code == "0" and same_output(literal(stdout), expected)
    except (ValueError, TypeError, SyntaxError, RecursionError, MemoryError):
        return False


@dataclass(frozen=True)
class CallTests:
    """Calls of the program's function ``fn_name`` on each case's arguments, and the values expected (kept here)."""

    fn_name: str
    args: tuple[tuple, ...]
    expected: tuple

    def run(self, job: Job) -> Scores:
        requests = [repr(("call", self.fn_name, tuple(args), {})) for args in self.args]
        max_lines = [output_cap(repr(expected)) for expected in self.expected]
        lines = run_checker(job, "call", len(requests), {"requests": requests, "max_lines": max_lines})
        return scores(job, lines, len(requests), lambda case, status, payload: status == "ok" and _call_passes(payload, self.expected[case]))


def _call_passes(payload: str, expected) -> bool:
    try:
        return bool(same_value(unwire(payload), expected))
    except Exception:  # not a value rebuilt here, or a comparison that raises (a numpy array's ambiguous truth value)
        return False


def same_output(output: str, expected: str) -> bool:
    """Whether a program's stdout matches the expected output, by LiveCodeBench's rule (its
    ``grade_stdio``): both stripped, split into lines, each line stripped; the same number of lines,
    and each pair equal, or with equal whitespace-separated tokens where every token is a number
    equal as a ``Decimal`` ("1.50" == "1.5"). Beyond LiveCodeBench, a number matches an expected
    token written as a float (a point or an exponent in the expected one) within APPS's tolerance
    (its ``np.allclose``: |a - b| <= 1e-8 + 1e-5 |b|), so "0.3333333" matches "0.333333333"; an
    expected integer is matched exactly, however the program writes its answer ("1e9" is not "1000000007")."""
    got, want = [line.strip() for line in output.strip().split("\n")], [line.strip() for line in expected.strip().split("\n")]
    return len(got) == len(want) and all(a == b or _same_tokens(a.split(), b.split()) for a, b in zip(got, want))


def _same_tokens(got: list[str], want: list[str]) -> bool:
    if len(got) != len(want):
        return False
    for a, b in zip(got, want):
        if a == b:
            continue
        try:
            x, y = Decimal(a), Decimal(b)
        except InvalidOperation:
            return False
        if x.is_nan() or y.is_nan():  # (tokens not equal as text); comparing a signalling NaN would raise
            return False
        if x == y:
            continue
        if not any(c in b for c in ".eE") or not (x.is_finite() and y.is_finite()):  # the expected token's form decides: an integer is exact
            return False
        if abs(float(x) - float(y)) > 1e-8 + 1e-5 * abs(float(y)):
            return False
    return True


def same_value(value, expected) -> bool:
    """Whether a returned value matches the expected one, as APPS and LiveCodeBench compare them:
    tuples read as lists (JSON has no tuples), then ``==``; APPS's one-element wrapping of the
    expected value (``"outputs": [[5]]`` for 5) is accepted too, but not its other leniencies."""
    value = _lists(value)
    return value == expected or (isinstance(expected, list) and len(expected) == 1 and value == expected[0])


def _lists(value):
    if isinstance(value, (tuple, list)):
        return [_lists(v) for v in value]
    if isinstance(value, dict):
        return {k: _lists(v) for k, v in value.items()}
    return value


def io_tests(row: Mapping[str, object], fn_name: str | None = None) -> StdioTests | CallTests:
    """The stdio or call cases of a row, from the first of its columns that holds them:

    - ``input_output``: ``{"inputs": [...], "outputs": [...], "fn_name"?}`` (APPS, TACO), a dict or JSON;
    - ``verification_info``: ``{"test_cases": ...}`` (open-r1), its cases in any form here;
    - ``public_tests`` (+ ``private_tests``, ``generated_tests``): ``{"input": [...], "output": [...]}`` (CodeContests);
    - ``tests`` as JSON: a list of ``{"input", "output", "testtype"?}`` (DeepCoder, LiveCodeBench's test
      cases; ``testtype: functional`` cases hold one JSON argument per input line, and the function
      name in ``metadata.func_name``), or any of the forms above.

    Inputs and outputs given as lists of lines are joined with newlines. A row's ``fn_name`` column
    (or ``fn_name``) makes the cases calls.

    Raises:
        TestsError: when the column is not JSON, or holds no cases, or cases of a shape not listed.
    """
    fn_name = fn_name or row.get("fn_name") or None
    column = next((c for c in (*IO_COLUMNS, "tests") if row.get(c) is not None), None)
    if column is None:
        raise TestsError(f"no stdin/stdout or call cases: the row has none of the columns {', '.join((*IO_COLUMNS, 'tests'))}")
    if column == "public_tests":
        cases = [case for c in ("public_tests", "private_tests", "generated_tests") if row.get(c) is not None for case in _cases(_json(row[c], c), c)[1]]
        found_fn = None
    else:
        found_fn, cases = _cases(_json(row[column], column), column)
    fn_name = fn_name or found_fn
    if not cases:
        raise TestsError(f"column {column!r} holds no test cases")
    if fn_name:
        args = []
        for case_input, _ in cases:
            if not isinstance(case_input, list):
                raise TestsError(f"column {column!r}: the arguments of a call of {fn_name!r} must be a list, got {case_input!r:.100}")
            args.append(tuple(case_input))
        return CallTests(str(fn_name), tuple(args), tuple(expected for _, expected in cases))
    return StdioTests(tuple(_text(i, column) for i, _ in cases), tuple(_text(o, column) for _, o in cases))


def _json(value, column: str):
    if isinstance(value, (str, bytes)):
        try:
            return json.loads(value)
        except ValueError as err:
            raise TestsError(f"column {column!r} is not JSON ({err}): {str(value)[:200]!r}") from None
    return value


def _cases(value, column: str) -> tuple[str | None, list[tuple[object, object]]]:
    """(fn_name or None, [(input, expected), ...]) of any of the forms :func:`io_tests` lists."""
    if isinstance(value, Mapping) and "test_cases" in value:
        fn_name, cases = _cases(_json(value["test_cases"], column), column)
        return value.get("fn_name") or fn_name, cases
    if isinstance(value, Mapping) and ("inputs" in value or "input" in value):
        inputs, outputs = value.get("inputs", value.get("input")), value.get("outputs", value.get("output"))
        if not isinstance(inputs, Sequence) or not isinstance(outputs, Sequence) or len(inputs) != len(outputs):
            raise TestsError(f"column {column!r}: inputs and outputs must be two lists of the same length")
        return value.get("fn_name") or None, list(zip(inputs, outputs))
    if isinstance(value, list) and all(isinstance(c, Mapping) and "input" in c and "output" in c for c in value):
        fn_name, cases = None, []
        for case in value:
            if case.get("testtype") == "functional":  # LiveCodeBench: one JSON value per line
                fn_name = fn_name or (case.get("metadata") or {}).get("func_name") or case.get("fn_name")
                try:
                    cases.append(([json.loads(line) for line in str(case["input"]).split("\n")], json.loads(case["output"])))
                except ValueError as err:
                    raise TestsError(f"column {column!r}: a functional case is not JSON ({err})") from None
            else:
                cases.append((case["input"], case["output"]))
        return fn_name, cases
    raise TestsError(f"column {column!r} holds no cases of a known shape: {str(value)[:200]!r}")


def _text(value, column: str) -> str:
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return "\n".join(value)
    if not isinstance(value, str):
        raise TestsError(f"column {column!r}: a stdin/stdout case must be text, got {value!r:.100}")
    return value
