"""A TRL user's config names: each unknown key TRL or transformers defines gets rlalign's field, never a look-alike."""

from __future__ import annotations

import dataclasses
import re

import pytest

from rlalign.config import ConfigError, load_config
from rlalign.train import distill, dpo, grpo, ppo, reward_model, sft
from rlalign.trl_names import _BY_TRAINER, trl_hint

CONFIGS = {c.__name__: c for c in (grpo.GRPOConfig, ppo.PPOConfig, distill.DistillConfig, dpo.DPOConfig, sft.SFTConfig, reward_model.RMConfig)}
PROSE = ("no such setting", "no float16", "the ", "each ")  # hints that name no field first
LEGACY = {  # names of TRL releases before 1.16 (its last PPOConfig, older length limits), of transformers 4 (warmup_ratio) and model kwargs
    "num_ppo_epochs", "num_mini_batches", "cliprange", "cliprange_value", "vf_coef", "response_length", "total_episodes",
    "local_rollout_forward_batch_size", "max_seq_length", "max_prompt_length", "max_completion_length", "ref_model", "torch_dtype",
    "use_liger_kernel", "attn_implementation", "dtype", "warmup_ratio",
}


def _fields(cls, prefix=""):
    out = set()
    for name, field in cls.model_fields.items():
        out.add(prefix + (field.alias or name))
        for model in _models(field.annotation):
            out |= _fields(model, prefix + (field.alias or name) + ".")
    return out


def _models(annotation):
    import typing

    from pydantic import BaseModel
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for arg in typing.get_args(annotation) for m in _models(arg)]


@pytest.mark.parametrize("trainer", sorted(_BY_TRAINER))
def test_every_hint_names_a_field_of_its_trainer_and_never_shadows_one(trainer):
    fields = _fields(CONFIGS[trainer])
    for key, target in _BY_TRAINER[trainer].items():
        first = re.split(r"[ :,]", target)[0]
        assert target.startswith(PROSE) or first in fields, (trainer, key, first)
        assert key not in fields or trl_hint(trainer, key, sorted(fields)) is None  # a name both share is this config's field


def test_every_name_is_trls_or_transformers():
    trl = pytest.importorskip("trl")
    from transformers import TrainingArguments

    known = {f.name for c in (TrainingArguments, trl.GRPOConfig, trl.DPOConfig, trl.SFTConfig, trl.RewardConfig) for f in dataclasses.fields(c)}
    invented = {key for table in _BY_TRAINER.values() for key in table} - known - LEGACY
    assert not invented


@pytest.mark.parametrize("trainer, override, hint", [
    (grpo.GRPOConfig, "num_generations=4", "TRL's num_generations: group_size."),
    (grpo.GRPOConfig, "per_device_train_batch_size=4", "TRL's per_device_train_batch_size: the step's batch is prompts_per_step prompts x group_size"),
    (grpo.GRPOConfig, "epsilon=0.2", "TRL's epsilon: eps_low and eps_high"),
    (grpo.GRPOConfig, "scale_rewards=false", "TRL's scale_rewards: advantage: group"),
    (ppo.PPOConfig, "epsilon=0.2", "TRL's epsilon: eps."),
    (ppo.PPOConfig, "num_generations=4", "TRL's num_generations: no such setting: PPO samples one completion per prompt"),
    (sft.SFTConfig, "learning_rate=1e-5", "TRL's learning_rate: optim.lr."),
    (sft.SFTConfig, "assistant_only_loss=true", "TRL's assistant_only_loss: data.completion_only_loss"),
    (reward_model.RMConfig, "center_rewards_coefficient=0.01", "TRL's center_rewards_coefficient: center_coef."),
    (dpo.DPOConfig, "precompute_ref_log_probs=true", "TRL's precompute_ref_log_probs: precompute_ref_logprobs."),
])
def test_an_unknown_trl_key_names_the_field_it_is_here(trainer, override, hint):
    # before: per_device_train_batch_size got "Did you mean 'micro_batch_size'?", epsilon "'eps_low'?" (half of it),
    # scale_rewards "'rewards'?", and num_generations or learning_rate nothing
    with pytest.raises(ConfigError) as err:
        load_config(trainer, None, [override])
    message = str(err.value)
    assert hint in message and "Did you mean" not in message and "Allowed here:" in message


