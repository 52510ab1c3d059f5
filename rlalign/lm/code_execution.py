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
assert (literals, arithmetic, comparisons, ``and`` / ``or`` / ``not``, and the pure builtins of
:data:`_OUTSIDE_FUNCTIONS` such as ``abs``, ``len``, ``sorted``, ``bin``, ``pow``, ``chr``, ``type``,
``math.isclose``) stays here; a call of any other builtin, or an assert that calls nothing of the
program's, is refused when the tests load. The checker of rlalign.lm.code_harness (the "asserts"
mode) has the program's process run the program, then the setup, then evaluate each case's
sub-expressions and answer with their ``repr``; the checker, another process, times each case in
the CPU seconds of the program's process (the program can neither switch that clock off nor stop
the checker) and reports; here each value is rebuilt (rlalign.lm.code_values: plain literals, and
numpy, collections and namedtuple values as their own types, so ``is``, ``type`` and ``str`` answer
as in Python) and the rest of the assert is evaluated on it. So:

- an early exit (``os._exit``, ``sys.exit``, a signal, an ``atexit`` handler) reports nothing: 0;
- a test that raises or passes its time limit, an exception the program swallows, or a value that is
  of a type not rebuilt here (an object whose ``__eq__`` always answers True) fails that test; patching
  ``math.isclose`` or ``builtins`` inside the sandbox changes nothing here;
- a program sees only the sub-expressions (``f(2)``), never the expected values or the operators
  applied to them, so it must produce the values a solution would; the report is the checker's,
  each line carrying a nonce the program never sees.

A test's weakness stays its own: ``assert is_prime(7)`` is passed by any function returning True.
"""

from __future__ import annotations

import ast
import builtins
import collections
import functools
import json
import math
import operator
import os
import re
import threading
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from rlalign.lm.code_formats import (
    FORBID_PROCESSES, IO_COLUMNS, REPORT_KB, CallTests, CheckTests, Job, Scores, StdioTests, TestsError, WallTimeout, check_tests, extract_code, io_tests,
    run_checker, scores,
)
from rlalign.lm.code_values import literal, unwire
from rlalign.lm.reward_calls import UNSCORED
from rlalign.lm.sandbox import Sandbox, SandboxLimits, SandboxUnavailable

__all__ = [
    "extract_code", "TestCase", "TestsError", "parse_tests", "AssertTests", "code_tests", "CODE_FORMATS", "CODE_COLUMNS",
    "CodeExecutionReward", "code_execution", "run_program",
]

CODE_FORMATS = ("auto", "asserts", "mbpp", "humaneval", "stdio", "call")
CODE_COLUMNS = ("tests", "test", "entry_point", "test_list", "test_setup_code", "test_imports", *IO_COLUMNS, "private_tests", "generated_tests", "fn_name")


# Functions the check outside the sandbox may call on reported values: pure, on the values rebuilt here. The
# builtins an expected value is written with (``bin(10)[2:]``, ``pow(2, 10)``, ``chr(98)``) are among
# them: evaluated here, the program cannot redefine them; a call of any other builtin is refused (_untrusted_leaf).
_OUTSIDE_FUNCTIONS = {
    "abs": abs, "round": round, "len": len, "min": min, "max": max, "sum": sum, "sorted": sorted, "set": set, "frozenset": frozenset,
    "list": list, "tuple": tuple, "dict": dict, "str": str, "int": int, "float": float, "bool": bool, "all": all, "any": any,
    "isinstance": isinstance, "range": range, "reversed": reversed, "zip": zip, "enumerate": enumerate, "math.isclose": math.isclose, "math.sqrt": math.sqrt, "math.floor": math.floor, "math.ceil": math.ceil,
    "bin": bin, "oct": oct, "hex": hex, "chr": chr, "ord": ord, "pow": pow, "divmod": divmod, "repr": repr, "format": format, "type": type,
    "map": map, "filter": filter, "complex": complex,
}
_BUILTIN_NAMES = frozenset(dir(builtins))
ASSERT_VALUES_BYTES = 1 << 20  # an assert's reported values at most (past it: output_cut); parsed as Python, ~0.2 GB a MiB (numbers in lists: json, none)
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
        scope = {"__builtins__": {}, **{f"__leaf_{k}": v for k, v in enumerate(values)}, **_OUTSIDE_FUNCTIONS, **_BOUNDED, "math": _Math}
        try:
            return bool(eval(_bounded_check(self.check), scope))  # noqa: S307 - the check holds the tests' own operators on plain literals
        except Exception:  # e.g. 3 < "a", a wrong type for len, a result past the bounds below
            return False


# The check runs here, in the trainer, on values the program chose: an operator that could make its result
# arbitrarily large from a small value (2 ** f(x), [0] * f(x), 1 << f(x), range(f(x)), f(x) % 7 or format(7, f(x))
# with a string f(x) whose field is a billion wide) is bounded, and a case whose check would pass the bound fails
# (a solution's values keep far inside it).
MAX_RESULT_BITS = 1 << 22  # an int of ~1.26 million digits
MAX_RESULT_ITEMS = 1 << 22  # elements of a sequence made by * or range, characters of a formatted field


class ResultTooLarge(ValueError):
    """A check's operator would make a result past :data:`MAX_RESULT_BITS` / :data:`MAX_RESULT_ITEMS`."""


