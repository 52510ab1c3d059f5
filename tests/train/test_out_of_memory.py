"""A pass that runs out of device memory ends the run with one message naming the pass, its rows and
tokens at once, and the settings that lower them; the run's last checkpoint stays whole."""

from __future__ import annotations

import pytest
import torch

from rlalign.tasks.tiny_model import TinyModelSpec, build_tiny_checkpoint
from rlalign.train import grpo, passes
from rlalign.train.checkpoints import list_checkpoints
from rlalign.train.common import OutOfMemory, memory_named
from tests.train.test_grpo import char_code_reward, make_cfg


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return build_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), TinyModelSpec(hidden_size=32, num_layers=1, intermediate_size=64), seed=0)


def test_an_out_of_memory_error_names_the_pass_and_the_settings():
    with pytest.raises(OutOfMemory) as caught:
        with memory_named("the update's forward and backward", 64, 1024):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 37.25 GiB.\nmore lines of the allocator's report")
    message = str(caught.value)
    assert message.startswith("out of memory in the update's forward and backward (64 rows x 1024 completion tokens at once): set micro_batch_size below 64")
    assert "model.gradient_checkpointing: true" in message and "model.logits_limit_mb" in message and "model.memory_fraction" in message
    assert message.endswith("(CUDA out of memory. Tried to allocate 37.25 GiB.)") and isinstance(caught.value, MemoryError)
    with pytest.raises(ValueError):  # any other error passes through as it is
        with memory_named("a pass", 1, 1):
            raise ValueError("not memory")
    with pytest.raises(RuntimeError, match="^shapes"):
        with memory_named("a pass", 1, 1):
            raise RuntimeError("shapes do not match")


def test_a_pass_of_one_row_or_without_a_split_head_is_not_told_to_lower_what_cannot_help():
    with pytest.raises(OutOfMemory) as caught:  # one row already: no micro_batch_size below 1
        with memory_named("the reference pass", 1, 300):
            raise torch.OutOfMemoryError("CUDA out of memory.")
    assert str(caught.value).startswith("out of memory in the reference pass (1 rows x 300 completion tokens at once): it runs one row at a time already: "
                                        "set model.gradient_checkpointing: true, or a lower model.logits_limit_mb")
    assert "micro_batch_size" not in str(caught.value) and "shorter rows, or a smaller model" in str(caught.value)
    with pytest.raises(OutOfMemory) as caught:  # a critic (no LM head) of a supervised run (no auto plan), on a CPU
        with memory_named("the update's forward and backward", 8, None, head_split=False, planned=False):
            raise RuntimeError("[enforce fail at alloc_cpu.cpp:121] data. DefaultCPUAllocator: can't allocate memory: you tried to allocate 9 bytes.")
    assert str(caught.value).startswith("out of memory in the update's forward and backward (8 examples at once): set micro_batch_size below 8 "
                                        "(rows per forward and backward; the same update), or model.gradient_checkpointing: true (")
    assert "logits_limit_mb" not in str(caught.value) and "memory_fraction" not in str(caught.value)


def out_of_memory(*args, **kwargs):
    raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB.")


@pytest.mark.parametrize("where, what", [
    ((grpo, "grpo_loss"), r"the update's forward and backward \(4 rows x \d+ completion tokens at once\): set micro_batch_size below 4"),
    ((passes, "rollout_token_logprobs"), r"the reference pass \(4 rows x \d+ completion tokens at once\): set micro_batch_size below 4"),
])
def test_a_run_out_of_memory_stops_with_the_message_and_keeps_its_checkpoint(tiny_path, tmp_path, monkeypatch, where, what):
    cfg = make_cfg(tiny_path, tmp_path, steps=2, save_every=1, beta=0.04, micro_batch_size=4, overwrite=False)
    grpo.train(cfg, reward_functions=[char_code_reward])  # two steps, checkpoints at 1 and 2
    longer = cfg.model_copy(update={"steps": 3})
    with monkeypatch.context() as patch:
        patch.setattr(*where, out_of_memory)
        with pytest.raises(OutOfMemory, match=what):
            grpo.train(longer, resume=tmp_path / "run", reward_functions=[char_code_reward])
    assert [int(p.name[5:]) for p in list_checkpoints(tmp_path / "run")][-1] == 2  # the last checkpoint is still there, whole
    assert len(grpo.train(longer, resume=tmp_path / "run", reward_functions=[char_code_reward]).history) >= 1  # and resumes once memory allows


def test_the_no_grad_passes_name_their_largest_batch_and_the_completion_width(monkeypatch):
    # 5 rows of 3 prompt and 7 completion tokens, run in batches of 2, 2 and 1: the message names 2 rows x 7 tokens
    from rlalign.lm.rollout import Rollout
    from tests.lm.conftest import make_llama

    rollout = Rollout(torch.full((5, 3), 5), torch.ones(5, 3, dtype=torch.long), torch.full((5, 7), 6), torch.ones(5, 7, dtype=torch.long),
                      torch.zeros(5, 7), torch.arange(5), torch.zeros(5, dtype=torch.bool))
    batches = [slice(0, 2), slice(2, 4), slice(4, 5)]
    policy, reference = make_llama(), make_llama(seed=1)
    monkeypatch.setattr(passes, "rollout_token_logprobs", out_of_memory)
    with pytest.raises(OutOfMemory, match=r"^out of memory in the reference pass \(2 rows x 7 completion tokens at once\)"):
        passes.reference_logprobs(policy, reference, rollout, 1.0, batches)
    with pytest.raises(OutOfMemory, match=r"^out of memory in the pi_old pass \(2 rows x 7 completion tokens at once\)"):
        passes.training_logprobs(policy, rollout, 1.0, batches)


def test_the_critics_value_pass_and_a_supervised_update_name_themselves(tiny_path, tmp_path, monkeypatch):
    from rlalign.config import load_config
    from rlalign.train import ppo, sft
    from tests.train.test_ppo import digit_share, make_cfg as make_ppo_cfg

    values = ppo.critic_values

    def values_out_of_memory_without_grad(*args, **kwargs):  # the old values' no-grad pass only
        if torch.is_grad_enabled():
            return values(*args, **kwargs)
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB.")

    monkeypatch.setattr(ppo, "critic_values", values_out_of_memory_without_grad)
    with pytest.raises(OutOfMemory, match=r"^out of memory in the critic's value pass \(8 rows x \d+ completion tokens at once\): set micro_batch_size below 8"):
        ppo.train(make_ppo_cfg(tiny_path, tmp_path, steps=1), reward_functions=[digit_share])
    monkeypatch.undo()

    cfg = load_config(sft.SFTConfig, None, [f"model.path={tiny_path}", f"output_dir={tmp_path / 'sft'}", "data.task=arithmetic", "max_steps=1",
                                            "batch_size=4", "micro_batch_size=2", "progress=false", "plots=false"])
    monkeypatch.setattr(torch.Tensor, "backward", out_of_memory)
    with pytest.raises(OutOfMemory, match=r"^out of memory in the update's forward and backward \(2 examples at once\): set micro_batch_size below 2"):
        sft.train(cfg)
