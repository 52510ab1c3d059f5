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
most ``RECOMPILE_LIMIT`` per process; past that a call warns and runs eager). From the third
step of a call on, ``torch.compiler.set_stance(skip_guard_eval_unsafe=True)`` skips the guards
that cannot tell the process's compiled versions apart: the decode step has by then passed its
full guards twice (the first draw runs before the loop, with its full guards), and the model, the
cache object and the shapes stay the same; a guard that would
fail raises rather than run a wrong version. The graph reads the parameters when it runs, so
in-place weight updates need no recompile. Inside the compiled step the model runs its "eager"
attention, which inductor fuses (:func:`_attention_implementation`). This removes most of
transformers' per-module Python cost, which is what a small model's step is made of; a model whose
decode step is bound by reading its weights from memory (SmolLM2-135M at batch 8 on one CPU core)
gains most from a half-precision copy with packed weights (``rlalign.lm.models.PackedLinear``).
Not under ``torch.autocast``, which rules out the StaticCache.

Sliding-window attention (Mistral, Qwen2 with ``use_sliding_window``, Gemma 2/3, Phi-3): every
layer keeps all keys in the cache, and when the window is shorter than the sequence the sampler
hands the model a second mask that also hides the keys outside the window (key slot k is seen from
query slot q when q - window < k <= q, transformers' rule), for all layers or by layer type. The
cache then holds every position, not just the window: more KV memory than ``generate`` for
sequences much longer than the window.

Sampling: logits z / tau, then optional top-k (keep the k largest) and top-p (keep the smallest
set of tokens whose probability reaches p; Holtzman et al. 2020), then a categorical draw by
inverse CDF: token = the first y with F(y) > u * F(V), F the cumulative sum of the probabilities,
u ~ U[0, 1) one number per row and step (found in two levels, blocks then tokens:
:func:`inverse_cdf_draw`). The uniforms are drawn up front, (N, B) from the
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
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from transformers import DynamicCache, StaticCache
from transformers.cache_utils import StaticLayer, StaticSlidingWindowLayer

from rlalign.lm.models import cache_argument, position_ids_from_mask, releasing_compiler_caches, unwrap_causal_lm
from rlalign.lm.rollout import Rollout

__all__ = ["SamplingParams", "left_pad", "filter_logits", "inverse_cdf_draw", "cache_bucket", "pack_prompts", "sample"]

RECOMPILE_LIMIT = 64  # compiled versions kept of the decode step and of the draw (torch's default is 8)


@dataclass(frozen=True)
class SamplingParams:
    """How to draw completions. ``temperature=0`` means greedy; ``top_k=0`` and ``top_p=1`` are off."""

    max_new_tokens: int = 64
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1] (1 = off), got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


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