def _bounded_pow(base, exponent, modulus=None):
    if modulus is None and isinstance(base, int) and isinstance(exponent, int) and abs(base) > 1 and exponent * base.bit_length() > MAX_RESULT_BITS:
        raise ResultTooLarge("a power past the bound")
    return pow(base, exponent) if modulus is None else pow(base, exponent, modulus)


def _bounded_mult(left, right):
    sequences = (str, bytes, list, tuple, collections.deque)
    for seq, n in ((left, right), (right, left)):
        if isinstance(seq, sequences) and len(seq) * _count(n) > MAX_RESULT_ITEMS:
            raise ResultTooLarge("a repeated sequence past the bound")
    if isinstance(left, int) and isinstance(right, int) and left.bit_length() + right.bit_length() > MAX_RESULT_BITS:
        raise ResultTooLarge("a product past the bound")
    return left * right


def _count(n) -> int:
    """``n`` as a sequence's repeat count (an int, a numpy integer: what has ``__index__``), else 0."""
    try:
        return operator.index(n)
    except TypeError:
        return 0


def _bounded_lshift(left, right):
    if isinstance(left, int) and isinstance(right, int) and left and left.bit_length() + right > MAX_RESULT_BITS:
        raise ResultTooLarge("a shift past the bound")
    return left << right


def _check_fields(spec) -> None:
    """Refuse a %-format or format() spec whose widths or precisions pass :data:`MAX_RESULT_ITEMS` (or come from the arguments: ``*``)."""
    text = spec.decode("latin-1") if isinstance(spec, bytes) else spec
    if isinstance(text, str) and ("*" in text or any(len(n) > 7 or int(n) > MAX_RESULT_ITEMS for n in re.findall(r"\d+", text))):
        raise ResultTooLarge("a formatted field past the bound")


def _bounded_mod(left, right):
    if isinstance(left, (str, bytes)):
        for spec in re.findall(r"%[^a-zA-Z%]*" if isinstance(left, str) else rb"%[^a-zA-Z%]*", left):
            _check_fields(spec)
    return left % right


def _bounded_format(value, spec=""):
    _check_fields(spec)
    return format(value, spec)


def _bounded_range(*args):
    if len(made := range(*args)) > MAX_RESULT_ITEMS:
        raise ResultTooLarge("a range past the bound")
    return made


_BOUNDED = {"pow": _bounded_pow, "range": _bounded_range, "format": _bounded_format, "__pow": _bounded_pow, "__mult": _bounded_mult,
            "__lshift": _bounded_lshift, "__mod": _bounded_mod}
_BOUNDED_OPERATORS = {ast.Pow: "__pow", ast.Mult: "__mult", ast.LShift: "__lshift", ast.Mod: "__mod"}


class _BoundOperators(ast.NodeTransformer):
    def visit_BinOp(self, node: ast.BinOp) -> ast.AST:
        self.generic_visit(node)
        name = _BOUNDED_OPERATORS.get(type(node.op))
        return node if name is None else ast.copy_location(ast.Call(ast.Name(name, ast.Load()), [node.left, node.right], []), node)


