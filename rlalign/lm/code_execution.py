"""A code-execution reward: run each completion's program against the prompt's tests, in a sandbox,
and score it from values checked outside the sandbox, never from an exit code.

    reward = code_execution({prompt: "assert add(2, 3) == 5"}, timeout_s=5, memory_mb=512)
    reward(prompts, completions)   # 1.0 where every test passes, else 0.0 (partial_credit: the share passed)

The program is the last fenced code block of the completion (```python ... ``` or ``` ... ```),
or the whole completion when it has none. It runs in :class:`rlalign.lm.sandbox.Sandbox` (its own
namespaces, a private filesystem, no network, limits on time, memory, processes and output).

How a score is made, so that a program cannot forge it. The prompt's tests are parsed here, outside
the sandbox: every top-level ``assert`` is one test case, every other statement is setup code. For
``assert <expr> <op> <literal>`` (``==``, ``!=``, ``<``, ``<=``, ``>``, ``>=``, ``in``, ``not in``,
``is``, ``is not``), ``assert <expr>`` and ``assert not <expr>``, only ``<expr>`` goes into the
sandbox; a harness runs the program, then the setup, then evaluates each ``<expr>`` and reports its
``repr`` on a pipe. Here each reported value is parsed back as a Python literal and compared with the
expected literal and operator, which never entered the sandbox. So:

- an early exit (``os._exit``, ``sys.exit``, a signal, an ``atexit`` handler) reports nothing: 0;
- a test that raises, an exception the program swallows, or a value that is not a plain literal (an
  object whose ``__eq__`` always answers True) fails that test;
- a program that writes reports itself must know the expected values, which it never sees, and one
  report per test is kept, the first; a report with missing, repeated or extra tests scores 0.

A test whose expected side is not a literal (``assert f(x) == g(x)``) has both sides evaluated in the
sandbox and compared here: a program that subverts the harness could forge that one. Write expected
values as literals to make a test unforgeable.
"""

from __future__ import annotations

import ast
import functools
import json
import operator
import os
import re
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from rlalign.errors import RLAlignError
from rlalign.lm.rewards import row_references
from rlalign.lm.sandbox import Sandbox, SandboxLimits

__all__ = ["extract_code", "TestCase", "parse_tests", "CodeExecutionReward", "code_execution", "run_program"]

_FENCE = re.compile(r"```[ \t]*(?:python|py)?[ \t]*\n(.*?)```", re.DOTALL)
_OPERATORS = {
    ast.Eq: operator.eq, ast.NotEq: operator.ne, ast.Lt: operator.lt, ast.LtE: operator.le, ast.Gt: operator.gt, ast.GtE: operator.ge,
    ast.In: lambda a, b: a in b, ast.NotIn: lambda a, b: a not in b, ast.Is: operator.is_, ast.IsNot: operator.is_not,
}

# Runs inside the sandbox: the program, the setup, then each case's expression(s); one report line
# per case on fd 3: "<index>\t<kind>\t<repr of the value(s)>". Written by rlalign, not the policy.
_HARNESS = """import json, os, sys
def _main():
    write = os.write
    cases = json.loads(open("cases.json").read())
    sources = [(name, open(name).read()) for name in ("program.py", "setup.py")]
    scope = {"__name__": "__main__", "__builtins__": __builtins__}
    for name, source in sources:
        try:
            exec(compile(source, name, "exec"), scope)
        except BaseException as err:
            write(3, ("-1\\terror\\t" + name + ": " + type(err).__name__ + "\\n").encode())
            return
    for index, expressions in enumerate(cases):
        try:
            values = [repr(eval(compile(expression, "test_%d" % index, "eval"), scope)) for expression in expressions]
            line = "%d\\tok\\t%s\\n" % (index, json.dumps(values))
        except BaseException as err:
            line = "%d\\terror\\t%s\\n" % (index, type(err).__name__)
        write(3, line.encode())
_main()
"""


class TestsError(RLAlignError, ValueError):
    """A prompt's tests that cannot be checked (no top-level assert, or not Python)."""


def extract_code(completion: str) -> str:
    """The last fenced code block of ``completion``, or the whole text when there is none."""
    blocks = _FENCE.findall(completion)
    return blocks[-1] if blocks else completion


