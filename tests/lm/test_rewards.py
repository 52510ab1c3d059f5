"""Reward functions: rule-based scores, reward-model wrapper, errors that name the function and prompt."""

from __future__ import annotations

import pytest
import torch

from rlalign.lm.heads import load_reward_model
from rlalign.lm.rewards import RewardFunctionError, RewardModelReward, exact_match, format_check, math_answer, score_completions


def test_rule_based_rewards():
    refs = {"1+1=": "2", "half?": "0.5"}
    assert exact_match(refs)(["1+1=", "1+1="], [" 2 ", "3"]) == [1.0, 0.0]
    assert math_answer(refs)(["half?", "half?", "half?"], ["$\\frac{1}{2}$", "\\boxed{0.5}", "$0.6$"]) == [1.0, 1.0, 0.0]
    assert format_check(r"-?\d+")(["p", "p", "p"], ["12", "-3", "1 2"]) == [1.0, 1.0, 0.0]


def test_math_answer_skips_an_unparsable_answer_and_scores_off_the_main_thread_too():
    import threading

    from rlalign.lm.reward_calls import CallPolicy, score_terms

    fn = math_answer()
    # "(1,2)" and "hello" do not parse: no score (TRL's accuracy_reward gives None), not a 0 that trains
    assert fn(["q"] * 3, ["$(1, 2)$", "hello", "$4$"], answer=["(1,2)", "hello", "4"]) == [None, None, 1.0]
    # a bare number counts (math-verify's defaults; TRL's accuracy_reward would give 0: README, Rewards)
    assert fn(["q"] * 2, ["The answer is 4", "1,000"], answer=["4", "1000"]) == [1.0, 1.0]
    # off the main thread math-verify's signal.alarm limits raised ValueError on every call: with a term's
    # timeout_s (a worker thread) and on_error: skip every completion left training as failed
    (term,) = score_terms([CallPolicy("math_answer", fn, "skip", timeout_s=30.0)], ["q", "q"], ["\\boxed{4}", "\\boxed{5}"], {"answer": ["4", "4"]})
    assert term.values.tolist() == [1.0, 0.0] and term.failed.tolist() == [False, False]
    out = []
    worker = threading.Thread(target=lambda: out.append(fn(["q"], ["\\boxed{\\frac{1}{2}}"], answer=["0.5"])))
    worker.start()
    worker.join()
    assert out == [[1.0]]


def test_score_completions_weights_and_sums():
    # 1.0 * [1, 0] + 0.5 * [1, 1] = [1.5, 0.5]
    scores = score_completions([exact_match({"q": "a"}), format_check("[a-z]")], ["q", "q"], ["a", "b"], weights=[1.0, 0.5])
    assert scores.tolist() == [1.5, 0.5] and scores.dtype == torch.float32


def test_raising_reward_function_names_itself_and_the_prompt():
    def picky(prompts, completions):
        for p in prompts:
            if p == "bad prompt":
                raise ZeroDivisionError("boom")
        return [1.0] * len(prompts)

    with pytest.raises(RewardFunctionError, match=r"reward function .*picky raised ZeroDivisionError: boom \(prompt 'bad prompt'\)"):
        score_completions([picky], ["fine", "bad prompt", "also fine"], ["x", "y", "z"])
    with pytest.raises(RewardFunctionError, match=r"exact_match_reward raised KeyError.*'unknown'"):
        score_completions([exact_match({"q": "a"})], ["q", "unknown"], ["a", "b"])


def test_nan_or_wrong_length_is_an_error_naming_the_prompt():
    def nan_on_second(prompts, completions):
        return [0.0, float("nan")][: len(prompts)]

    with pytest.raises(RewardFunctionError, match=r"nan_on_second returned nan \(expected a finite float\) for prompt 'two'"):
        score_completions([nan_on_second], ["one", "two"], ["a", "b"])
    with pytest.raises(RewardFunctionError, match="returned 1 scores for 2 completions"):
        score_completions([lambda p, c: [1.0]], ["one", "two"], ["a", "b"])


def test_reward_model_as_reward_function_in_rlalign_training_format(llama_checkpoint, tokenizer):
    rm = load_reward_model(llama_checkpoint, trainable=True).eval()  # a fresh head: the test is the reading, not the score
    fn = RewardModelReward(rm, tokenizer, input_format="eos", batch_size=2)
    prompts, completions = ["ab", "c", "de"], ["x", "yy", ""]
    scores = fn(prompts, completions)
    for p, c, s in zip(prompts, completions, scores):
        ids = torch.tensor([tokenizer(p + c)["input_ids"] + [tokenizer.eos_token_id]])  # <bos> prompt completion <eos>
        expected = rm.sequence_scores(ids, torch.ones_like(ids))
        assert s == pytest.approx(expected.item(), abs=1e-5)
    assert fn.name.startswith("RewardModelReward(")
    grad_enabled = []  # scoring builds no graph: the trainable model's forward runs with gradients off
    rm.register_forward_pre_hook(lambda module, args: grad_enabled.append(torch.is_grad_enabled()))
    fn(prompts, completions)
    assert grad_enabled and not any(grad_enabled)


