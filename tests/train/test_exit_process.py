"""How a rank whose process group is up ends (rlalign.train.distributed.exit_process): what the
interpreter's exit does that a program sees, then os._exit with the command's status, so Gloo's
worker threads never meet a finalizing interpreter (which aborts the process: SIGABRT, status -6)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import torch.multiprocessing as mp

from rlalign.train.distributed import exit_process


def _python(code: str, tmp_path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=tmp_path, capture_output=True, text=True, timeout=60)  # a hang fails


ONE_RANK_GROUP = """
    import atexit, pathlib, sys, threading, time
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method="file://" + str(pathlib.Path("store").resolve()), rank=0, world_size=1)
"""


def test_without_a_process_group_it_returns():
    assert exit_process(3) is None  # this pytest process has no group: it goes on


def test_it_runs_the_interpreters_exit_then_ends_with_the_status(tmp_path):
    done = _python(ONE_RANK_GROUP + """
    def late_thread():
        time.sleep(0.3)
        pathlib.Path("thread").write_text("joined")
    threading.Thread(target=late_thread).start()
    import concurrent.futures
    pool = concurrent.futures.ThreadPoolExecutor(1)  # an idle worker (inductor keeps such a pool): woken as the exit wakes it
    pool.submit(int).result()
    log = open("log", "a")  # never closed: its buffered line is written as finalization would
    log.write("a line")
    atexit.register(lambda: pathlib.Path("atexit").write_text("ran"))
    print("buffered line")  # a pipe: block-buffered, still in the buffer
    print("error line", file=sys.stderr)
    from rlalign.train.distributed import exit_process
    exit_process(3)
    print("after exit_process")
    """, tmp_path)
    assert done.returncode == 3, done.stderr
    assert (tmp_path / "thread").read_text() == "joined"  # the thread it started was joined first
    assert (tmp_path / "atexit").read_text() == "ran"
    assert (tmp_path / "log").read_text() == "a line"
    assert done.stdout == "buffered line\n"  # flushed, and nothing ran after it
    assert "error line" in done.stderr


def test_the_program_ends_there_and_a_call_returns(tmp_path):
    done = _python(ONE_RANK_GROUP + """
    from rlalign.cli import main
    print("called:", main(["--version"]))  # a call from Python returns its status
    sys.argv = ["rlalign", "--version"]
    main()  # the program: the rank ends in main
    print("returned")
    """, tmp_path)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[1] == "called: 0" and len(lines) == 3 and "returned" not in done.stdout  # the version, the call, the version


def test_an_error_in_the_program_prints_its_traceback_once_and_ends_with_status_1(tmp_path):
    done = _python(ONE_RANK_GROUP + """
    import rlalign.cli
    def broken(argv):
        raise RuntimeError("a bug")
    rlalign.cli._run = broken
    sys.argv = ["rlalign", "grpo"]
    rlalign.cli.main()
    """, tmp_path)
    assert done.returncode == 1
    assert done.stderr.count("Traceback") == 1 and "RuntimeError: a bug" in done.stderr


def _rank_with_collectives_in_flight(rank: int, store: str) -> None:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    tensors = [torch.randn(200_000) for _ in range(8)]
    works = [dist.all_reduce(t, async_op=True) for t in tensors]  # noqa: F841  left in flight, as a run's last ones can be
    exit_process(0)


def test_collectives_in_flight_at_the_end_do_not_abort(tmp_path):
    # the same ranks left to the interpreter's exit abort (status -6) in about two launches of three: measured 15 of 21
    for launch in range(3):
        context = mp.start_processes(_rank_with_collectives_in_flight, args=(str(tmp_path / f"store{launch}"),), nprocs=2, join=False, start_method="spawn")
        for process in context.processes:
            process.join(120)
        assert [process.exitcode for process in context.processes] == [0, 0], f"launch {launch}"