def test_a_nested_key_or_an_unknown_name_keeps_the_spelling_hint():
    with pytest.raises(ConfigError, match=r"unknown key 'sampling.temprature'. Did you mean 'temperature'\?"):
        load_config(grpo.GRPOConfig, None, ["sampling.temprature=0.5"])
    assert trl_hint("GRPOConfig", "temperature", ["beta"]) == "TRL's temperature: sampling.temperature"
    assert trl_hint("GRPOConfig", "no_such_name") is None and trl_hint("SFTConfig", "num_generations") is None


def test_a_config_that_is_no_lm_trainer_gets_no_trl_hint():
    # the classic algorithms' PPOConfig shares the LM trainer's name: it was told "TRL's learning_rate: optim.lr" and
    # "TRL's cliprange: eps", fields it lacks (its own are lr and clip_coef); DQN and the demo got _COMMON's optim.lr
    from rlalign.classic.dqn import DQNConfig
    from rlalign.classic.ppo import PPOConfig as ClassicPPOConfig
    from rlalign.demo import DemoConfig

    for cls, key in [(ClassicPPOConfig, "learning_rate"), (ClassicPPOConfig, "cliprange"), (DQNConfig, "learning_rate"), (DemoConfig, "learning_rate")]:
        with pytest.raises(ConfigError) as err:
            load_config(cls, None, {key: 1})
        assert "TRL's" not in str(err.value) and "optim." not in str(err.value).split("Allowed here:")[0], str(err.value)

    class MyGRPOConfig(grpo.GRPOConfig):  # a subclass of an LM trainer's config keeps its hints
        pass

    with pytest.raises(ConfigError, match="TRL's num_generations: group_size"):
        load_config(MyGRPOConfig, None, ["num_generations=4"])


@pytest.mark.parametrize("trainer", [sft.SFTConfig, dpo.DPOConfig, reward_model.RMConfig])
def test_trls_top_level_max_length_names_data_max_length(trainer):
    # TRL's SFTConfig, DPOConfig and RewardConfig take max_length at the top level; here it is under data, and the
    # top-level key got no hint at all
    with pytest.raises(ConfigError, match=r"TRL's max_length: data.max_length\."):
        load_config(trainer, None, ["max_length=512"])


def test_trls_generation_counts_name_the_conversion():
    # TRL generates once per steps_per_generation training steps (micro-batches; by default gradient_accumulation_steps
    # of them, one optimiser step): set as num_minibatches it made that many optimiser steps per rollout
    hint = trl_hint("GRPOConfig", "steps_per_generation")
    assert hint.startswith("TRL's steps_per_generation: num_minibatches") and "/ gradient_accumulation_steps" in hint
    # likewise TRL's generation_batch_size counts completions: GRPO's prompts_per_step is it over the group size
    hint = trl_hint("GRPOConfig", "generation_batch_size")
    assert hint.startswith("TRL's generation_batch_size: prompts_per_step = TRL's generation_batch_size / num_generations"), hint


@pytest.mark.parametrize("trainer", [grpo.GRPOConfig, ppo.PPOConfig])
def test_trls_tool_settings_name_the_turns_and_the_per_turn_length(trainer):
    # TRL's max_tool_calling_iterations counts tool rounds (N rounds: N + 1 assistant turns) and got no hint; its
    # max_completion_length bounds a whole tool episode, where sampling.max_new_tokens bounds each turn
    with pytest.raises(ConfigError, match=r"TRL's max_tool_calling_iterations: environment.max_turns = TRL's max_tool_calling_iterations \+ 1"):
        load_config(trainer, None, ["max_tool_calling_iterations=2"])
    assert "each assistant turn's, where TRL's bounds the whole episode" in trl_hint(trainer.__name__, "max_completion_length")


def test_a_trl_name_inside_a_section_gets_its_hint_too():
    # `sampling: {num_generations: 8}` or `optim: {learning_rate: ...}` got only "Allowed here: ..." (hints were top-level only)
    for override, hint in [("sampling.num_generations=8", "TRL's num_generations: group_size."), ("optim.learning_rate=1e-5", "TRL's learning_rate: optim.lr.")]:
        with pytest.raises(ConfigError) as err:
            load_config(grpo.GRPOConfig, None, [override])
        assert hint in str(err.value) and "Did you mean" not in str(err.value)
    with pytest.raises(ConfigError, match=r"unknown key 'model.torch_dtype'. TRL's torch_dtype: model.dtype."):
        load_config(grpo.GRPOConfig, None, ["model.torch_dtype=bfloat16"])
