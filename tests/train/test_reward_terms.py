"""Reward terms as users bring them, through the trainers: a Hugging Face reward model from the config
(scored as transformers scores it), plain Python functions, async functions, and the failure policy."""

from __future__ import annotations

import asyncio
import json
import re
import os
import threading

import pytest
import torch

from rlalign.config import load_config
from rlalign.lm.models import ModelLoadError
from rlalign.lm.reward_calls import CallPolicy, RewardFunctionError, score_terms
from rlalign.tasks.tiny_model import TinyModelSpec, build_tiny_checkpoint
from rlalign.train import grpo, ppo

from tests.lm.test_reward_model_scoring import bpe_tokenizer, save_gpt2_rm, transformers_scores

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return build_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), TinyModelSpec(hidden_size=64, num_layers=2, intermediate_size=128), seed=0)


def make_cfg(trainer, tiny_path, tmp_path, **overrides):
    base = {
        "model.path": str(tiny_path), "output_dir": str(tmp_path / "run"), "data.task": "arithmetic", "data.num_prompts": 16, "steps": 1,
        "prompts_per_step": 2, "sampling.max_new_tokens": 5, "progress": False, "overwrite": True, "plots": False, "num_samples_logged": 64, "sample_every": 1,
    }
    if trainer is grpo:
        base["group_size"] = 4
    base.update(overrides)
    return load_config(trainer.GRPOConfig if trainer is grpo else trainer.PPOConfig, None, base)


def samples(tmp_path) -> list[dict]:
    return [json.loads(line) for line in (tmp_path / "run" / "samples.jsonl").read_text().splitlines()]


def metrics(tmp_path) -> list[dict]:
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    return [row for row in rows if "reward/mean" in row]  # training steps, not evaluations


def test_a_hugging_face_reward_model_in_the_config_logs_what_transformers_scores(tiny_path, tmp_path, capsys):
    rm = save_gpt2_rm(tmp_path / "rm", bpe_tokenizer())  # its own tokenizer (BPE, pad == EOS), not the policy's
    grpo.train(make_cfg(grpo, tiny_path, tmp_path, rewards=[{"reward_model": str(rm)}]))
    rows = samples(tmp_path)
    assert len(rows) == 8
    expected = transformers_scores(rm, [r["prompt"] for r in rows], [r["completion"] for r in rows])
    assert [r["rm"] for r in rows] == pytest.approx(expected, abs=2e-5)
    said = capsys.readouterr().out
    assert said.count("reward rm:") == 1 and "as transformers and TRL score it (text, input_format: auto)" in said


def test_a_reward_model_saved_without_its_tokenizer_is_an_error_not_scored_with_the_policys(tiny_path, tmp_path):
    # TRL's AutoTokenizer.from_pretrained fails there; the policy's tokenizer would give the model other ids, silently
    rm = save_gpt2_rm(tmp_path / "rm", bpe_tokenizer())
    for name in os.listdir(rm):
        if "token" in name or name in ("vocab.json", "merges.txt"):
            os.remove(rm / name)
    with pytest.raises(ModelLoadError, match=rf"{re.escape(str(rm))} holds no tokenizer: save the one its model was trained with .*tokenizer.save_pretrained"):
        grpo.train(make_cfg(grpo, tiny_path, tmp_path, rewards=[{"reward_model": str(rm)}]))


@pytest.mark.parametrize("section", [{"data.task": "arithmetic"}, {"data.task": "multiplication", "tools": {"max_turns": 1}},
                                     {"data.task": "lookup", "environment": {"class": "rlalign.tasks.lookup:LookupEnvironment", "max_turns": 1}}],
                         ids=["plain", "tools", "environment"])
def test_every_evaluation_tells_the_rewards_the_runs_max_steps(tiny_path, tmp_path, section):
    # a curriculum reward divides by trainer_state.max_steps: the tools' and environments' evaluations told it 0, and every
    # evaluation told global_step one update short (the last one's 1 of 2 where TRL's is 2 of 2)
    seen = []

    def progress(completions, trainer_state, **kwargs):
        seen.append((trainer_state.global_step, trainer_state.max_steps))
        return [trainer_state.global_step / trainer_state.max_steps] * len(completions)

    cfg = make_cfg(grpo, tiny_path, tmp_path, **{"steps": 2, "eval.num_prompts": 2, "eval.max_new_tokens": 4, "sampling.max_new_tokens": 4, **section})
    grpo.train(cfg, reward_functions=[progress])
    # an evaluation before the first step, the two steps, an evaluation after the last: global_step counts the updates done, as TRL's
    assert seen == [(0, 2), (0, 2), (1, 2), (2, 2)]


