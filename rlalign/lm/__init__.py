"""Language-model plumbing on any Hugging Face causal LM (one module per concern):

- :mod:`rlalign.lm.models`: policy / frozen reference / critic / reward model loaders, scalar
  heads, LoRA and the adapters-disabled reference, dropout off, dtype and device.
- :mod:`rlalign.lm.data`: prompts, SFT pairs and preference pairs from JSONL / JSON / Parquet /
  lists, validated at load; chat rendering; SFT and preference batches (padding or packing).
- :mod:`rlalign.lm.sampling`: batched KV-cache sampling into a :class:`rlalign.lm.rollout.Rollout`.
- :mod:`rlalign.lm.logprobs`: training-time completion log-probs (LM head on completion positions only).
- :mod:`rlalign.lm.rewards`: the reward-function protocol, rule-based rewards, reward model as reward.
"""
