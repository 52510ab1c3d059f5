"""A TRL or rlalign environment that is bad input: one message naming the class, the method and the prompt
(an RLAlignError, so the command line prints it and exits 2), before the run starts where one instance can tell,
and a run stopped mid-way leaves its last checkpoint whole."""

from __future__ import annotations

import asyncio
import sys

import pytest

from rlalign.agents.env_calls import EnvironmentFailed
from rlalign.agents.environment import EnvRunner, load_object, new_runner
from rlalign.config import ConfigError
from rlalign.errors import RLAlignError
from rlalign.lm.reward_calls import RewardFunctionError
from rlalign.train.env_source import check_environment

CHAT = [{"role": "user", "content": "count"}]


class Good:
    def reset(self, **row):
        self.n = 0

    def add(self, step: int) -> int:
        """Add to the counter.

        Args:
            step: How much to add.
        """
        self.n += step
        return self.n

    def get_reward(self) -> float:
        return float(self.n)


class InitRaises(Good):
    def __init__(self):
        raise RuntimeError("db connection refused")


class ResetRaises(Good):
    def reset(self, **row):
        raise KeyError("answer")


class ResetNumber(Good):
    def reset(self, **row):
        return 42


class NoHints(Good):
    def search(self, q):
        """Search.

        Args:
            q: The query.
        """
        return q


class AsyncReset(Good):
    async def reset(self, **row):
        self.n = 0


class RewardRaises(Good):
    def get_reward(self):
        raise ZeroDivisionError("division by zero")


def run(coro):
    loop = asyncio.new_event_loop()
    try:
        return loop.run_until_complete(coro)
    finally:
        loop.close()


@pytest.mark.parametrize("env, words", [
    (InitRaises, ["InitRaises could not be made", "RuntimeError: db connection refused"]),
    (NoHints, ["NoHints", "'search'", "type hint"]),  # TRL's chat template cannot show it: found at start, not at the first chat prompt
    (AsyncReset, ["AsyncReset.reset is async"]),
    ("nosuch_module_xyz:Env", ["environment.class", "nosuch_module_xyz"]),
    ({"a": Good, "b": InitRaises}, ["InitRaises could not be made"]),  # each factory of a dict probed, as TRL's trainer does
    (None, ["environment.class"]),
])
def test_an_environment_one_instance_refuses_is_a_config_error_before_the_run(env, words):
    # they surfaced at the first step as a bare traceback (exit 1), after the model loaded and output_dir was made
    with pytest.raises(ConfigError) as err:
        check_environment(env)
    assert all(w in str(err.value) for w in words), str(err.value)
    check_environment(Good)  # a good one passes
    check_environment({"a": Good})


def test_environment_class_imports_from_the_current_directory(tmp_path, monkeypatch):
    # the `rlalign` script lacks the current directory on sys.path: environment.class=envs:Env from the directory of
    # envs.py failed with "No module named 'envs'" (reward functions' module:function did import)
    (tmp_path / "audit_cwd_envs.py").write_text("class Env:\n    def reset(self, **row):\n        return None\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    assert load_object("audit_cwd_envs:Env").__name__ == "Env"


@pytest.mark.parametrize("env, words", [
    (ResetRaises, ["ResetRaises.reset", "KeyError: 'answer'", "count"]),
    (ResetNumber, ["ResetNumber.reset", "returned 42", "count"]),  # was TypeError: can only concatenate str (not "int") to str
])
def test_reset_failing_names_the_class_and_the_prompt(env, words):
    with pytest.raises(EnvironmentFailed) as err:
        run(EnvRunner(env()).reset({"prompt": CHAT}))
    assert isinstance(err.value, RLAlignError) and all(w in str(err.value) for w in words), str(err.value)


def test_an_environment_that_cannot_be_made_mid_run_is_named():
    with pytest.raises(EnvironmentFailed, match="environment InitRaises failed: RuntimeError: db connection refused"):
        new_runner(InitRaises)


def test_get_reward_raising_names_the_method_and_the_prompt():
    runner = EnvRunner(RewardRaises())
    run(runner.reset({"prompt": CHAT}))
    with pytest.raises(RewardFunctionError, match=r"RewardRaises.get_reward raised ZeroDivisionError: division by zero \(prompt .*count"):
        run(runner.reward("done"))


def test_a_reset_failing_at_step_two_exits_2_and_leaves_step_one_resumable(tmp_path, monkeypatch, capsys):
    from rlalign.cli import main
    from rlalign.tasks.tiny_model import TinyModelSpec, build_tiny_checkpoint

    tiny = build_tiny_checkpoint(tmp_path / "tiny", TinyModelSpec(hidden_size=32, num_layers=1, intermediate_size=64), seed=0)
    (tmp_path / "audit_step_envs.py").write_text(
        "import os\n"
        "class Env:\n"
        "    calls = 0\n"
        "    def reset(self, **row):\n"
        "        Env.calls += 1\n"
        "        if Env.calls > 4 and not os.environ.get('AUDIT_FIXED'):\n"  # step 2's first reset (2 prompts x 2 episodes a step)
        "            raise KeyError('answer')\n"
        "    def get_reward(self) -> float:\n"
        "        return 1.0\n")
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "run"
    args = ["grpo", f"model.path={tiny}", f"output_dir={out}", "data.task=arithmetic", "rewards=[]", "steps=2", "prompts_per_step=2",
            "group_size=2", "sampling.max_new_tokens=8", "beta=0.0", "progress=false", "plots=false", "eval.enabled=false",
            "environment.max_turns=2", "environment.class=audit_step_envs:Env", "save_every=1"]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "Env.reset failed for prompt" in err and "KeyError: 'answer'" in err and "Traceback" not in err
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_00000001"]
    monkeypatch.setenv("AUDIT_FIXED", "1")
    assert main([*args, "--resume", str(out)]) == 0
    assert (out / "checkpoints" / "step_00000002").is_dir()