def reward_len(completions, **kwargs):
    """TRL's quick-start reward, as its docs write it."""
    return [-abs(20 - len(completion)) for completion in completions]


@pytest.mark.parametrize("trainer", [grpo, ppo])
def test_a_plain_function_is_a_term_named_by_the_function(trainer, tiny_path, tmp_path):
    overrides = {"rewards": []} if trainer is grpo else {"rewards": [], "ppo_epochs": 1, "num_minibatches": 1}
    trainer.train(make_cfg(trainer, tiny_path, tmp_path, **overrides), reward_functions=[reward_len])
    rows = samples(tmp_path)
    assert [r["reward_len"] for r in rows] == [-abs(20 - len(r["completion"])) for r in rows]
    assert "reward/reward_len/mean" in metrics(tmp_path)[0]


async def slow_digits(prompts, completions, **kwargs):
    await asyncio.sleep(0.5)
    return [float(sum(ch.isdigit() for ch in c)) for c in completions]


def test_async_functions_wait_together_and_score_as_their_sync_twins():
    # each function answers only once the other has started: called one after the other, the first
    # would wait for the second until its 60 s backstop and raise
    started: set[str] = set()

    def together(name: str, other: str, score):
        async def fn(prompts, completions, **kwargs):
            started.add(name)
            for _ in range(6000):
                if other in started:
                    return [score(c) for c in completions]
                await asyncio.sleep(0.01)
            raise TimeoutError(f"{other} never started while {name} waited")

        return fn

    prompts, completions = ["a", "b", "c"], ["12x", "", "7"]
    digits_fn = together("digits", "len", lambda c: float(sum(ch.isdigit() for ch in c)))
    length_fn = together("len", "digits", lambda c: float(len(c)))
    digits, length = score_terms([CallPolicy("digits", digits_fn), CallPolicy("len", length_fn)], prompts, completions)
    assert digits.values.tolist() == [2.0, 0.0, 1.0] and length.values.tolist() == [3.0, 0.0, 1.0]


def test_an_async_function_trains_through_grpo(tiny_path, tmp_path):
    grpo.train(make_cfg(grpo, tiny_path, tmp_path, rewards=[]), reward_functions=[slow_digits])
    rows = samples(tmp_path)
    assert [r["slow_digits"] for r in rows] == [float(sum(ch.isdigit() for ch in r["completion"])) for r in rows]


def flaky(prompts, completions, **kwargs):
    if any("2" in p for p in prompts):  # a batch holding such a prompt raises; alone, the others score
        raise ConnectionError("judge unreachable")
    return [1.0] * len(prompts)


def test_a_failed_call_stops_the_run_by_default_naming_the_term_and_the_prompt(tiny_path, tmp_path):
    with pytest.raises(RewardFunctionError, match=r"flaky raised ConnectionError: judge unreachable \(prompt '[^']*2"):
        grpo.train(make_cfg(grpo, tiny_path, tmp_path, rewards=[]), reward_functions=[grpo.RewardTerm("flaky", 1.0, flaky)])


def test_skip_leaves_the_term_out_where_it_failed_and_counts_it(tiny_path, tmp_path):
    term = grpo.RewardTerm("flaky", 1.0, flaky, on_error="skip")
    grpo.train(make_cfg(grpo, tiny_path, tmp_path, rewards=[{"function": "arithmetic"}]), reward_functions=[term])
    rows = samples(tmp_path)
    failed = [r for r in rows if "2" in r["prompt"]]
    assert failed and len(failed) < len(rows)  # some rows of the batch failed, the others scored
    assert all(r["flaky"] is None and r["reward"] == pytest.approx(r["arithmetic"]) for r in failed)
    assert all(r["flaky"] == 1.0 and r["reward"] == pytest.approx(r["arithmetic"] + 1.0) for r in rows if r not in failed)
    assert metrics(tmp_path)[0]["reward/flaky/failed"] == len(failed)
    assert metrics(tmp_path)[0]["reward/flaky/mean"] == 1.0  # over the rows it scored (the failed ones have no value)