def test_an_eos_reward_model_reads_up_to_its_positions_and_counts_the_rows_it_cuts(llama_checkpoint, tokenizer):
    # a fixed 1024 cut a longer prompt's start away silently, whatever the model's context
    rm = load_reward_model(llama_checkpoint, trainable=True).eval()
    assert RewardModelReward(rm, tokenizer, input_format="eos").max_length == rm.config.max_position_embeddings
    fn = RewardModelReward(rm, tokenizer, input_format="eos", max_length=4)
    prompts, completions = ["abcdef", "a"], ["xy", "b"]  # <bos> abcdef xy <eos>: 10 tokens; <bos> a b <eos>: 4
    scores = fn(prompts, completions)
    last4 = torch.tensor([(tokenizer("abcdefxy")["input_ids"] + [tokenizer.eos_token_id])[-4:]])  # its last 4 tokens, as rlalign rm trains
    assert scores[0] == pytest.approx(rm.sequence_scores(last4, torch.ones_like(last4)).item(), abs=1e-5)
    assert fn.pop_stats() == {"cut": 1.0} and fn.pop_stats() == {"cut": 0.0}  # logged as reward/<name>/cut


# Three reward functions written from TRL's documented signature (GRPOTrainer's reward_funcs), unchanged.
def reward_len(completions, **kwargs):
    return [-abs(5 - len(completion)) for completion in completions]


def accuracy_reward(completions, answer, **kwargs):
    return [1.0 if completion.strip() == str(a) else 0.0 for completion, a in zip(completions, answer)]


def format_reward(prompts, completions, **kwargs):
    """Scores only completions of prompts that ask for a number; None elsewhere (TRL: does not apply)."""
    return [float(c.strip().isdigit()) if "number" in p else None for p, c in zip(prompts, completions)]


def test_reward_functions_written_for_trl_run_unchanged_with_the_rows_columns():
    prompts, completions = ["a number?", "a number?", "a word?"], ["42", "forty", "hello"]
    columns = {"answer": ["42", "40", "hi"], "level": [1, 2, 3]}
    assert score_completions([reward_len], prompts, completions, columns=columns).tolist() == [-3.0, 0.0, 0.0]
    assert score_completions([accuracy_reward], prompts, completions, columns=columns).tolist() == [1.0, 0.0, 0.0]
    # None: the term leaves that completion's sum, the others still count
    total = score_completions([format_reward, reward_len], prompts, completions, weights=[2.0, 1.0], columns=columns)
    assert total.tolist() == [2.0 - 3.0, 0.0 + 0.0, 0.0 + 0.0]
    # a function naming only some columns gets only those; positional old-style functions still work
    assert score_completions([lambda completions, level: [float(x) for x in level]], prompts, completions, columns=columns).tolist() == [1.0, 2.0, 3.0]
    assert score_completions([lambda p, c: [float(len(c_)) for c_ in c]], prompts, completions, columns=columns).tolist() == [2.0, 5.0, 5.0]
    with pytest.raises(RewardFunctionError, match="raised TypeError.*answer"):
        score_completions([accuracy_reward], prompts, completions)  # no answer column given


def test_a_column_named_like_an_argument_never_replaces_the_completions():
    columns = {"completions": ["from the dataset"] * 2, "prompts": ["dataset prompt"] * 2}
    seen = score_completions([lambda prompts, completions, **kw: [float(c == "generated") for c in completions]], ["p", "q"], ["generated", "generated"], columns=columns)
    assert seen.tolist() == [1.0, 1.0]


def test_a_completion_without_a_reward_is_nan_never_zero():
    from rlalign.lm.reward_calls import UNSCORED

    def timing_out(prompts, completions):
        return [{"ok": 1.0, "timeout": UNSCORED, "n/a": None}[c] for c in completions]

    total = score_completions([timing_out], ["p"] * 3, ["ok", "timeout", "n/a"])
    assert total[0].item() == 1.0 and total[1:].isnan().all()  # UNSCORED: could not be scored; None from every term: no reward
    assert total.nanmean().item() == 1.0  # the mean over the scored completion, where adding 0s gave 1/3
    # with a second term scoring every row 0.5: None leaves only its own term's sum (0 + 0.5), UNSCORED leaves the row out
    both = score_completions([timing_out, lambda p, c: [0.5] * len(c)], ["p"] * 3, ["ok", "timeout", "n/a"])
    assert both[0].item() == 1.5 and both[1].isnan() and both[2].item() == 0.5


