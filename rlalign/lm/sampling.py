"""Batched sampling with a pre-allocated KV cache, written as a plain decode loop.

    rollout = sample(policy, prompt_ids, SamplingParams(max_new_tokens=16, temperature=1.0),
                     pad_token_id=tok.pad_token_id, eos_token_ids=[tok.eos_token_id], group_size=8)

Each prompt is repeated G times (rows of a group are adjacent; ``group_index`` says which prompt).
Prompts of different lengths are left-padded; position ids count real tokens only (cumsum of the
mask minus 1, as ``generate`` does), so a padded prompt gives the same tokens as the unpadded one.

How it differs from ``model.generate``: the KV cache is a ``StaticCache`` allocated once for
P + max_new_tokens positions, and the attention mask is one additive 4-D tensor (B, 1, 1, P + N)
(two with a sliding window, below) updated in place (a column or two per step) and handed to the
model as-is, so no mask is rebuilt and
no tensor is concatenated per step; logits are computed for the last position only; there are no
logits-processor or stopping-criteria objects; the prompt of a group is prefilled once and its
cache repeated to the group's G rows; prompts of different lengths are prefilled side by side,
several to a row, when that takes fewer rows (:func:`pack_prompts`), so padding is hardly
computed. Per step the loop does one forward, one softmax and one
draw. Eager, the model's own forward is most of the time of a step, so the gain over
``generate`` is modest (benchmarks/RESULTS.md has the measured ratios).

``compile=True`` runs the decode step, with the draw of the next token in it, through
``torch.compile`` with static shapes (the first token's draw, from the prefill's logits, is compiled
on its own).
The cache length is rounded up by :func:`cache_bucket`, so prompts of nearby lengths share one
compiled version; a new batch size, bucket, model dtype or attention kernel compiles another (at
most ``rlalign.lm.compiled.RECOMPILE_LIMIT`` per process; past that a call warns and runs eager). From the third
step of a call on, ``torch.compiler.set_stance(skip_guard_eval_unsafe=True)`` skips the guards
that cannot tell the process's compiled versions apart: the decode step has by then passed its
full guards twice (the first draw runs before the loop, with its full guards), and the model, the
cache object and the shapes stay the same; a guard that would
fail raises rather than run a wrong version. The graph reads the parameters when it runs, so
in-place weight updates need no recompile. Inside the compiled step the model runs its "eager"
attention, which inductor fuses (:func:`rlalign.lm.model_modes.attention_kernel`). This removes most of
transformers' per-module Python cost, which is what a small model's step is made of; a model whose
decode step is bound by reading its weights from memory (SmolLM2-135M at batch 8 on one CPU core)
gains most from a half-precision copy with packed weights (``rlalign.lm.packed.PackedLinear``).
Not under ``torch.autocast``, which rules out the StaticCache.

Sliding-window attention (Mistral, Qwen2 with ``use_sliding_window``, Gemma 2/3, Phi-3): every
layer keeps all keys in the cache, and when the window is shorter than the sequence the sampler
hands the model a second mask that also hides the keys outside the window (key slot k is seen from
query slot q when q - window < k <= q, transformers' rule), for all layers or by layer type. The
cache then holds every position, not just the window: more KV memory than ``generate`` for
sequences much longer than the window.

Sampling: logits z / tau, then optional top-k (keep the k largest) and top-p (keep the smallest
set of tokens whose probability reaches p, and any token tied with the last one kept; Holtzman et
al. 2020), then a categorical draw by inverse CDF: token = the first y with F(y) > u * F(V), F the
cumulative sum of the probabilities, u ~ U[0, 1) one number per row and step (found in two levels,
blocks then tokens: :func:`inverse_cdf_draw`). The uniforms are drawn up front, (N, B) from the
generator, or handed in as ``noise``: a trainer under torchrun draws them for the global batch
and gives each rank its own rows' columns, so a row's completion does not depend on how the
batch is split across processes (rlalign.train.distributed).
``temperature=0`` is greedy (argmax, the same tokens as ``generate(do_sample=False)``).
The recorded log-prob is log softmax(z / tau)[y] over the full vocabulary (tau = 1 when greedy):
the same quantity the training pass computes with ``token_logprobs(logits, y, tau)``, so before
the first update the PPO ratio is exactly 1 (top-k / top-p only decide which tokens are drawn).
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import torch
from torch import Tensor, nn
from transformers import DynamicCache, StaticCache

from rlalign.lm import private
from rlalign.lm.decode import SamplingParams, _decode_step, _draw, filter_logits, inverse_cdf_draw
from rlalign.lm.grouped_attention import grouped_kernel
from rlalign.lm.model_modes import attention_kernel
from rlalign.lm.models import cache_argument, unwrap_causal_lm
from rlalign.lm.prefill import _layer_types, _model_mask, _prefill, _prompt_rows, pack_prompts
from rlalign.lm.rollout import Rollout

__all__ = ["SamplingParams", "left_pad", "filter_logits", "inverse_cdf_draw", "cache_bucket", "pack_prompts", "sample"]


def left_pad(sequences: Sequence[Sequence[int]], pad_token_id: int, device: torch.device | str = "cpu") -> tuple[Tensor, Tensor]:
    """Left-pad token lists to one length. Returns (ids, mask), each (B, P); mask is 1 on real tokens."""
    if not sequences:
        raise ValueError("no sequences to pad")
    if any(len(s) == 0 for s in sequences):
        raise ValueError("an empty prompt cannot be sampled from (no token to condition on)")
    length = max(len(s) for s in sequences)
    ids = torch.full((len(sequences), length), pad_token_id, dtype=torch.long)  # (B, P)
    mask = torch.zeros((len(sequences), length), dtype=torch.long)  # (B, P)
    for row, seq in enumerate(sequences):
        ids[row, length - len(seq) :] = torch.as_tensor(list(seq), dtype=torch.long)
        mask[row, length - len(seq) :] = 1
    return ids.to(device), mask.to(device)


def cache_bucket(length: int) -> int:
    """Cache slots for ``length`` positions under ``compile=True``: a multiple of 16 up to 64, then of a
    quarter of the power of two below (at most 25% unused slots; 64 -> 64, 65 -> 80, 200 -> 224, 1000 ->
    1024), so prompts of nearby lengths share a compiled version and a run over lengths in [n, 2n]
    makes at most 5."""
    step = 16 if length <= 64 else 2 ** (length.bit_length() - 3)
    return -(-length // step) * step


def _sliding_window(config, length: int) -> int | None:
    """The sliding window of a model whose sliding-window layers see fewer than ``length`` positions
    (the sampler then masks the window itself), else None (full attention is the model's attention).
    Chunked attention, other sliding layer kinds and windows that differ by layer are errors."""
    layers = StaticCache(config=config, max_cache_len=length).layers  # no tensors yet: only the layer kinds and sizes
    short = [layer for layer in layers if getattr(layer, "is_sliding", False) and getattr(layer, "max_cache_len", length) < length]
    if not short:
        return None
    text_config = config.get_text_config(decoder=True)
    if getattr(text_config, "attention_chunk_size", None) is not None:
        raise ValueError(f"chunked attention (attention_chunk_size={text_config.attention_chunk_size}) is not supported by the sampler at {length} positions")
    sliding_layer = private.resolve("transformers.cache_utils:StaticSlidingWindowLayer")
    kinds = {type(layer).__name__ for layer in short if type(layer) is not sliding_layer}
    windows = {layer.max_cache_len for layer in short}  # a sliding layer's size is min(window, length)
    if kinds or len(windows) > 1:
        raise ValueError(f"the sampler masks one sliding window over plain attention layers; this model has {sorted(kinds) or sorted(windows)} at {length} positions")
    return windows.pop()


def _static_cache(config, slots: int) -> StaticCache | None:
    """A StaticCache of ``slots`` positions for a model of ``config``, its sliding-window layers made
    full-attention layers: they keep all keys, and the sampler's mask hides those outside the window
    (transformers' sliding layer keeps a rolling buffer and its write position in a Python int,
    which a compiled decode step would have to be recompiled for at every step). None when this
    transformers lacks the layer classes (:mod:`rlalign.lm.private`): the sampler then grows a DynamicCache."""
    if not private.ready("static_cache"):
        return None
    static_layer = private.resolve("transformers.cache_utils:StaticLayer")
    sliding_layer = private.resolve("transformers.cache_utils:StaticSlidingWindowLayer")
    cache = StaticCache(config=config, max_cache_len=slots)  # tensors are allocated on first use
    for index, layer in enumerate(cache.layers):
        if type(layer) is sliding_layer:
            cache.layers[index] = static_layer(max_cache_len=slots)
    return cache


class _DecodeMask:
    """The decode loop's additive attention mask over the cache's slots, (B, 1, 1, L), updated in place:
    a drawn token's slot becomes visible; with a sliding window a second mask also hides the keys at
    or before q - window, q the query's slot (as transformers' sliding layers do)."""

    def __init__(self, prompt_mask: Tensor, slots: int, dtype: torch.dtype, window: int | None, by_layer_type: bool):
        batch, self.prompt_len = prompt_mask.shape
        self.window, self.by_layer_type, self.hidden = window, by_layer_type, torch.finfo(dtype).min
        self.full = torch.full((batch, 1, 1, slots), self.hidden, dtype=dtype, device=prompt_mask.device)  # (B, 1, 1, L)
        self.full[:, 0, 0, : self.prompt_len].masked_fill_(prompt_mask.bool(), 0.0)
        self.windowed = None
        if window is not None:
            self.windowed = self.full.clone()
            self.windowed[..., : max(self.prompt_len - window + 1, 0)] = self.hidden  # out of the first decode query's window

    def reveal(self, t: int) -> None:
        """Completion token ``t``, just drawn, becomes a visible key (its slot is P + t)."""
        slot = self.prompt_len + t
        self.full[:, 0, 0, slot] = 0.0
        if self.windowed is not None:
            self.windowed[:, 0, 0, slot] = 0.0
            if slot - self.window >= 0:
                self.windowed[:, 0, 0, slot - self.window] = self.hidden  # leaves the window of query slot P + t

    def for_model(self, columns: int) -> Tensor | dict[str, Tensor]:
        """The ``attention_mask`` argument over the first ``columns`` key slots."""
        return _model_mask(self.full[..., :columns], None if self.windowed is None else self.windowed[..., :columns], self.by_layer_type)


class _EagerSteps:
    """The decode step and the draw of :func:`sample`, eager (``rlalign.lm.compiled.CompiledSteps`` compiles them)."""

    compiled = False

    def __init__(self, cache_keyword: str):
        self.cache_keyword = cache_keyword

    def draw(self, logits: Tensor, params: SamplingParams, uniform: Tensor | None) -> tuple[Tensor, Tensor]:
        return _draw(logits, params, uniform)

    def decode(self, model: nn.Module, token: Tensor, step_mask, position_ids: Tensor, cache, params: SamplingParams, uniform: Tensor | None) -> tuple[Tensor, Tensor]:
        return _decode_step(model, token, step_mask, position_ids, cache, self.cache_keyword, params, uniform)


def _grouped_prompts(prompts, pad_token_id: int, group_size: int, device: torch.device) -> tuple[Tensor, Tensor, Tensor]:
    """(prompt_ids, prompt_mask, group_index): each prompt left-padded and repeated G times. Shapes: (B, P), (B, P), (B,)."""
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    prompt_ids, prompt_mask = (t.to(device) for t in prompts) if isinstance(prompts, tuple) else left_pad(prompts, pad_token_id, device)
    group_index = torch.arange(prompt_ids.shape[0], device=device).repeat_interleave(group_size)  # (B,)
    return prompt_ids.repeat_interleave(group_size, dim=0), prompt_mask.repeat_interleave(group_size, dim=0).long(), group_index


def _uniforms(params: SamplingParams, noise: Tensor | None, generator: torch.Generator | None, batch: int, device: torch.device) -> Tensor | None:
    """The (N, B) uniforms of the draws: ``noise``, or drawn from ``generator``; None when greedy."""
    if params.greedy:
        return None
    if noise is None:
        noise = torch.rand((params.max_new_tokens, batch), generator=generator)  # (N, B)
    elif tuple(noise.shape) != (params.max_new_tokens, batch):
        raise ValueError(f"noise has shape {tuple(noise.shape)}, expected (max_new_tokens, B) = {(params.max_new_tokens, batch)}")
    return noise.to(device)


def _decode_steps(model: nn.Module, compile: bool, cuda_graphs: bool = False) -> tuple[_EagerSteps, contextlib.AbstractContextManager]:
    """The step functions of one call and the context they run in: compiled (the model's eager
    attention, which inductor fuses; the compiler's caches released after a compile; on a CUDA
    device with ``cuda_graphs``, the decode step replayed as a CUDA graph), or eager when
    ``compile`` is off or this torch lacks what the compiled step needs (:mod:`rlalign.lm.private`).
    Either way a grouped-query model's decode attention reads each key/value head once
    (:mod:`rlalign.lm.grouped_attention`); the prefill, before this, runs the model's own."""
    if not (compile and private.ready("compiled")):
        return _EagerSteps(cache_argument(model)), attention_kernel(model, grouped_kernel(model, None))
    from rlalign.lm.compiled import CompiledSteps, releasing_compiler_caches  # the compile machinery, only when asked for

    context = contextlib.ExitStack()
    context.enter_context(releasing_compiler_caches())
    context.enter_context(attention_kernel(model, grouped_kernel(model, "eager") or "eager"))
    graphs = cuda_graphs and next(model.parameters()).device.type == "cuda"
    return CompiledSteps(cache_argument(model), graphs), context