def test_bad_values_are_errors_or_skipped_rows_never_zeros():
    def half_bad(prompts, completions):
        return [float("nan"), 1.0, "high"]

    with pytest.raises(RewardFunctionError, match=r"half_bad returned nan .*prompt 'a'"):
        score_terms([CallPolicy("half_bad", half_bad)], ["a", "b", "c"], ["x", "y", "z"])
    (scores,) = score_terms([CallPolicy("half_bad", half_bad, on_error="skip")], ["a", "b", "c"], ["x", "y", "z"])
    assert scores.failed.tolist() == [True, False, True] and scores.values[1].item() == 1.0 and scores.values[[0, 2]].isnan().all()
    (short,) = score_terms([CallPolicy("short", lambda p, c: [1.0], on_error="skip")], ["a", "b"], ["x", "y"])
    assert short.failed.tolist() == [True, True]


def test_numbers_trl_takes_are_scores_bools_numpy_scalars_and_one_element_tensors():
    # TRL builds a float32 tensor of what a reward function returns: True is 1, np.float32(0.1) its float32 value;
    # a tensor of two elements, a string or an infinity is still an error
    import numpy as np

    def trl_style(prompts, completions):
        return [True, False, np.float32(0.1), np.int64(3), torch.tensor(2.5), np.bool_(True), None]

    (scores,) = score_terms([CallPolicy("trl_style", trl_style)], list("abcdefg"), list("tuvwxyz"))
    assert scores.values[:6].tolist() == pytest.approx([1.0, 0.0, 0.1, 3.0, 2.5, 1.0]) and scores.values[6].isnan()
    assert not scores.failed.any()
    for bad in (torch.tensor([1.0, 2.0]), np.float64("inf"), "1.0"):
        with pytest.raises(RewardFunctionError, match="expected a finite float"):
            score_terms([CallPolicy("bad", lambda p, c, bad=bad: [bad])], ["a"], ["x"])


def test_a_call_past_its_time_limit_is_an_error_or_a_skipped_batch():
    # both functions would answer after 600 s: a call that waited for them would return their scores
    # (and the test would take that long) instead of failing at its limit
    release = threading.Event()

    async def sleepy(prompts, completions):
        await asyncio.sleep(600)
        return [1.0] * len(prompts)

    def sleepy_sync(prompts, completions):
        release.wait(600)
        return [1.0] * len(prompts)

    try:
        for fn in (sleepy, sleepy_sync):
            with pytest.raises(RewardFunctionError, match=rf"{fn.__name__} took longer than its timeout_s=0.2 \(batch of 2, first prompt 'a'\)"):
                score_terms([CallPolicy(fn.__name__, fn, timeout_s=0.2)], ["a", "b"], ["x", "y"])
            (skipped,) = score_terms([CallPolicy(fn.__name__, fn, on_error="skip", timeout_s=0.2)], ["a", "b"], ["x", "y"])
            assert skipped.failed.tolist() == [True, True]
    finally:
        release.set()  # the synchronous calls' threads run on until their function returns


def word_count(completions, **kwargs):
    return [float(len(c.split())) for c in completions]


def test_a_reward_server_in_the_config_scores_as_the_function_does_locally(tiny_path, tmp_path):
    pytest.importorskip("uvicorn", reason="the reward server needs the explore extra (starlette, uvicorn)")
    from rlalign.serve_reward import create_app, running

    with running(create_app(word_count)) as url:
        grpo.train(make_cfg(grpo, tiny_path, tmp_path, rewards=[{"reward_url": f"{url}/score", "remote": {"batch_size": 3}}]))
    rows = samples(tmp_path)
    assert [r["remote"] for r in rows] == word_count([r["completion"] for r in rows])


