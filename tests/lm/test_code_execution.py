"""The code-execution reward: tests parsed outside the sandbox, scores from reported values checked
here, never from an exit code (rlalign.lm.code_execution). The attacks are in test_sandbox_attacks.py."""

import re

import pytest

from rlalign.lm import sandbox
from rlalign.lm.code_execution import (
    TestCase,
    TestsError,
    code_execution,
    extract_code,
    parse_tests,
    score_report,
)
from rlalign.lm.sandbox import Sandbox, SandboxLimits, SandboxUnavailable

needs_isolation = pytest.mark.skipif(sandbox.isolation_available() is not None, reason=f"no sandbox here: {sandbox.isolation_available()}")

ADD_TESTS = "assert add(2, 3) == 5\nassert add(0, 0) == 0\nassert not add(1, -1)\nassert add(2, 2) in (4, 5)"


def test_extract_code_takes_the_last_fenced_block_or_the_whole_text():
    assert extract_code("x = 1") == "x = 1"
    text = "first\n```python\na = 1\n```\nthen\n```\nb = 2\n```\n"
    assert extract_code(text) == "b = 2\n"


def test_tests_split_into_setup_and_cases_with_the_expected_values_kept_outside():
    setup, cases = parse_tests("import math\nx = 3\nassert f(x) == 9\nassert g(x) != g(4)\nassert h()\nassert not k(1)")
    assert setup == "import math\nx = 3\n"
    assert cases == [TestCase(("f(x)",), "__leaf_0 == 9"), TestCase(("g(x)", "g(4)"), "__leaf_0 != __leaf_1"), TestCase(("h()",), "__leaf_0"),
                     TestCase(("k(1)",), "not __leaf_0")]
    assert "9" not in "".join(e for c in cases for e in c.expressions)  # the expected value never enters the sandbox
    _, cases = parse_tests("assert f(2) == 4 and 0 < g(1) < 3\nassert math.isclose(area(2), 12.566)\nassert sorted(f([3, 1]))[0] == 1")
    assert cases == [TestCase(("f(2)",), "__leaf_0 == 4"), TestCase(("g(1)",), "0 < __leaf_0 < 3"), TestCase(("area(2)",), "math.isclose(__leaf_0, 12.566)"),
                     TestCase(("f([3, 1])",), "sorted(__leaf_0)[0] == 1")]
    assert cases[2].passes([12.566]) and not cases[2].passes([12.0]) and not cases[0].passes(["4"])
    with pytest.raises(TestsError, match="no top-level assert"):
        parse_tests("x = 1")
    # a case computes next to the program only the program's own answers (calls of its functions); an expected value
    # computed there could be redefined by it (the auditor's forgeries scored wrong code 1.0), so is refused, and so is
    # an assert inside another statement, which ran with the program (it could skip it by patching compile)
    assert parse_tests("import math\nassert area(1) == math.pi")[1] == [TestCase(("area(1)",), "__leaf_0 == math.pi")]  # math's constants: here
    for forgeable, leaf in [("expected = 5\nassert add(2, 3) == expected", "expected"), ("assert double([1]) == [x * 2 for x in [1]]", "[x * 2 for x in [1]]"),
                            ("def ref(a):\n    return a\nassert f(1) == ref(1)", "ref(1)"), ("import numpy as np\nassert np.allclose(f(1), [1])", "np.allclose")]:
        with pytest.raises(TestsError, match=f"line .*: {re.escape(leaf)}.* would be computed next to the program"):
            parse_tests(forgeable)
    with pytest.raises(TestsError, match="an assert inside a for statement \\(line 2\\)"):
        parse_tests("assert add(2, 3) == 5\nfor a in [1, 10]:\n    assert add(a, a) == 2 * a")
    with pytest.raises(TestsError, match="not valid Python"):
        parse_tests("assert (")


