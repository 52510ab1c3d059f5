"""The run lifecycle every LM trainer shares (rlalign.train.loop): one --resume convention, one
checkpoint layout, clear errors for a checkpoint that cannot be resumed."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from rlalign.cli import main
from rlalign.lm.rollout import Rollout
from rlalign.train import loop, passes
from rlalign.train.common import autocast_context
from rlalign.train.checkpoints import CheckpointError, list_checkpoints, load_checkpoint
from rlalign.train.metrics import read_metrics

TINY = ["model.tiny.hidden_size=32", "model.tiny.num_layers=1", "model.tiny.intermediate_size=64", "progress=false"]
RM = ["rm", *TINY, "data.num_train=32", "data.num_eval=4", "batch_size=4", "save_every=1", "keep_last=5"]


def test_the_cli_resumes_a_reward_model_run_at_the_step_its_checkpoint_names(tmp_path):
    assert main([*RM, "max_steps=3", f"output_dir={tmp_path / 'full'}"]) == 0
    assert [p.name for p in list_checkpoints(tmp_path / "full")] == ["step_00000001", "step_00000002", "step_00000003"]  # n steps done
    assert load_checkpoint(tmp_path / "full" / "checkpoints" / "step_00000002").step == 2
    assert main([*RM, "max_steps=3", f"output_dir={tmp_path / 'resumed'}", "--resume", str(tmp_path / "full" / "checkpoints" / "step_00000002")]) == 0
    assert [r["step"] for r in read_metrics(tmp_path / "resumed" / "metrics.jsonl")] == [2]  # only the step it ran
    full, resumed = (load_file(str(tmp_path / run / "final" / "model.safetensors")) for run in ("full", "resumed"))
    for key in full:
        torch.testing.assert_close(resumed[key], full[key], rtol=0, atol=1e-6)


def test_a_checkpoint_without_this_trainers_optimiser_state_is_a_clear_error(tmp_path):
    assert main([*RM, "max_steps=1", f"output_dir={tmp_path / 'rm'}"]) == 0
    checkpoint = load_checkpoint(tmp_path / "rm")
    with pytest.raises(CheckpointError, match="no optimiser state for policy.*model.path"):
        loop.resume_state(checkpoint, 0, {"policy": None})


def test_saved_models_let_go_of_gathered_weights_after_the_block():
    models = loop.SavedModels(torch.nn.Linear(2, 2))
    with models.gathered() as gathered:
        assert gathered.states == {"policy": None}  # not sharded: the model saves its own parameters
        gathered.states["policy"] = {"weight": torch.zeros(2, 2)}
    assert models.states == {}


def test_autocast_takes_none_or_bfloat16_only():
    linear = torch.nn.Linear(2, 2)
    with autocast_context("bfloat16", linear):
        assert linear(torch.ones(1, 2)).dtype == torch.bfloat16
    with autocast_context("none", linear):
        assert linear(torch.ones(1, 2)).dtype == torch.float32
    with pytest.raises(ValueError, match="'none' or 'bfloat16'"):
        autocast_context("float16", linear)


def test_the_compiled_training_pass_falls_back_to_eager_when_torch_lacks_its_private_symbols(monkeypatch):
    from transformers import LlamaConfig, LlamaForCausalLM

    from rlalign.lm import private

    model = LlamaForCausalLM(LlamaConfig(vocab_size=20, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                                         num_key_value_heads=2)).eval()
    rollout = Rollout(
        prompt_ids=torch.tensor([[0, 3, 4], [5, 6, 7]]), prompt_mask=torch.tensor([[0, 1, 1], [1, 1, 1]]),
        completion_ids=torch.tensor([[8, 9], [10, 0]]), completion_mask=torch.tensor([[1, 1], [1, 0]]),
        logprobs=torch.zeros(2, 2), group_index=torch.tensor([0, 1]), truncated=torch.tensor([True, False]),
    )
    eager = passes.completion_logits(model, rollout)
    monkeypatch.setattr(passes, "compiled_completion_logits", lambda: pytest.fail("compiled although its symbols are missing"))
    monkeypatch.setitem(private.PRIVATE_SYMBOLS, "compiled", (*private.PRIVATE_SYMBOLS["compiled"], "torch:no_such_private_symbol"))
    private.ready.cache_clear()
    try:
        with pytest.warns(RuntimeWarning, match="compiled fast path is off"):
            fallback = passes.completion_logits(model, rollout, compiled=True)
    finally:
        private.ready.cache_clear()
    torch.testing.assert_close(fallback, eager, rtol=0, atol=0)


def test_samples_are_written_every_sample_every_steps_and_eval_runs_every_eval_every_steps(tmp_path):
    from rlalign.train import grpo

    cfg = grpo.load_config(grpo.GRPOConfig, None, [*TINY, f"output_dir={tmp_path / 'grpo'}", "steps=4", "sample_every=2", "prompts_per_step=2",
                                                   "group_size=2", "sampling.max_new_tokens=2", "plots=false", "rewards=[{function: arithmetic}]"])
    grpo.train(cfg)
    rows = [json.loads(line) for line in (tmp_path / "grpo" / "samples.jsonl").read_text().splitlines()]
    assert sorted({row["step"] for row in rows}) == [1, 3]  # after steps 2 and 4 (1-based)
    assert main([*RM, "max_steps=5", "eval_every=2", f"output_dir={tmp_path / 'rm'}"]) == 0
    evals = [r["step"] for r in read_metrics(tmp_path / "rm" / "metrics.jsonl") if "eval/accuracy" in r and r["step"] >= 0]
    assert evals == [1, 3, 4]  # every 2 steps, and at the last


def test_reward_statistics_of_a_single_completion_have_no_spread():
    from rlalign.train.rollouts import reward_stats

    assert reward_stats(torch.tensor([2.0]), {"rm": torch.tensor([3.0])}) == {"reward/mean": 2.0, "reward/std": 0.0, "reward/rm/mean": 3.0, "reward/rm/std": 0.0}


def test_a_trl_style_reward_gets_each_rows_columns_during_training(tmp_path):
    from rlalign.train import grpo
    from rlalign.train.rollouts import RewardTerm

    seen, steps = [], []

    def accuracy_reward(completions, answer, completion_ids, trainer_state, **kwargs):  # TRL's documented keywords
        seen.extend(answer)
        steps.append(trainer_state.global_step)
        assert all(isinstance(ids, list) and 1 <= len(ids) <= 2 for ids in completion_ids)  # each row's tokens, no padding
        return [float(c.strip() == a) for c, a in zip(completions, answer)]

    cfg = grpo.load_config(grpo.GRPOConfig, None, [*TINY, f"output_dir={tmp_path}", "steps=2", "prompts_per_step=2", "group_size=2",
                                                   "sampling.max_new_tokens=2", "plots=false", "rewards=[]"])
    records = [{"prompt": "1+1=", "answer": "2"}, {"prompt": "1+1=", "answer": "two"}, {"prompt": "2+2=", "answer": "4"}]
    grpo.train(cfg, reward_functions=[RewardTerm("acc", 1.0, accuracy_reward)], prompts=records)
    assert len(seen) == 2 * 2 * 2 and set(seen) <= {"2", "two", "4"}  # each row's own answer, G copies per prompt
    assert steps == [0, 1]


def test_the_summary_line_is_printed_outside_a_process_group_whatever_rank_the_environment_names(monkeypatch, capsys):
    # a scheduler may export RANK (or an empty one) without a process group: the one process still prints its line
    for rank in ("1", ""):
        monkeypatch.setenv("RANK", rank)
        loop.print_summary('{"steps_run": 2}')
    assert capsys.readouterr().out == '{"steps_run": 2}\n' * 2