def test_an_unreachable_reward_server_stops_the_run_naming_it(tiny_path, tmp_path):
    pytest.importorskip("uvicorn", reason="the reward server needs the explore extra (starlette, uvicorn)")
    from rlalign.serve_reward import create_app, running

    with running(create_app(word_count)) as url:
        pass  # the server is gone: nothing listens there any more
    cfg = make_cfg(grpo, tiny_path, tmp_path, rewards=[{"reward_url": f"{url}/score", "remote": {"max_retries": 1, "request_timeout_s": 2}}])
    with pytest.raises(RewardFunctionError, match=rf"{url}/score"):
        grpo.train(cfg)


def test_a_judge_in_the_config_is_asked_and_its_unparsable_answers_are_counted(tiny_path, tmp_path):
    # the judge is the tiny random model itself: its answers never hold a score, so every one fails to parse;
    # allowed (max_failure_fraction 1), each is left out of the sum and counted, never read as 0
    judge = {"model": str(tiny_path), "max_new_tokens": 4, "max_failure_fraction": 1.0}
    grpo.train(make_cfg(grpo, tiny_path, tmp_path, rewards=[{"function": "arithmetic"}, {"judge": judge}]))
    step = metrics(tmp_path)[0]
    assert step["reward/judge/parse_failed"] == 8 and step["reward/mean"] == pytest.approx(step["reward/arithmetic/mean"])
    with pytest.raises(RewardFunctionError, match="judge"):
        grpo.train(make_cfg(grpo, tiny_path, tmp_path, rewards=[{"judge": {**judge, "max_failure_fraction": 0.5}}]))


def test_a_completion_no_term_applies_to_has_no_reward_and_leaves_its_groups_baseline():
    # TRL's rule: every function returns None -> the reward is NaN, left out of the group's mean and std, advantage 0.
    # Group [None, 1, 0, 0]: mean 1/3, std (unbiased) of [1, 0, 0] 0.57735 -> [0, 1.1547, -0.5774, -0.5774]; scoring the
    # None row 0 gave [-0.5, 1.5, -0.5, -0.5]
    from rlalign.train.rollouts import NO_TERM_APPLIES, RewardTerm, ScoredRollout, reward_stats, sample_rows, score_rollout, trusted_rows

    def numeric(prompts, completions):
        return [None if not c.isdigit() else float(c == "4") for c in completions]

    completions = ["four", "4", "5", "7", "6", "6", "x", "5"]
    total, per_term, failed = score_rollout([RewardTerm("numeric", 1.0, numeric)], ["2+2="] * 4 + ["3+3="] * 4, completions)
    assert failed[NO_TERM_APPLIES].tolist() == [True, False, False, False, False, False, True, False] and not failed["numeric"].any()
    scored = ScoredRollout(["2+2="] * 4 + ["3+3="] * 4, completions, total, per_term, total, per_term, failed, {})
    advantages = grpo.ADVANTAGE_ESTIMATORS["group"](total, 4, valid=trusted_rows(scored))
    assert advantages.tolist() == pytest.approx([0.0, 1.154701, -0.577350, -0.577350, 0.0, 0.0, 0.0, 0.0], abs=1e-5)
    stats = reward_stats(total, per_term, failed)
    assert stats[f"reward/{NO_TERM_APPLIES}/failed"] == 2.0
    # the term's own figures are over the 6 rows it scored, as TRL logs nanmean and nanstd of rewards_per_func:
    # [1, 0, 0, 0, 0, 0]: mean 1/6, std sqrt((25/36 + 5/36) / 5) = 0.40825 (over all 8 rows with None as 0: 0.125)
    from trl.trainer.utils import nanstd

    assert stats["reward/numeric/mean"] == pytest.approx(1 / 6) and stats["reward/numeric/std"] == pytest.approx(0.408248, abs=1e-6)
    # and so is the total's (the two rows without one are not trained on; counted as 0 they made it 1/8 and 0.3536)
    assert stats["reward/mean"] == pytest.approx(1 / 6) and stats["reward/std"] == pytest.approx(0.408248, abs=1e-6)
    assert stats["reward/numeric/mean"] == pytest.approx(torch.nanmean(per_term["numeric"]).item())
    assert stats["reward/numeric/std"] == pytest.approx(nanstd(per_term["numeric"]).item())
    assert [row["numeric"] for row in sample_rows(0, scored, 3)] == [None, 1.0, 0.0]  # the samples table: None where not given
    _, _, none = score_rollout([], ["a"], ["b"])
    assert none == {}  # no terms (a source that only samples): nothing to leave out