@dataclass(frozen=True)
class TestCase:
    """One top-level assert: the expression(s) evaluated in the sandbox and how their values are checked here."""

    expressions: tuple[str, ...]  # 1 (checked against ``expected``), or 2 (compared with each other)
    check: str  # "truthy", "falsy", or an ast operator name (Eq, Lt, In, ...)
    expected: object = None  # the literal of ``<expr> <op> <literal>``

    def passes(self, values: list[object]) -> bool:
        if self.check == "truthy":
            return bool(values[0])
        if self.check == "falsy":
            return not values[0]
        compare = _OPERATORS[getattr(ast, self.check)]
        right = self.expected if len(self.expressions) == 1 else values[1]
        try:
            return bool(compare(values[0], right))
        except TypeError:  # e.g. 3 < "a"
            return False


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
    for statement in module.body:
        if not isinstance(statement, ast.Assert):
            setup.append(ast.unparse(statement))
            continue
        test = statement.test
        if isinstance(test, ast.Compare) and len(test.ops) == 1 and type(test.ops[0]) in _OPERATORS:
            name, right = type(test.ops[0]).__name__, test.comparators[0]
            try:
                cases.append(TestCase((ast.unparse(test.left),), name, ast.literal_eval(right)))
            except ValueError:  # not a literal: both sides are evaluated in the sandbox
                cases.append(TestCase((ast.unparse(test.left), ast.unparse(right)), name))
        elif isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
            cases.append(TestCase((ast.unparse(test.operand),), "falsy"))
        else:
            cases.append(TestCase((ast.unparse(test),), "truthy"))
    if not cases:
        raise TestsError(f"tests have no top-level assert statement, so nothing could be checked: {tests[:200]!r}")
    return "\n".join(setup) + "\n", cases


def score_report(report: bytes, cases: list[TestCase]) -> list[bool]:
    """Which cases passed, from the harness's report lines (the first line per case counts). Any line
    that is malformed, names no case, or repeats one, and any case without a line, fails the whole report."""
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


def _passes(case: TestCase, payload: str) -> bool:
    try:
        values = [ast.literal_eval(text) for text in json.loads(payload)]
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):  # not a plain literal: an object the program made up
        return False
    return len(values) == len(case.expressions) and case.passes(values)


class CodeExecutionReward:
    """1.0 when the completion's program passes every test of its row (``partial_credit``: the share
    of tests passed), scored as the module docstring describes. A row's tests are its ``tests``
    column (passed as a keyword, ``tests`` None), or the ``tests`` value of its prompt text."""

    name = "code_execution"

    def __init__(
        self, tests: Mapping[str, str] | None = None, timeout_s: float = 5.0, memory_mb: int = 512, max_workers: int | None = None,
        partial_credit: bool = False, allow_weak_sandbox: bool = False,
    ):
        self.tests = None if tests is None else dict(tests)
        for code in (self.tests or {}).values():
            if code is not None:
                _parsed(code)  # bad tests fail here, before training
        self.partial_credit = partial_credit
        self.sandbox = Sandbox(SandboxLimits(timeout_s=timeout_s, memory_mb=memory_mb), allow_weak=allow_weak_sandbox)
        self.max_workers = max_workers or max(1, os.cpu_count() or 1)

    def _one(self, completion: str, tests: str) -> float:
        setup, cases = _parsed(tests)
        files = {"harness.py": _HARNESS, "program.py": extract_code(completion), "setup.py": setup, "cases.json": json.dumps([list(c.expressions) for c in cases])}
        passed = score_report(self.sandbox.run(files, ["harness.py"]).report, cases)
        return sum(passed) / len(passed) if self.partial_credit else float(all(passed))

    def __call__(self, prompts: list[str], completions: list[str], **columns) -> list[float]:
        tests = row_references(self.tests, prompts, columns, "tests", "code_execution")
        with ThreadPoolExecutor(self.max_workers) as pool:
            return list(pool.map(self._one, completions, tests))


@functools.lru_cache(maxsize=4096)
def _parsed(tests: str) -> tuple[str, list[TestCase]]:
    return parse_tests(tests)


def code_execution(tests: Mapping[str, str] | None = None, timeout_s: float = 5.0, memory_mb: int = 512, partial_credit: bool = False, allow_weak_sandbox: bool = False) -> CodeExecutionReward:
    """The reward function of this module (see :class:`CodeExecutionReward`)."""
    return CodeExecutionReward(tests, timeout_s, memory_mb, partial_credit=partial_credit, allow_weak_sandbox=allow_weak_sandbox)


def run_program(source: str, timeout_s: float = 5.0, memory_mb: int = 512, allow_weak_sandbox: bool = False):
    """Run ``source`` alone in the sandbox; returns its :class:`rlalign.lm.sandbox.SandboxResult`."""
    return Sandbox(SandboxLimits(timeout_s=timeout_s, memory_mb=memory_mb), allow_weak=allow_weak_sandbox).run({"main.py": source}, ["main.py"])
