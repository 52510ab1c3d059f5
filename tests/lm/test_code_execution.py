"""The code-execution reward: tests parsed outside the sandbox, scores from reported values checked
here, never from an exit code (rlalign.lm.code_execution). The attacks are in test_sandbox_attacks.py."""

import re

import pytest

from rlalign.lm import sandbox
from rlalign.lm.code_execution import (
    TestCase,
    TestsError,
    _passes,
    code_execution,
    extract_code,
    parse_tests,
)
from rlalign.lm.code_formats import Job, Scores, scores
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


def test_builtins_that_write_expected_values_are_evaluated_outside_and_any_other_builtin_is_refused_at_load():
    # evaluated next to the program, a builtin could be redefined by it (`def bin(n)`, `builtins.chr = ...`): the auditor's forgeries scored 1.0
    _, cases = parse_tests("assert to_binary(10) == bin(10)[2:]\nassert power(2, 10) == pow(2, 10)\nassert shift('a') == chr(98)\nassert type(f(2)) is list")
    assert [case.expressions for case in cases] == [("to_binary(10)",), ("power(2, 10)",), ("shift('a')",), ("f(2)",)]
    assert cases[0].passes(["1010"]) and not cases[0].passes(["X"]) and cases[3].passes([[2]]) and not cases[3].passes([(2,)])
    for refused, why in [("assert f(1) == hash('a')", "calls the builtin hash"), ("assert f(1) == eval('1')", "calls the builtin eval"),
                         ("assert sum([1, 2]) == 3", "calls none of the program's functions")]:  # a program's own sum would never be asked
        with pytest.raises(TestsError, match=f"line 1.*{re.escape(why)}"):
            parse_tests(refused)


def test_a_case_passes_on_its_reported_values_parsed_as_plain_literals():
    cases = parse_tests(ADD_TESTS)[1]
    assert _passes(cases[0], '["5"]') and _passes(cases[0], '["5.0"]')  # Python's 5.0 == 5, as the assert would
    assert not _passes(cases[0], '["6"]') and not _passes(cases[0], '["<__main__.E object at 0x1>"]')  # not a literal
    assert not _passes(cases[0], '"5"') and not _passes(cases[0], '["5", "5"]')  # not the list of one repr per expression


def test_a_report_decides_each_case_and_counts_the_cases_cut_or_never_reported():
    job, all_or_nothing = Job(None, "", "", 1.0, 1.0, stop=False), Job(None, "", "", 1.0, 1.0, stop=True)
    ok = lambda case, status, payload: status == "ok"  # noqa: E731
    assert scores(job, {0: ("ok", ""), 1: ("too_long", "stdout over 1 bytes")}, 2, ok) == Scores((True, False), cut=1)
    assert scores(job, {0: ("ok", "")}, 3, ok) == Scores((True, False, False), unreported=2)  # the checker ended early: counted
    assert scores(job, {0: ("ok", ""), -1: ("error", "NameError")}, 2, ok) == Scores((True, False))  # it said what ended the check
    assert scores(all_or_nothing, {0: ("error", "ValueError")}, 3, ok) == Scores((False, False, False))  # stopped at a failure


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


def test_a_check_evaluated_here_cannot_be_made_to_build_a_huge_result_from_the_programs_value():
    """The trainer evaluates each assert's check on values the program chose: 2 ** f(), [0] * f(), 1 << f() and
    range(f()) are bounded, so f() returning 10**50 fails the case at once instead of hanging or filling the trainer."""
    _, cases = parse_tests("assert 2 ** f() == 8\nassert pow(3, f()) == 27\nassert [0] * f() == [0, 0, 0]\nassert 1 << f() == 8\n"
                           "assert sum(range(f())) == 3\nassert f() * 'ab' == 'ababab'\nassert pow(2, f(), 7) == 1")
    assert all(case.passes([3]) for case in cases)  # a solution's small values: exact as ever
    huge = 10**50
    assert [case.passes([huge]) for case in cases] == [False] * 6 + [pow(2, huge, 7) == 1]  # modular pow stays cheap and exact
    _, [power] = parse_tests("assert f() ** 2 == 4")
    assert power.passes([2]) and power.passes([10**1000]) is False  # a large but bounded result is computed and compared
    _, cases = parse_tests("assert f() % 7 == '0000007'\nassert format(7, f()) == '0000007'\nassert b'%d' % f() == b'5'")
    assert [case.passes([v]) for case, v in zip(cases, ["%07d", "07d", 5])] == [True] * 3  # honest widths
    assert not cases[0].passes(["%01000000000d"]) and not cases[1].passes(["01000000000d"])  # a field a billion wide: fails at once
    assert not cases[0].passes(["%*d"]) and not cases[0].passes(["%.999999999f"])


def test_an_answer_with_more_values_than_the_assert_has_expressions_is_not_parsed():
    from rlalign.lm.code_execution import _passes

    _, [case] = parse_tests("assert f(2) == 4")
    assert _passes(case, repr(["4"])) and not _passes(case, repr(["4", "4"]))
    parsed = []
    with pytest.MonkeyPatch.context() as patch:  # the count is checked before any value is parsed
        patch.setattr("rlalign.lm.code_execution.unwire", lambda text: parsed.append(text) or 0)
        assert not _passes(case, repr(["0"] * 100_000)) and parsed == []
        assert not _passes(case, repr(["0"])) and parsed == ["0"]  # the patch is where values are parsed