@torch.no_grad()
def sample(
    model: nn.Module,
    prompts: Sequence[Sequence[int]] | tuple[Tensor, Tensor],
    params: SamplingParams,
    pad_token_id: int,
    eos_token_ids: Sequence[int],
    group_size: int = 1,
    generator: torch.Generator | None = None,
    noise: Tensor | None = None,
    compile: bool = False,
    cuda_graphs: bool = False,
) -> Rollout:
    """Sample ``group_size`` completions per prompt. Returns a :class:`Rollout` of B = prompts x G rows.

    Args:
        model: a causal LM (transformers or peft-wrapped) taking a KV cache (``cache`` or ``past_key_values``) and ``logits_to_keep``.
        prompts: token lists, or (ids, mask) already left-padded, each (N, P).
        params: temperature / top-k / top-p / max_new_tokens.
        pad_token_id: id written after a row stops and in prompt padding.
        eos_token_ids: ids that end a completion (the EOS is kept, mask 1).
        group_size: G samples per prompt.
        generator: torch RNG for the draws (None = the global one); it gives (max_new_tokens, B)
            uniforms, drawn whether or not every row runs to the end.
        noise: those uniforms given instead (then ``generator`` is unused). Shape: (max_new_tokens, B).
        compile: run the decode step and the draw compiled (see the module docstring); the first
            call per batch size and cache bucket pays the compile.
        cuda_graphs: with ``compile`` on a CUDA device, replay the compiled decode step as a CUDA
            graph (inductor's cudagraph trees; the StaticCache's tensors have fixed addresses); the
            first steps of each batch size and bucket record it. Ignored on a CPU.
    """
    if not eos_token_ids:
        raise ValueError("eos_token_ids is empty: every completion would run to max_new_tokens")
    device = next(model.parameters()).device
    prompt_ids, prompt_mask, group_index = _grouped_prompts(prompts, pad_token_id, group_size, device)  # (B, P), (B, P), (B,)
    (batch, prompt_len), steps = prompt_ids.shape, params.max_new_tokens
    noise = _uniforms(params, noise, generator, batch, device)  # (N, B) or None
    causal_lm = unwrap_causal_lm(model)
    dtype = next(causal_lm.parameters()).dtype
    # Under torch.autocast keys (after RoPE) and values reach the cache in different dtypes, which a
    # StaticCache (one dtype, allocated on first use) rejects; a DynamicCache grows with the sequence.
    autocast = torch.is_autocast_enabled(device.type)
    if compile and autocast:
        raise ValueError("sample(compile=True) needs a StaticCache, which torch.autocast rules out: sample from a model held in the low dtype instead")
    slots = cache_bucket(prompt_len + steps) if compile else prompt_len + steps  # rounded up: prompts of nearby lengths share a compiled step
    cache = None if autocast else _static_cache(causal_lm.config, slots)
    growing = cache is None  # a DynamicCache: the mask handed to the model covers the keys so far, not every slot
    cache = DynamicCache() if growing else cache
    window = _sliding_window(causal_lm.config, prompt_len + steps)  # None unless a sliding window is shorter than the sequence
    by_layer_type = _layer_types(causal_lm.config, window)
    mask = _DecodeMask(prompt_mask, slots, dtype, window, by_layer_type)
    eos = torch.as_tensor(list(eos_token_ids), device=device)
    check_every = 8 if device.type == "cuda" else 1  # "all rows finished?" costs a device sync on GPUs

    completion_ids = torch.full((batch, steps), pad_token_id, dtype=torch.long, device=device)  # (B, N)
    completion_mask = torch.zeros((batch, steps), dtype=torch.long, device=device)  # (B, N)
    logprobs = torch.zeros((batch, steps), dtype=torch.float32, device=device)  # (B, N)
    finished = torch.zeros(batch, dtype=torch.bool, device=device)  # (B,)
    next_position = prompt_mask.sum(-1, keepdim=True)  # (B, 1): position of the first completion token
    rows = _prompt_rows(causal_lm, prompt_mask[::group_size])  # prompts side by side in fewer rows, or None
    logits = _prefill(model, prompt_ids, prompt_mask, group_size, cache, slots, dtype, window, by_layer_type, rows)  # (B, V)
    fns, context = _decode_steps(causal_lm, compile, cuda_graphs)
    with context, contextlib.ExitStack() as stance:
        token, token_logp = fns.draw(logits, params, None if noise is None else noise[0])  # (B,), (B,): the first token, from the prefill's logits
        for t in range(steps):
            if fns.compiled and t == 2:  # the decode step has passed its full guards twice (the draw ran once, before the loop)
                stance.enter_context(torch.compiler.set_stance(skip_guard_eval_unsafe=True))
            alive = ~finished  # (B,)
            token = torch.where(alive, token, pad_token_id)
            completion_ids[:, t], completion_mask[:, t], logprobs[:, t] = token, alive.long(), torch.where(alive, token_logp, 0.0)
            finished = finished | torch.isin(token, eos)
            if t == steps - 1 or ((t + 1) % check_every == 0 and bool(finished.all())):
                break
            mask.reveal(t)
            step_mask = mask.for_model(prompt_len + t + 1 if growing else slots)
            token, token_logp = fns.decode(model, token, step_mask, next_position + t, cache, params, None if noise is None else noise[t + 1])  # (B,), (B,)

    used = int(completion_mask.any(0).nonzero().max()) + 1  # drop trailing all-padding columns
    return Rollout(prompt_ids, prompt_mask, completion_ids[:, :used], completion_mask[:, :used], logprobs[:, :used], group_index, ~finished)
