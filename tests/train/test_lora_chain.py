"""LoRA stages that chain: a LoRA run's final/ (an adapter) is the next stage's model.path, whose
reference, critic and reward-model backbone start from base + adapter, never the bare base;
save_merged writes a full checkpoint; runs started from an adapter resume."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from rlalign.config import ConfigError, load_config
from rlalign.lm.models import load_policy
from rlalign.train import grpo
from rlalign.train.reward_model import RMConfig
from rlalign.train.reward_model import train as train_rm
from rlalign.train.sft import SFTConfig
from rlalign.train.sft import train as train_sft

torch.set_num_threads(1)

TINY = ["model.tiny.hidden_size=64", "model.tiny.num_layers=2", "model.tiny.intermediate_size=128", "progress=false"]
IDS = torch.tensor([[1, 20, 21, 22, 23, 24]])


@pytest.fixture(scope="module")
def sft_adapter(tmp_path_factory):
    """final/ of a LoRA SFT run: an adapter whose base is the SFT run's base_model/."""
    out = tmp_path_factory.mktemp("sft")
    train_sft(load_config(SFTConfig, None, TINY + [f"output_dir={out}", "model.lora.r=4", "max_steps=4", "eval_every=4", "data.num_train=32",
                                                    "data.num_eval=4", "batch_size=8", "optim.lr=3e-2", "optim.warmup_steps=0"]))
    final = out / "final"
    assert (final / "adapter_config.json").is_file() and not (final / "config.json").is_file()
    return final


def _logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=IDS).logits


def _grpo(adapter, tmp_path, name: str, **overrides):
    cfg = {
        "model.path": str(adapter), "output_dir": str(tmp_path / name), "data.task": "arithmetic", "data.num_prompts": 16, "steps": 1,
        "prompts_per_step": 2, "group_size": 2, "sampling.max_new_tokens": 4, "beta": 0.1, "progress": False, "plots": False,
        "rewards": [{"function": "arithmetic"}], **overrides,
    }
    return grpo.train(load_config(grpo.GRPOConfig, None, cfg))


def test_an_adapter_is_merged_into_its_base_and_is_the_reference(sft_adapter, tmp_path):
    base = json.loads((sft_adapter / "adapter_config.json").read_text())["base_model_name_or_path"]
    result = _grpo(sft_adapter, tmp_path, "full")
    assert result.history[0]["kl"] == 0.0  # the reference is base + adapter: the policy it starts from
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "full" / "base_model")
    torch.testing.assert_close(_logits(merged), _logits(load_policy(sft_adapter)), rtol=0, atol=1e-5)
    assert not torch.allclose(_logits(merged), _logits(AutoModelForCausalLM.from_pretrained(base)), atol=1e-3)  # not the bare base
    assert (tmp_path / "full" / "final" / "config.json").is_file()  # full fine-tuning of the merged model: a full checkpoint


def test_fresh_lora_on_the_merged_model_chains_again_and_save_merged_writes_a_full_model(sft_adapter, tmp_path):
    first = _grpo(sft_adapter, tmp_path, "lora", **{"model.lora.r": 4, "optim.lr": 3e-2})
    assert first.history[0]["kl"] == 0.0  # adapters off = the merged SFT model
    adapter = tmp_path / "lora" / "final"
    assert json.loads((adapter / "adapter_config.json").read_text())["base_model_name_or_path"] == str(tmp_path / "lora" / "base_model")
    second = _grpo(adapter, tmp_path, "again", **{"model.lora.r": 4, "save_merged": True})  # a third stage from the second's adapter
    assert second.history[0]["kl"] == 0.0
    final = tmp_path / "again" / "final"
    assert (final / "config.json").is_file() and not (final / "adapter_config.json").is_file()
    checkpoint = next((tmp_path / "again" / "checkpoints").iterdir()) / "model"  # checkpoints keep the adapter, for resuming
    assert (checkpoint / "adapter_config.json").is_file()
    torch.testing.assert_close(_logits(AutoModelForCausalLM.from_pretrained(final)), _logits(load_policy(checkpoint)), rtol=0, atol=1e-5)


def test_training_the_saved_adapter_keeps_base_plus_adapter_as_reference(sft_adapter, tmp_path):
    result = _grpo(sft_adapter, tmp_path, "train", **{"model.adapter": "train", "optim.lr": 3e-2})
    assert abs(result.history[0]["kl"]) < 1e-6  # base + adapter vs the same weights merged: rounding only
    final = tmp_path / "train" / "final"
    base = json.loads((sft_adapter / "adapter_config.json").read_text())["base_model_name_or_path"]
    assert json.loads((final / "adapter_config.json").read_text())["base_model_name_or_path"] == base  # the same adapter, trained on
    assert not torch.allclose(_logits(load_policy(final)), _logits(load_policy(sft_adapter)), atol=1e-4)
    with pytest.raises(ConfigError, match="model.adapter: train keeps training the saved adapter"):
        _grpo(sft_adapter, tmp_path, "both", **{"model.adapter": "train", "model.lora.r": 4})


def test_a_run_started_from_an_adapter_resumes(sft_adapter, tmp_path):
    straight = _grpo(sft_adapter, tmp_path, "straight", **{"model.lora.r": 4, "steps": 2})
    _grpo(sft_adapter, tmp_path, "cut", **{"model.lora.r": 4, "steps": 2, "save_every": 1})
    cfg = load_config(grpo.GRPOConfig, None, {
        "model.path": str(sft_adapter), "output_dir": str(tmp_path / "resumed"), "data.task": "arithmetic", "data.num_prompts": 16, "steps": 2,
        "prompts_per_step": 2, "group_size": 2, "sampling.max_new_tokens": 4, "beta": 0.1, "progress": False, "plots": False, "model.lora.r": 4,
        "save_every": 1, "rewards": [{"function": "arithmetic"}],
    })
    resumed = grpo.train(cfg, resume=tmp_path / "cut" / "checkpoints" / "step_00000001")
    assert resumed.history[-1]["loss/policy"] == pytest.approx(straight.history[-1]["loss/policy"], abs=1e-6)


def test_a_reward_model_starts_from_base_plus_adapter(sft_adapter, tmp_path):
    result = train_rm(load_config(RMConfig, None, TINY + [f"output_dir={tmp_path / 'rm'}", f"model.path={sft_adapter}", "max_steps=2",
                                                           "eval_every=2", "data.num_train=16", "data.num_eval=8", "batch_size=4"]))
    assert 0.0 <= result["eval/accuracy"] <= 1.0
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "rm" / "base_model")
    torch.testing.assert_close(_logits(merged), _logits(load_policy(sft_adapter)), rtol=0, atol=1e-5)