def test_a_failed_async_batch_is_re_run_rows_at_once_and_a_raising_row_fails_alone():
    import asyncio

    from rlalign.lm.reward_calls import RERUN_CONCURRENCY, CallPolicy, score_terms

    state = {"in_flight": 0, "most": 0, "calls": 0}

    async def picky(prompts, completions):
        state["calls"] += 1
        state["in_flight"] += 1
        state["most"] = max(state["most"], state["in_flight"])
        await asyncio.sleep(0)  # every started row gets here before any finishes
        state["in_flight"] -= 1
        if "bad" in completions:
            raise ValueError("cannot score bad")
        return [1.0] * len(completions)

    completions = ["ok"] * 5 + ["bad"] + ["ok"] * 6
    result = score_terms([CallPolicy("picky", picky, on_error="skip")], ["p"] * 12, completions)[0]
    assert result.failed.tolist() == [c == "bad" for c in completions] and result.values.nansum().item() == 11.0
    assert state["calls"] == 1 + 12 and RERUN_CONCURRENCY == 8 and state["most"] == 8  # one row at a time before: 1


@pytest.mark.parametrize("on_error", ["raise", "skip"])
def test_a_batch_that_fails_while_every_row_alone_returns_is_never_scored_row_by_row(on_error):
    # TRL stops on the batch's error; scoring rows alone would give a reward that depends on its batch other values
    from rlalign.lm.reward_calls import CallPolicy, score_terms

    calls = []

    def relative_length(prompts, completions):
        calls.append(len(completions))
        if len(completions) > 2:
            raise RuntimeError("API: batch too large")
        longest = max(map(len, completions))
        return [len(c) / longest for c in completions]

    policy = CallPolicy("relative_length", relative_length, on_error=on_error)
    if on_error == "raise":
        with pytest.raises(RewardFunctionError, match=r"relative_length raised RuntimeError: API: batch too large on its batch of 4 completions "
                                                      r"\(first prompt 'a'\), though each alone returned"):
            score_terms([policy], ["a", "a", "b", "b"], ["xx", "xxxx", "x", "xxxxxxxx"])
    else:
        result = score_terms([policy], ["a", "a", "b", "b"], ["xx", "xxxx", "x", "xxxxxxxx"])[0]
        assert result.failed.tolist() == [True] * 4 and result.values.isnan().all()  # not 1.0 each, as scored alone
    assert calls == [4, 1, 1, 1, 1]  # the rows were asked alone, to name one that raises


def test_once_the_endpoint_is_down_the_remaining_rows_are_not_asked():
    from rlalign.lm.reward_calls import CallPolicy, EndpointUnavailable, score_terms

    calls = []

    def flaky(prompts, completions):
        calls.append(list(completions))
        if len(completions) > 1:
            raise ValueError("one row is bad")
        if completions == ["b"]:
            raise EndpointUnavailable("POST http://x/score failed after 4 tries: ConnectError")
        return [1.0]

    result = score_terms([CallPolicy("flaky", flaky, on_error="skip")], ["p"] * 4, ["a", "b", "c", "d"])[0]
    assert calls == [["a", "b", "c", "d"], ["a"], ["b"]]  # c and d are not asked of a server that is down
    assert result.failed.tolist() == [False, True, True, True] and result.values[0].item() == 1.0

    def down(prompts, completions):
        calls.append(list(completions))
        raise EndpointUnavailable("POST http://x/score failed after 4 tries: ConnectError")

    calls.clear()
    assert score_terms([CallPolicy("down", down, on_error="skip")], ["p"] * 4, ["a", "b", "c", "d"])[0].failed.all()
    assert calls == [["a", "b", "c", "d"]]  # the batch's failure is the endpoint's: not split


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_what_a_re_run_batch_logs_counts_once_in_row_order(kind):
    # a batch that raised logged its metric and column before raising, then each row logged again when re-run: the
    # metric averaged 4 calls (3, 1, 1, 1) and the column had 6 values, so the samples table dropped it; re-run async rows
    # finishing out of order would have filled the column out of row order
    import asyncio

    from rlalign.lm.reward_calls import CallPolicy, score_terms
    from rlalign.train.rollouts import RewardLog

    def score(completions, log_metric, log_extra):
        log_metric("rows", len(completions))
        log_extra("seen", list(completions))
        if "bad" in completions:
            raise ValueError("cannot score bad")
        return [1.0] * len(completions)

    async def score_async(completions, log_metric, log_extra):
        await asyncio.sleep(0.01 * (3 - len(completions[0])))  # the longest completion's row finishes first
        return score(completions, log_metric, log_extra)

    log = RewardLog()
    policy = CallPolicy("score", score if kind == "sync" else score_async, on_error="skip")
    result = score_terms([policy], ["p"] * 4, ["a", "bad", "cc", "ddd"], context={"log_metric": log.log_metric, "log_extra": log.log_extra})[0]
    assert result.failed.tolist() == [False, True, False, False]
    assert log.metrics == {"rows": [1.0, 1.0, 1.0]} and log.columns == {"seen": ["a", "cc", "ddd"]}  # the rows kept, in row order

    log = RewardLog()
    score_terms([CallPolicy("score", score)], ["p"] * 2, ["a", "b"], context={"log_metric": log.log_metric, "log_extra": log.log_extra})
    assert log.metrics == {"rows": [2.0]} and log.columns == {"seen": ["a", "b"]}  # a batch that succeeds logs once, as it logged
