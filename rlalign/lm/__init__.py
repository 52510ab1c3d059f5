"""Language-model plumbing on any Hugging Face causal LM (one module per concern):

- :mod:`rlalign.lm.models`: policy / frozen reference / tokenizer loaders, LoRA and the
  adapters-disabled reference, dropout off, dtype and device; :mod:`rlalign.lm.heads`: the critic and
  reward model (a scalar head on the backbone); :mod:`rlalign.lm.model_modes`: the attention switch,
  activation checkpointing, eval mode.
- :mod:`rlalign.lm.data`: prompts, SFT pairs and preference pairs from JSONL / JSON / Parquet /
  lists, validated at load; :mod:`rlalign.lm.encoding`: chat rendering, prompt tokens, SFT and
  preference batches (padding or packing).
- :mod:`rlalign.lm.sampling`: batched KV-cache sampling into a :class:`rlalign.lm.rollout.Rollout`;
  its prefill in :mod:`rlalign.lm.prefill`, one decode step and the draw in :mod:`rlalign.lm.decode`.
- :mod:`rlalign.lm.logprobs`: training-time completion log-probs (LM head on completion positions only).
- :mod:`rlalign.lm.rewards`: the reward-function protocol, rule-based rewards, reward model as reward;
  :mod:`rlalign.lm.code_execution`: the sandboxed code reward.

The CPU speed machinery, imported only when its option is on: :mod:`rlalign.lm.packed` (linear
weights in oneDNN's blocked layout) and :mod:`rlalign.lm.compiled` (the compiled decode step and
its compiler workarounds); the private torch / transformers symbols they use are listed and
checked in :mod:`rlalign.lm.private`.
"""
