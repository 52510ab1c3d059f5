"""World.main_first across three gloo processes (two learners, one producer rank): rank 0's block runs
before the others', and when it raises, the others raise MainRankError at once instead of waiting
on a peer that is gone (the transport's "Connection closed by peer" traceback)."""

from __future__ import annotations

import json
import os
import socket

import pytest
import torch.multiprocessing as mp

from rlalign.train import distributed


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _outcome(world: distributed.World, learners_only: bool, fail: bool, marker: str) -> str:
    """What this rank's ``main_first`` block did: rank 0 writes ``marker`` (or raises), the others check it is there."""
    try:
        with world.main_first(learners_only=learners_only):
            if world.is_main:
                if fail:
                    raise ValueError("rank 0 cannot write")
                with open(marker, "w") as f:
                    f.write("written")
                return "wrote"
            return "after rank 0" if os.path.exists(marker) else "before rank 0"
    except distributed.MainRankError as err:
        return f"MainRankError: {err}"
    except ValueError as err:
        return f"ValueError: {err}"


def _rank(rank: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="3", RANK=str(rank), LOCAL_RANK=str(rank))
    world = distributed.init("cpu", producers=1, timeout_s=60)  # a regression fails here, not in 30 minutes
    record = {}
    for learners_only in (False, True):
        if learners_only and world.producer is not None:
            continue  # a producer takes no part in the learners' blocks
        for fail in (False, True):
            record[f"{learners_only}-{fail}"] = _outcome(world, learners_only, fail, f"{out}/marker-{learners_only}-{fail}")
    with open(f"{out}/rank{rank}.json", "w") as f:
        json.dump(record, f)
    distributed.exit_process(0)


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory):
    out = tmp_path_factory.mktemp("main_first")
    mp.spawn(_rank, args=(_free_port(), str(out)), nprocs=3, join=True)
    return [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(3)]


def test_rank_0_runs_its_block_first_then_every_other_process(outcomes):
    learner0, learner1, producer = outcomes
    assert learner0["False-False"] == learner0["True-False"] == "wrote"
    assert learner1["False-False"] == learner1["True-False"] == "after rank 0"
    assert producer["False-False"] == "after rank 0"


def test_when_rank_0_fails_the_others_stop_with_one_message_of_their_own(outcomes):
    learner0, learner1, producer = outcomes
    stopped = "MainRankError: stopped because learner rank 0 failed (its message is above)"
    assert learner0["False-True"] == learner0["True-True"] == "ValueError: rank 0 cannot write"
    assert learner1["False-True"] == learner1["True-True"] == stopped
    assert producer["False-True"] == stopped
    assert "True-True" not in producer  # the learners' blocks leave the producer out