@functools.lru_cache(maxsize=4096)
def _bounded_check(check: str):
    """``check`` compiled with its ``**``, ``*`` and ``<<`` through the bounded functions above."""
    tree = ast.fix_missing_locations(_BoundOperators().visit(ast.parse(check, mode="eval")))
    return compile(tree, "check", "eval")


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
    """Why the first leaf that is not a call of the program's own function (a name neither the setup code
    binds nor a builtin) cannot be one, else None. Everything a leaf computes runs in the sandbox, where the
    program could redefine it (``math.pi = 0``, an ``expected`` of the setup code, a comprehension, a helper
    of the setup code, a module's function, a builtin such as ``hash`` it shadows): only the program's own
    answers may come from there, every expected value must be computed here."""
    for leaf in leaves:
        node = ast.parse(leaf, mode="eval").body
        name = node.func.id if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) else None
        if name in _BUILTIN_NAMES:
            return f"{leaf} calls the builtin {name}, which the program could redefine, and which is not evaluated outside the sandbox"
        if name is None or name in setup_names:
            return f"{leaf} would be computed next to the program, which could redefine it"
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
                raise TestsError(f"assert {source} (line {statement.lineno}): {untrusted}; a case may only call the program's functions, "
                                 f"its expected values literals or pure builtins: {tests[:200]!r}")
            if not leaves:  # e.g. `assert sum([1, 2]) == 3` for a program's own sum: the builtin would answer, whatever the program
                raise TestsError(f"assert {source} (line {statement.lineno}) calls none of the program's functions, so it checks nothing of "
                                 f"the program (a function named as one of {', '.join(sorted(_OUTSIDE_FUNCTIONS))} is evaluated as that builtin): {tests[:200]!r}")
            cases.append(TestCase(tuple(leaves), ast.unparse(split)))
    if not cases:
        raise TestsError(f"tests have no top-level assert statement, so nothing could be checked: {tests[:200]!r}")
    return "\n".join(setup) + "\n", cases


def _passes(case: TestCase, payload: str) -> bool:
    """Whether a case passes on its reported payload, the list of its expressions' values as text
    (rlalign.lm.code_values.wire), each rebuilt by :func:`rlalign.lm.code_values.unwire`."""
    try:
        texts = literal(payload)
        if not isinstance(texts, list) or len(texts) != len(case.expressions) or not all(isinstance(text, str) for text in texts):
            return False
        values = [unwire(text) for text in texts]
    except Exception:  # neither a plain literal nor a type rebuilt here (an object the program made up), or any text that is no value
        return False
    return case.passes(values)


@dataclass(frozen=True)
class AssertTests:
    """The asserts (and mbpp) format: setup code and the top-level asserts split by :func:`parse_tests`."""

    setup: str
    cases: tuple[TestCase, ...]

    def run(self, job: Job) -> Scores:
        """Which cases passed: the checker (rlalign.lm.code_harness) asks the program's process to evaluate
        each case's expressions, timing each in its CPU seconds from outside that process. Raises
        WallTimeout when the run reached its wall-clock backstop."""
        requests = [repr(("eval", list(case.expressions))) for case in self.cases]
        lines = run_checker(job, "asserts", len(requests), {"requests": requests, "max_lines": [ASSERT_VALUES_BYTES] * len(requests)}, {"setup.py": self.setup})
        return scores(job, lines, len(self.cases), lambda case, status, payload: status == "ok" and _passes(self.cases[case], payload))


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
    (:meth:`pop_stats`).

    Sizes. A case's output (stdout, or a returned value) may take 4 times its expected output plus
    1 MiB (at most 16 MiB; an assert's values 1 MiB); past that the case fails and the completion is
    counted in ``reward/code_execution/output_cut``. A completion scored with a case the checker never
    reported (its run ended early, out of memory) is counted in ``reward/code_execution/unreported``."""

    name = "code_execution"
    COUNTS = ("retried", "timed_out", "output_cut", "unreported")  # what pop_stats counts

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
        self.sandbox = Sandbox(SandboxLimits(timeout_s=timeout_s, memory_mb=memory_mb, max_report_kb=REPORT_KB), allow_weak=allow_weak_sandbox)
        if self.sandbox.missing is None:
            check_process_guard(self.sandbox)
        self.max_workers = max_workers or 2 * len(os.sched_getaffinity(0))  # a run waits on its processes part of the time
        self._counts = dict.fromkeys(self.COUNTS, 0)
        self._counts_lock = threading.Lock()

    def _one(self, prompt: str, completion: str, row: Mapping | str):
        job = Job(self.sandbox, extract_code(completion), prompt, self.case_timeout_s, self.timeout_s, stop=not self.partial_credit, wall_factor=self.wall_factor)
        tests = code_tests(row, self.code_format)
        for attempt in range(2):
            try:
                result = tests.run(job)
                for key, count in (("output_cut", result.cut), ("unreported", result.unreported)):
                    if count:
                        self._count(key)
                passed = result.passed
                return sum(passed) / len(passed) if self.partial_credit else float(all(passed))
            except WallTimeout:
                self._count("retried" if attempt == 0 else "timed_out")
        return UNSCORED if self.on_timeout == "skip" else 0.0

    def _count(self, key: str) -> None:
        with self._counts_lock:
            self._counts[key] += 1

    def pop_stats(self) -> dict[str, int]:
        """Since the last call (the trainers log them as reward/<name>/<key>): runs retried, and completions
        timed out, with a case over its output cap, or with a case left unreported."""
        with self._counts_lock:
            counts, self._counts = self._counts, dict.fromkeys(self.COUNTS, 0)
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