def test_a_report_scores_only_when_it_has_one_line_for_every_case():
    cases = parse_tests(ADD_TESTS)[1]
    good = b'0\tok\t["5"]\n1\tok\t["0"]\n2\tok\t["0"]\n3\tok\t["4"]\n'
    assert score_report(good, cases) == [True] * 4
    assert score_report(good.replace(b'["5"]', b'["5.0"]'), cases) == [True] * 4  # Python's 5.0 == 5, as the assert would
    assert score_report(good.replace(b'["5"]', b'["6"]'), cases) == [False, True, True, True]
    assert score_report(good.replace(b'0\tok\t["5"]', b"0\terror\tValueError"), cases)[0] is False
    assert score_report(good.replace(b'["5"]', b'["<__main__.E object at 0x1>"]'), cases)[0] is False  # not a literal
    assert score_report(good + b'0\tok\t["5"]\n', cases) == [False] * 4  # a repeated case
    assert score_report(good.split(b"\n", 1)[1], cases) == [False] * 4  # a missing case
    assert score_report(b"-1\terror\tprogram.py: SystemExit\n" + good, cases) == [False] * 4
    assert score_report(b"", cases) == [False] * 4


@needs_isolation
def test_passing_failing_and_partial_programs():
    reward = code_execution({"add": ADD_TESTS})
    completions = ["def add(a, b):\n    return a + b", "```python\ndef add(a, b):\n    return a - b\n```", "def add(a, b) return"]
    assert reward(["add"] * 3, completions) == [1.0, 0.0, 0.0]
    partial = code_execution({"add": ADD_TESTS}, partial_credit=True)
    assert partial(["add"], ["def add(a, b):\n    return a * b"]) == [0.5]  # 2*3 != 5, 0*0 == 0, 1*-1 is truthy, 2*2 in (4, 5)


@needs_isolation
def test_unknown_prompt_is_an_error_naming_it():
    reward = code_execution({})
    with pytest.raises(KeyError, match="no 'tests' for prompt 'nope'"):
        reward(["nope"], ["pass"])


def test_without_isolation_the_sandbox_refuses_unless_the_weak_mode_is_asked_for(monkeypatch):
    monkeypatch.setattr(sandbox, "isolation_available", lambda: "bubblewrap (bwrap) is not installed")
    with pytest.raises(SandboxUnavailable, match="bubblewrap \\(bwrap\\) is not installed.*allow_weak_sandbox: true"):
        Sandbox()
    sandbox._warn_weak.cache_clear()
    with pytest.warns(RuntimeWarning, match="weak mode .*bubblewrap"):
        weak = Sandbox(SandboxLimits(timeout_s=5.0), allow_weak=True)
    assert weak.run({"main.py": "print(2 + 3)"}, ["main.py"]).stdout == b"5\n"


def test_a_sandbox_that_cannot_start_is_an_error_not_a_zero_score(monkeypatch):
    if sandbox.isolation_available() is not None:
        pytest.skip(f"no sandbox here: {sandbox.isolation_available()}")
    box = Sandbox(SandboxLimits(timeout_s=5.0), fork_server=False)
    monkeypatch.setattr(box, "_command", lambda *args: ["bwrap", "--no-such-option"])
    with pytest.raises(SandboxUnavailable, match="bubblewrap could not start the sandbox"):
        box.run({"main.py": "pass"}, ["main.py"])


@pytest.mark.parametrize("broken", ["server", "init", "program"])
def test_a_fork_server_that_cannot_start_a_run_is_an_error_not_a_zero_score(monkeypatch, broken):
    from rlalign.lm import sandbox_fork

    if sandbox.isolation_available() is not None or sandbox_fork.fork_server_available() is not None:
        pytest.skip("no fork server here")
    if broken == "server":  # bwrap cannot exec the server's Python
        monkeypatch.setattr(sandbox_fork, "_python", lambda: "/no/such/python")
    else:  # a mount of the run's init, or the program's limits, fail inside the server
        what = {"init": ('mount("tmpfs", "/proc"', 'mount("tmpfs", "/no/such/dir"'), "program": ('os.chdir("/sandbox")', 'os.chdir("/no/such/dir")')}[broken]
        monkeypatch.setattr(sandbox_fork, "_SERVER", sandbox_fork._SERVER.replace(*what))
    servers = sandbox_fork.ForkServers(SandboxLimits(timeout_s=5.0))
    with pytest.raises(SandboxUnavailable, match="sandbox server (is gone|could not start the run)"):
        servers.run({"main.py": "pass"}, ["main.py"])
    assert servers.idle == []  # a server that failed is not used again