def curriculum(completions, trainer_state, log_metric, log_extra, **kwargs):
    # a TRL reward: its weight grows with trainer_state.global_step / max_steps; it logs a metric and a table column
    progress = trainer_state.global_step / trainer_state.max_steps
    log_metric("curriculum/progress", progress)
    log_extra("length", [len(c) for c in completions])
    return [progress * len(c) for c in completions]


def test_a_trl_reward_reads_the_trainer_state_and_logs_a_metric_and_a_column(tiny_path, tmp_path):
    # TRL passes its TrainerState (global_step, max_steps, ...), log_metric (a mean per batch, logged under its name) and
    # log_extra (a column of the completions table); they were missing (AttributeError, TypeError)
    grpo.train(make_cfg(grpo, tiny_path, tmp_path, rewards=[], steps=2, **{"eval.enabled": False}), reward_functions=[curriculum])
    assert [row["curriculum/progress"] for row in metrics(tmp_path)] == [0.0, 0.5]
    rows = samples(tmp_path)
    assert rows and all(r["length"] == len(r["completion"]) and r["curriculum"] == pytest.approx(r["step"] / 2 * len(r["completion"])) for r in rows)


def test_reward_logs_average_over_draws_and_write_plain_values_and_an_environments_reward_scores_a_row():
    # log_metric: the mean of the values logged, over dynamic sampling's draws too (summed as a counter, it doubled);
    # log_extra: NumPy and tensor values as JSON writes them (np.float32 broke samples.jsonl and the async payload);
    # a row no reward function scored but an environment did is scored (it was left out of training)
    import numpy as np

    from rlalign.train import distributed
    from rlalign.train.rollouts import NO_TERM_APPLIES, RewardLog, ScoredRollout, add_score_term, concat_scored, scored_stats, trusted_rows

    log = RewardLog()
    log.log_extra("judge", [np.float32(0.25), torch.tensor(0.75), torch.tensor([1, 2]), object])
    assert log.columns["judge"][:3] == [0.25, 0.75, [1, 2]] and log.columns["judge"][3] == str(object)
    json.dumps(log.columns)

    def draw(value: float) -> ScoredRollout:
        scores = torch.zeros(2)
        return ScoredRollout(["p", "p"], ["a", "b"], scores, {}, scores, {}, {NO_TERM_APPLIES: torch.tensor([True, False])}, {}, {}, {"accuracy": [value]})

    assert scored_stats(concat_scored([draw(0.5), draw(0.5)]))["accuracy"] == 0.5
    with_env = add_score_term(draw(0.5), "environment", torch.tensor([1.0, 0.0]), distributed.World(), torch.tensor([True, False]))
    assert trusted_rows(with_env).tolist() == [True, True]
    assert trusted_rows(add_score_term(draw(0.5), "overlong", torch.tensor([1.0, 0.0]), distributed.World())).tolist() == [False, True]


def test_a_reward_model_given_as_a_reward_function_points_to_the_config_term():
    # TRL takes a model or its id among reward_funcs; here the model raised "You must specify exactly one of input_ids..."
    # when called with texts, and the id "must be a RewardTerm or a callable"
    from rlalign.config import ConfigError
    from rlalign.train.rollouts import as_reward_term

    from transformers import GPT2Config, GPT2ForSequenceClassification

    model = GPT2ForSequenceClassification(GPT2Config(n_layer=1, n_embd=8, n_head=2, vocab_size=10))
    for term in ("runs/rm/final", model, torch.compile(model)):  # compiled (or peft-wrapped): no longer a PreTrainedModel, still TRL's reward model
        with pytest.raises(ConfigError, match=r"is not a reward function here: give its directory as a term of the config, rewards: \[\{reward_model: PATH\}\]"):
            as_reward_term(term)

    class Scorer(torch.nn.Module):  # a callable module with TRL's signature is a reward function like any other
        def forward(self, completions, **kwargs):
            return [1.0] * len(completions)

    assert as_reward_term(Scorer()).name
