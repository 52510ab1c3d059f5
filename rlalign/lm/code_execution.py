"""A code-execution reward: run each completion's program against the prompt's tests, in a sandbox,
and score it from values checked outside the sandbox, never from an exit code.

    reward = code_execution({prompt: "assert add(2, 3) == 5"}, timeout_s=5, memory_mb=512)
    reward(prompts, completions)   # 1.0 where every test passes, else 0.0 (partial_credit: the share passed)

The program is the last fenced code block of the completion (```python ... ``` or ``` ... ```),
or the whole completion when it has none. It runs in :class:`rlalign.lm.sandbox.Sandbox` (its own
namespaces, a private filesystem, no network, limits on time, memory, processes and output).

How a score is made, so that a program cannot forge it. The prompt's tests are parsed here, outside
the sandbox: every top-level ``assert`` is a test case (``assert a and b``: two), every other
statement is setup code. Each case is split in two. The sub-expressions that need the program (calls
of its functions, names it defines: ``f(2)``, ``area(r)``) go into the sandbox; the rest of the
assert (literals, arithmetic, comparisons, ``and`` / ``or`` / ``not``, and a few pure builtins such
as ``abs``, ``len``, ``sorted``, ``math.isclose``) stays here. A harness runs the program, then the
setup, then each sub-expression, and reports its ``repr`` on a pipe; here each value is parsed back
as a Python literal and the rest of the assert is evaluated on it. So:

- an early exit (``os._exit``, ``sys.exit``, a signal, an ``atexit`` handler) reports nothing: 0;
- a test that raises, an exception the program swallows, or a value that is not a plain literal (an
  object whose ``__eq__`` always answers True) fails that test; patching ``math.isclose`` or
  ``builtins`` inside the sandbox changes nothing here;
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
import re
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from rlalign.errors import RLAlignError
from rlalign.lm.rewards import row_references
from rlalign.lm.sandbox import Sandbox, SandboxLimits

__all__ = ["extract_code", "TestCase", "parse_tests", "CodeExecutionReward", "code_execution", "run_program"]

_FENCE = re.compile(r"```[ \t]*(?:python|py)?[ \t]*\n(.*?)```", re.DOTALL)

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
    """``math.<name>`` in a check: only the pure functions of :data:`_OUTSIDE_FUNCTIONS`."""

    isclose, sqrt, floor, ceil = math.isclose, math.sqrt, math.floor, math.ceil


def _split(node: ast.expr, leaves: list[str]) -> ast.expr:
    """``node`` with every sub-expression that needs the program replaced by ``__leaf_<k>`` (its source appended to ``leaves``)."""
    if isinstance(node, ast.Name) and node.id in _OUTSIDE_FUNCTIONS:  # e.g. the int of isinstance(x, int)
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
    for statement in module.body:
        if not isinstance(statement, ast.Assert):
            setup.append(ast.unparse(statement))
            continue
        parts = statement.test.values if isinstance(statement.test, ast.BoolOp) and isinstance(statement.test.op, ast.And) else [statement.test]
        for part in parts:  # `assert a and b` is two cases
            leaves: list[str] = []
            check = ast.unparse(ast.fix_missing_locations(_split(part, leaves)))
            cases.append(TestCase(tuple(leaves), check))
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