def filter_logits(scaled_logits: Tensor, top_k: int = 0, top_p: float = 1.0) -> Tensor:
    """Set logits outside the top-k / top-p (nucleus) set to -inf. Shape: (B, V) -> (B, V).

    Top-p keeps token i when the probability mass of the tokens ranked strictly above it is < p,
    so the most likely token always stays.
    """
    out = scaled_logits
    if top_k > 0 and top_k < out.shape[-1]:
        kth = torch.topk(out, top_k, dim=-1).values[:, -1:]  # (B, 1)
        out = out.masked_fill(out < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(out, dim=-1, descending=True)  # (B, V)
        probs = torch.softmax(sorted_logits, dim=-1)
        mass_above = torch.cumsum(probs, dim=-1) - probs  # (B, V)
        drop_sorted = mass_above >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        out = out.masked_fill(drop, float("-inf"))
    return out


def _prefill_mask(prompt_valid: Tensor, total: int, dtype: torch.dtype, window: int | None = None) -> Tensor:
    """Additive mask (B, 1, P, L) over the L = P + N cache slots: query q sees key k <= q when k is
    a real prompt token (0 where allowed, the dtype's minimum elsewhere); with a sliding ``window``
    also only k > q - window (transformers' sliding-window rule, on cache slots).

    A padding query also sees itself, so no softmax row is empty (its output is never used).
    """
    prompt_len = prompt_valid.shape[1]
    key_valid = torch.ones((prompt_valid.shape[0], total), dtype=torch.bool, device=prompt_valid.device)  # (B, L)
    key_valid[:, :prompt_len] = prompt_valid
    q = torch.arange(prompt_len, device=prompt_valid.device)[:, None]  # (P, 1)
    k = torch.arange(total, device=prompt_valid.device)[None, :]  # (1, L)
    seen = (k <= q) if window is None else (k <= q) & (k > q - window)  # (P, L)
    allowed = (seen[None] & key_valid[:, None, :]) | (k == q)[None]  # (B, P, L)
    return _additive_mask(allowed, dtype)  # (B, 1, P, L)


def _additive_mask(allowed: Tensor, dtype: torch.dtype) -> Tensor:
    """0 where ``allowed`` (B, Q, K), the dtype's minimum elsewhere, as the model's (B, 1, Q, K) attention mask."""
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(~allowed, torch.finfo(dtype).min)[:, None]


def _model_mask(full: Tensor, windowed: Tensor | None, by_layer_type: bool) -> Tensor | dict[str, Tensor]:
    """The ``attention_mask`` argument: the full-attention mask, or with a sliding window the windowed
    one (every layer slides, e.g. Mistral), or both by layer type (models with ``config.layer_types``
    of full and sliding layers, e.g. Qwen2, Gemma 2/3, which take a prepared mask per type; other
    layer types are refused by :func:`_layer_types`)."""
    if windowed is None:
        return full
    return {"full_attention": full, "sliding_attention": windowed} if by_layer_type else windowed


def _layer_types(config, window: int | None) -> bool:
    """Whether the model takes its masks by layer type (``config.layer_types``); with a window, only
    full and sliding layers are supported (a KeyError deep in the model otherwise)."""
    layer_types = getattr(config.get_text_config(decoder=True), "layer_types", None)
    if layer_types is None:
        return False
    other = sorted(set(layer_types) - {"full_attention", "sliding_attention"})
    if window is not None and other:
        raise ValueError(f"the sampler's sliding-window masks cover full and sliding attention layers; this model also has {other}")
    return True


def pack_prompts(lengths: Sequence[int], width: int) -> list[list[int]]:
    """Prompt indices by row, the prompts of a row together no longer than ``width`` tokens: first-fit
    decreasing bin packing (at most 11/9 of the fewest rows plus 6/9; Dosa 2007). The packed
    prefill (:func:`_prefill`) runs these rows of width P, the longest prompt, instead of one
    left-padded row per prompt: fewer tokens, and no more attention scores (R P^2 <= N P^2)."""
    rows: list[list[int]] = []
    room: list[int] = []
    for index in sorted(range(len(lengths)), key=lambda n: -lengths[n]):
        row = next((r for r, free in enumerate(room) if free >= lengths[index]), len(rows))
        if row == len(rows):
            rows.append([])
            room.append(width)
        rows[row].append(index)
        room[row] -= lengths[index]
    return rows


def _packed_mask(segment: Tensor, position: Tensor, dtype: torch.dtype, window: int | None = None) -> Tensor:
    """Additive mask (R, 1, T, T) over rows of prompts packed side by side: token i sees token j of
    its row when both belong to the same prompt (``segment`` (R, T), unique per padding token) and j
    is not after i (``position`` (R, T), the position within the prompt); with a sliding ``window``
    also only position_j > position_i - window (the rule of :func:`_prefill_mask`, whose slots differ by positions)."""
    seen = (segment[:, :, None] == segment[:, None, :]) & (position[:, None, :] <= position[:, :, None])  # (R, T, T)
    if window is not None:
        seen &= position[:, None, :] > position[:, :, None] - window
    return _additive_mask(seen, dtype)  # (R, 1, T, T)


@contextlib.contextmanager
def _lm_head_on(causal_lm: nn.Module, positions: Tensor) -> Iterator[list[bool]]:
    """Inside the block the LM head of ``causal_lm`` sees only the hidden states at ``positions``
    (K,), flat indices over (batch, sequence), as one row (1, K, hidden): logits (1, K, V) for the
    last tokens of packed prompts, which ``logits_to_keep`` (one set of columns for every row)
    cannot pick. Yields a list whose one entry says whether the head ran (a model that multiplies
    by its embedding matrix itself never calls it: its logits cover every position)."""
    ran = [False]

    def pick(module: nn.Module, args: tuple) -> tuple:
        ran[0] = True
        return (args[0].flatten(0, -2)[positions][None], *args[1:])

    handle = causal_lm.get_output_embeddings().register_forward_pre_hook(pick)
    try:
        yield ran
    finally:
        handle.remove()


def _prefill(
    model: nn.Module,
    prompt_ids: Tensor,
    prompt_mask: Tensor,
    group_size: int,
    cache: DynamicCache | StaticCache,
    total: int,
    dtype: torch.dtype,
    window: int | None = None,
    by_layer_type: bool = False,
    rows: list[list[int]] | None = None,
) -> Tensor:
    """Run each distinct prompt once (rows 0, G, 2G, ... of the B = N G rows), fill ``cache`` with the
    prompt keys and values of all B rows, and return the logits at the last prompt position. Shape: (B, V).

    With G > 1 the N prompts run into a DynamicCache that is then repeated G-fold
    (``batch_repeat_interleave``) and, for a StaticCache, written into its first P slots: the prefill
    does N rows of work instead of B.
    ``rows`` (:func:`_prompt_rows`): the prompts run side by side in these rows, each token seeing
    its own prompt (:func:`_packed_mask`), and their keys and values are then laid out left-padded in
    (N, heads, P, head dim), zeros on padding (which the decode masks hide). For example 32 prompts
    of 4-12 tokens (251 in all) fit in 23 rows of 12 instead of 32; rows of the longest prompt's
    width, not one row of all tokens, keep the attention's (L, L) scores small.
    """
    distinct = slice(None, None, group_size)
    ids, mask = prompt_ids[distinct], prompt_mask[distinct]  # (N, P)
    if rows is not None:
        return _packed_prefill(model, ids, mask, rows, group_size, cache, dtype, window, by_layer_type)
    prompt_len = ids.shape[1]
    prefill_cache = cache if isinstance(cache, DynamicCache) or group_size == 1 else DynamicCache()
    visible = total if isinstance(prefill_cache, StaticCache) else prompt_len  # key columns: the cache's length
    windowed = None if window is None else _prefill_mask(mask.bool(), total, dtype, window)[..., :visible]
    logits = model(
        input_ids=ids,
        attention_mask=_model_mask(_prefill_mask(mask.bool(), total, dtype)[..., :visible], windowed, by_layer_type),
        position_ids=position_ids_from_mask(mask),
        **{cache_argument(model): prefill_cache},
        use_cache=True,
        logits_to_keep=torch.tensor([prompt_len - 1], device=ids.device),  # an index, not 1: a contiguous LM-head input (rlalign.lm.logprobs)
    ).logits[:, -1, :]  # (N, V)
    if group_size > 1:
        prefill_cache.batch_repeat_interleave(group_size)  # (N, ...) -> (B, ...) in every layer
        if prefill_cache is not cache:
            positions = torch.arange(prompt_len, device=ids.device)
            for layer_idx, layer in enumerate(prefill_cache.layers):
                cache.update(layer.keys, layer.values, layer_idx, {"cache_position": positions})
    return logits.repeat_interleave(group_size, dim=0)  # (B, V)


def _packed_prefill(
    model: nn.Module,
    ids: Tensor,
    mask: Tensor,
    rows: list[list[int]],
    group_size: int,
    cache: DynamicCache | StaticCache,
    dtype: torch.dtype,
    window: int | None,
    by_layer_type: bool,
) -> Tensor:
    """:func:`_prefill` of the N distinct prompts ``ids``, ``mask`` (N, P) side by side in ``rows`` (prompt indices). Shape: (B, V)."""
    width = ids.shape[1]
    valid = mask.bool()  # (N, P)
    lengths = valid.sum(-1).tolist()
    row_of, start_of = [0] * len(lengths), [0] * len(lengths)
    for row, members in enumerate(rows):
        start = 0
        for index in members:
            row_of[index], start_of[index] = row, start
            start += lengths[index]
    within = valid.long().cumsum(-1) - 1  # (N, P) position of a slot's token in its prompt (-1 before it)
    flat = torch.tensor(row_of, device=ids.device)[:, None] * width + torch.tensor(start_of, device=ids.device)[:, None] + within  # (N, P) place in the (R, P) grid
    grid = len(rows) * width
    packed_ids = ids.new_zeros(grid).index_put_((flat[valid],), ids[valid]).view(len(rows), width)  # (R, P)
    position = within.new_zeros(grid).index_put_((flat[valid],), within[valid]).view(len(rows), width)  # (R, P)
    segment = -torch.arange(1, grid + 1, device=ids.device)  # a padding token is its own segment: it sees itself only
    prompt_index = torch.arange(ids.shape[0], device=ids.device)[:, None].expand_as(ids)
    segment = segment.index_put_((flat[valid],), prompt_index[valid]).view(len(rows), width)  # (R, P)
    windowed = None if window is None else _packed_mask(segment, position, dtype, window)
    packed_cache = DynamicCache()
    last = flat[:, -1]  # (N,) each prompt's last token: its slot P - 1
    with _lm_head_on(unwrap_causal_lm(model), last) as head_ran:
        logits = model(
            input_ids=packed_ids,
            attention_mask=_model_mask(_packed_mask(segment, position, dtype), windowed, by_layer_type),
            position_ids=position,
            **{cache_argument(model): packed_cache},
            use_cache=True,
            logits_to_keep=0,  # every position to the LM head, where _lm_head_on picks N of them
        ).logits
    logits = logits[0] if head_ran[0] else logits.flatten(0, -2)[last]  # (N, V)
    padding = ~valid[:, None, :, None]  # (N, 1, P, 1)
    slots = torch.arange(width, device=ids.device)
    source = flat.clamp(min=0)  # (N, P); any place on padding
    for layer_idx, layer in enumerate(packed_cache.layers):
        keys, values = (
            t.transpose(0, 1).flatten(1, 2)[:, source].transpose(0, 1).masked_fill(padding, 0).repeat_interleave(group_size, dim=0) for t in (layer.keys, layer.values)
        )  # (R, H, P, D) -> (H, R P, D) -> (N, H, P, D) -> (B, H, P, D)
        cache.update(keys, values, layer_idx, {"cache_position": slots})
    return logits.repeat_interleave(group_size, dim=0)  # (B, V)


def _prompt_rows(causal_lm: nn.Module, prompt_mask: Tensor) -> list[list[int]] | None:
    """The rows of :func:`pack_prompts` for the N prompts of ``prompt_mask`` (N, P) when they are
    fewer than N, else None: the padded prefill (also for an empty prompt, or a model without an
    output-embeddings module)."""
    lengths = prompt_mask.sum(-1).tolist()
    if len(lengths) < 2 or min(lengths) == 0 or causal_lm.get_output_embeddings() is None:
        return None
    rows = pack_prompts(lengths, prompt_mask.shape[1])
    return rows if len(rows) < len(lengths) else None


CDF_BLOCK = 256  # tokens per block of the two-level inverse CDF (SmolLM2's 49152-token vocabulary: 192 blocks)


def _last_positive(weights: Tensor) -> Tensor:
    """Index of the last entry > 0 along the last axis (0 if none). Shape: (..., K) -> (...)."""
    index = torch.arange(weights.shape[-1], device=weights.device)  # (K,)
    return torch.where(weights > 0, index, 0).amax(-1)


def inverse_cdf_draw(weights: Tensor, uniform: Tensor, block: int = CDF_BLOCK) -> Tensor:
    """The first y with F(y) > u * F(V), F the cumulative sum of ``weights`` (B, V) (non-negative,
    not normalised, at least one > 0 per row) and u = ``uniform`` (B,) in [0, 1): a categorical draw
    with probabilities weights / sum. Returns (B,) int64.

    Two levels, so no cumulative sum runs over the whole vocabulary (a sequential scan, ~1 ns an
    entry on one core): the block sums' cumulative sum picks the block where F crosses u * F(V),
    then the cumulative sum inside that block picks the token. Where float round-off would let the
    crossing fall past the last token of positive weight (u * F(V) rounded up to F(V), or a block
    sum and its cumulative sum that differ in the last bit), the draw is that token: a
    zero-weight token (filtered out, or padding of the last block) is never drawn."""
    batch, vocab = weights.shape
    if vocab % block:
        weights = nn.functional.pad(weights, (0, -vocab % block))  # zero weights past V
    blocks = weights.view(batch, -1, block)  # (B, K, block)
    block_cdf = blocks.sum(-1).cumsum(-1)  # (B, K)
    target = uniform * block_cdf[:, -1]  # (B,)
    chosen = torch.searchsorted(block_cdf, target[:, None], right=True).squeeze(-1)  # (B,): first block with F(end) > target
    chosen = torch.minimum(chosen, _last_positive(block_cdf.diff(dim=-1, prepend=block_cdf.new_zeros(batch, 1))))
    rows = torch.arange(batch, device=weights.device)
    inside = blocks[rows, chosen]  # (B, block)
    before = torch.where(chosen > 0, block_cdf[rows, (chosen - 1).clamp(min=0)], 0.0)  # (B,): F at the end of the previous block
    offset = torch.searchsorted(inside.cumsum(-1), (target - before)[:, None], right=True).squeeze(-1)  # (B,)
    offset = torch.minimum(offset, _last_positive(inside))
    return chosen * block + offset


def _draw(logits: Tensor, params: SamplingParams, uniform: Tensor | None) -> tuple[Tensor, Tensor]:
    """Next token (B,) and its log-prob under softmax(logits / tau) (B,), from logits (B, V) and
    one uniform in [0, 1) per row (B,) (None when greedy)."""
    logits = logits.float()
    if params.greedy:
        token = logits.argmax(-1)  # (B,)
        return token, torch.log_softmax(logits, -1).gather(-1, token[:, None]).squeeze(-1)
    scaled = logits if params.temperature == 1 else logits / params.temperature  # (B, V); a pass less at tau = 1 (1.7 ms at B = 32, V = 49152)
    probs = torch.softmax(scaled, -1)  # (B, V)
    weights = probs
    if params.top_k or params.top_p < 1:
        weights = probs.masked_fill(filter_logits(scaled, params.top_k, params.top_p).isneginf(), 0.0)  # a filtered token is never drawn
    token = inverse_cdf_draw(weights, uniform)  # (B,)
    return token, probs.gather(-1, token[:, None]).squeeze(-1).log()  # log p of a drawn token: p > 0, round-off ~1e-7 relative


def _next_logits(
    model: nn.Module, token: Tensor, step_mask: Tensor | dict[str, Tensor], position_ids: Tensor, cache: DynamicCache | StaticCache, cache_keyword: str
) -> Tensor:
    """The logits (B, V) after feeding ``token`` (B,) at ``position_ids`` (B, 1);
    ``step_mask``: the additive mask (B, 1, 1, L), or one per layer type (:func:`_model_mask`);
    ``cache_keyword``: :func:`~rlalign.lm.models.cache_argument` of the model (found outside the compiled step)."""
    return model(
        input_ids=token[:, None], attention_mask=step_mask, position_ids=position_ids, use_cache=True, logits_to_keep=1, **{cache_keyword: cache}
    ).logits[:, -1, :]


def _decode_step(
    model: nn.Module,
    token: Tensor,
    step_mask: Tensor | dict[str, Tensor],
    position_ids: Tensor,
    cache: DynamicCache | StaticCache,
    cache_keyword: str,
    params: SamplingParams,
    uniform: Tensor | None,
) -> tuple[Tensor, Tensor]:
    """One decode step: feed ``token`` (B,) (:func:`_next_logits`) and draw the next token from the
    logits (:func:`_draw`). Returns the token (B,) and its log-prob (B,). Compiled, the step and the
    draw are one call: one guard check and one graph wrapper a step instead of two, with the same
    tokens and log-probs."""
    return _draw(_next_logits(model, token, step_mask, position_ids, cache, cache_keyword), params, uniform)


# Inductor lowers a one-query-row attention matmul on the CPU to a multiply-and-sum that inlines its
# inputs, and so recomputed the query's rotary embedding (a cos and a sin an element) for every key
# position: a pointwise input of more than 4 ops is computed once into a buffer instead, which makes
# that attention kernel several times faster.
_DECODE_INDUCTOR_OPTIONS = {"realize_cpu_opcount_threshold": 4}


class _CompiledOnFirstCall:
    """``torch.compile(fn, **options)``, made at the first call. Calling ``torch.compile`` imports
    dynamo's backends (AOT autograd, its partitioner, networkx: ~380 modules), which a process that
    only samples eagerly never needs, and whose memory it would carry for nothing."""

    def __init__(self, fn: Callable, **options):
        self.fn, self.options, self.compiled = fn, options, None

    def __call__(self, *args):
        if self.compiled is None:
            self.compiled = torch.compile(self.fn, **self.options)
        return self.compiled(*args)


_compiled_decode_step = _CompiledOnFirstCall(_decode_step, fullgraph=True, dynamic=False, recompile_limit=RECOMPILE_LIMIT, options=_DECODE_INDUCTOR_OPTIONS)
_compiled_draw = _CompiledOnFirstCall(_draw, fullgraph=True, dynamic=False, recompile_limit=RECOMPILE_LIMIT)


class _StepFunctions:
    """The decode step and the draw of one :func:`sample` call: compiled, or eager. When torch has
    compiled RECOMPILE_LIMIT versions of one of them in this process it warns and the call goes on
    eager (no half-finished step: the limit is checked before a compiled version runs)."""

    def __init__(self, compiled: bool, cache_keyword: str):
        self.compiled = compiled
        self.cache_keyword = cache_keyword  # cache_argument(model): inspect has no place in a compiled step

    def _call(self, compiled_fn, eager_fn, *args):
        if self.compiled:
            try:
                return compiled_fn(*args)
            except torch._dynamo.exc.FailOnRecompileLimitHit:
                warnings.warn(
                    f"sample(compile=True): {RECOMPILE_LIMIT} compiled versions of the decode step exist in this process (one per batch "
                    "size, cache-length bucket, model dtype, attention kernel, ...); this call runs eager",
                    RuntimeWarning,
                    stacklevel=4,
                )
                self.compiled = False
        return eager_fn(*args)

    def draw(self, logits: Tensor, params: SamplingParams, uniform: Tensor | None) -> tuple[Tensor, Tensor]:
        return self._call(_compiled_draw, _draw, logits, params, uniform)

    def decode(
        self, model: nn.Module, token: Tensor, step_mask: Tensor | dict[str, Tensor], position_ids: Tensor, cache: DynamicCache | StaticCache,
        params: SamplingParams, uniform: Tensor | None,
    ) -> tuple[Tensor, Tensor]:
        return self._call(_compiled_decode_step, _decode_step, model, token, step_mask, position_ids, cache, self.cache_keyword, params, uniform)


@contextlib.contextmanager
def _attention_implementation(model: nn.Module, name: str) -> Iterator[None]:
    """``model`` (a transformers model) runs attention with implementation ``name`` inside the block,
    its own outside. The compiled decode step runs the model's "eager" attention (matmul, softmax,
    matmul), which inductor fuses into its own kernels, where SDPA's CPU kernel is slow for one
    query row on some CPUs. A model that cannot switch (no attention interface) keeps its own."""
    original = model.config._attn_implementation
    can_switch = getattr(model, "_can_set_attn_implementation", None)  # transformers' own check (not in every version)
    if original == name or can_switch is None or not can_switch():
        yield
        return
    model.set_attn_implementation(name)
    try:
        yield
    finally:
        model.set_attn_implementation(original)


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
    kinds = {type(layer).__name__ for layer in short if type(layer) is not StaticSlidingWindowLayer}
    windows = {layer.max_cache_len for layer in short}  # a sliding layer's size is min(window, length)
    if kinds or len(windows) > 1:
        raise ValueError(f"the sampler masks one sliding window over plain attention layers; this model has {sorted(kinds) or sorted(windows)} at {length} positions")
    return windows.pop()


def _static_cache(config, slots: int) -> StaticCache:
    """A StaticCache of ``slots`` positions for a model of ``config``, its sliding-window layers made
    full-attention layers: they keep all keys, and the sampler's mask hides those outside the window
    (transformers' sliding layer keeps a rolling buffer and its write position in a Python int,
    which a compiled decode step would have to be recompiled for at every step)."""
    cache = StaticCache(config=config, max_cache_len=slots)  # tensors are allocated on first use
    for index, layer in enumerate(cache.layers):
        if type(layer) is StaticSlidingWindowLayer:
            cache.layers[index] = StaticLayer(max_cache_len=slots)
    return cache


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
    """
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    if not eos_token_ids:
        raise ValueError("eos_token_ids is empty: every completion would run to max_new_tokens")
    device = next(model.parameters()).device
    if isinstance(prompts, tuple):
        prompt_ids, prompt_mask = (t.to(device) for t in prompts)
    else:
        prompt_ids, prompt_mask = left_pad(prompts, pad_token_id, device)
    group_index = torch.arange(prompt_ids.shape[0], device=device).repeat_interleave(group_size)  # (B,)
    prompt_ids = prompt_ids.repeat_interleave(group_size, dim=0)  # (B, P)
    prompt_mask = prompt_mask.repeat_interleave(group_size, dim=0).long()  # (B, P)
    batch, prompt_len = prompt_ids.shape
    steps = params.max_new_tokens
    length = prompt_len + steps
    total = cache_bucket(length) if compile else length  # cache slots; rounded up, prompts of nearby lengths share a compiled step
    check_every = 8 if device.type == "cuda" else 1  # "all rows finished?" costs a device sync on GPUs
    if params.greedy:
        noise = None
    elif noise is None:
        noise = torch.rand((steps, batch), generator=generator)  # (N, B)
    elif tuple(noise.shape) != (steps, batch):
        raise ValueError(f"noise has shape {tuple(noise.shape)}, expected (max_new_tokens, B) = {(steps, batch)}")
    noise = None if noise is None else noise.to(device)

    causal_lm = unwrap_causal_lm(model)
    dtype = next(causal_lm.parameters()).dtype
    # Under torch.autocast keys (after RoPE) and values reach the cache in different dtypes, which a
    # StaticCache (one dtype, allocated on first use) rejects; a DynamicCache grows with the sequence.
    autocast = torch.is_autocast_enabled(device.type)
    if compile and autocast:
        raise ValueError("sample(compile=True) needs a StaticCache, which torch.autocast rules out: sample from a model held in the low dtype instead")
    cache = DynamicCache() if autocast else _static_cache(causal_lm.config, total)
    window = _sliding_window(causal_lm.config, length)  # None unless a sliding window is shorter than the sequence
    by_layer_type = _layer_types(causal_lm.config, window)
    visible = (lambda n: n) if autocast else (lambda n: total)  # key columns the mask hands the model: the cache's length
    key_valid = prompt_mask.bool()  # (B, P)
    step_mask = torch.full((batch, 1, 1, total), torch.finfo(dtype).min, dtype=dtype, device=device)  # (B, 1, 1, L)
    step_mask[:, 0, 0, :prompt_len].masked_fill_(key_valid, 0.0)
    window_mask = None  # with a sliding window: step_mask without the keys at or before q - window, q the query's slot
    if window is not None:
        window_mask = step_mask.clone()
        window_mask[..., : max(prompt_len - window + 1, 0)] = torch.finfo(dtype).min  # out of the first decode query's window
    eos = torch.as_tensor(list(eos_token_ids), device=device)

    completion_ids = torch.full((batch, steps), pad_token_id, dtype=torch.long, device=device)  # (B, N)
    completion_mask = torch.zeros((batch, steps), dtype=torch.long, device=device)  # (B, N)
    logprobs = torch.zeros((batch, steps), dtype=torch.float32, device=device)  # (B, N)
    finished = torch.zeros(batch, dtype=torch.bool, device=device)  # (B,)
    next_position = prompt_mask.sum(-1, keepdim=True)  # (B, 1): position of the first completion token

    fns = _StepFunctions(compile, cache_argument(model))
    rows = _prompt_rows(causal_lm, prompt_mask[::group_size])  # prompts side by side in fewer rows, or None
    logits = _prefill(model, prompt_ids, prompt_mask, group_size, cache, total, dtype, window, by_layer_type, rows)  # (B, V)
    with contextlib.ExitStack() as stance:
        if compile:
            stance.enter_context(releasing_compiler_caches())
            stance.enter_context(_attention_implementation(causal_lm, "eager"))
        token, token_logp = fns.draw(logits, params, None if noise is None else noise[0])  # (B,), (B,): the first token, from the prefill's logits
        for t in range(steps):
            if fns.compiled and t == 2:  # the decode step has passed its full guards twice (the draw ran once, before the loop)
                stance.enter_context(torch.compiler.set_stance(skip_guard_eval_unsafe=True))
            alive = ~finished  # (B,)
            token = torch.where(alive, token, pad_token_id)
            completion_ids[:, t] = token
            completion_mask[:, t] = alive.long()
            logprobs[:, t] = torch.where(alive, token_logp, 0.0)
            finished = finished | torch.isin(token, eos)
            if t == steps - 1 or ((t + 1) % check_every == 0 and bool(finished.all())):
                break
            step_mask[:, 0, 0, prompt_len + t] = 0.0  # the token just drawn becomes a visible key
            if window_mask is not None:
                window_mask[:, 0, 0, prompt_len + t] = 0.0
                if prompt_len + t - window >= 0:
                    window_mask[:, 0, 0, prompt_len + t - window] = torch.finfo(dtype).min  # leaves the window of query slot prompt_len + t
            columns = visible(prompt_len + t + 1)
            attention_mask = _model_mask(step_mask[..., :columns], None if window_mask is None else window_mask[..., :columns], by_layer_type)
            token, token_logp = fns.decode(model, token, attention_mask, next_position + t, cache, params, None if noise is None else noise[t + 1])  # (B,), (B,)

    used = int(completion_mask.any(0).nonzero().max()) + 1  # drop trailing all-padding columns
    return Rollout(
        prompt_ids=prompt_ids,
        prompt_mask=prompt_mask,
        completion_ids=completion_ids[:, :used],
        completion_mask=completion_mask[:, :used],
        logprobs=logprobs[:, :used],
        group_index=group_index,
        truncated=~finished,
    )
