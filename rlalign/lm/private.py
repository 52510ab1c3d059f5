"""Every private torch / transformers symbol rlalign's CPU speed machinery touches, in one place.

The plain path (loading, LoRA, the reference, the eager decode loop, masks, log-probs) uses public
APIs, apart from reading a model's ``config._attn_implementation`` (and asking its
``_can_set_attn_implementation`` where that exists) to switch attention kernels. The fast path, :mod:`rlalign.lm.packed` (oneDNN's blocked weights) and
:mod:`rlalign.lm.compiled` (the compiled decode step and its compiler workarounds), and the packed
rows of the training passes (:mod:`rlalign.core.packing`, which need transformers' masks to tell
packed rows apart) rely on the symbols below. :func:`ready` checks a feature's symbols against the installed versions: where one
is missing, the feature turns itself off with one warning and the plain path runs instead.
"""

from __future__ import annotations

import functools
import importlib
import warnings

__all__ = ["PRIVATE_SYMBOLS", "resolve", "missing", "ready"]

# feature -> the symbols it needs, as "module:attribute.path"
PRIVATE_SYMBOLS: dict[str, tuple[str, ...]] = {
    "packed": (  # rlalign.lm.packed: linear weights in oneDNN's blocked layout
        "torch:ops.mkldnn._reorder_linear_weight",
        "torch:ops.mkldnn._linear_pointwise",
        "torch:ops.mkldnn._is_mkldnn_bf16_supported",
        "torch:ops.mkldnn._is_mkldnn_fp16_supported",
    ),
    "compiled": (  # rlalign.lm.compiled: the compiled decode step, its recompile limit and stance, the compiler caches
        "torch._dynamo.exc:FailOnRecompileLimitHit",
        "torch._dynamo.utils:counters",
        "torch._subclasses.fake_tensor:FakeTensorMode",
        "torch.compiler:set_stance",
    ),
    "cpu_decode_tuning": (  # rlalign.lm.compiled: an inductor option for the CPU decode step's attention; without it
        "torch._inductor.config:realize_cpu_opcount_threshold",  # the step compiles with inductor's defaults (torch 2.11 lacks it)
    ),
    "packed_rows": (  # rlalign.lm.logprobs: rows packed end to end, kept apart by their position ids restarting at 0
        "transformers.masking_utils:find_packed_sequence_indices",  # (the masks of an attention_mask-less forward)
    ),
    "static_cache": (  # rlalign.lm.sampling: a StaticCache whose sliding-window layers keep every key
        "transformers.cache_utils:StaticLayer",
        "transformers.cache_utils:StaticSlidingWindowLayer",
    ),
}


def resolve(symbol: str):
    """The object named ``"module:attribute.path"``, or None when this version lacks it."""
    module_name, _, path = symbol.partition(":")
    try:
        obj = importlib.import_module(module_name)
        for attr in path.split("."):
            obj = getattr(obj, attr)
    except (ImportError, AttributeError, RuntimeError):  # torch.ops raises RuntimeError for an unknown op
        return None
    return obj


def missing(feature: str) -> list[str]:
    """The symbols of ``feature`` (a key of :data:`PRIVATE_SYMBOLS`) the installed versions lack."""
    return [symbol for symbol in PRIVATE_SYMBOLS[feature] if resolve(symbol) is None]


@functools.cache
def ready(feature: str) -> bool:
    """Whether every symbol of ``feature`` is there; if not, warn once (per process) and return False."""
    gone = missing(feature)
    if gone:
        warnings.warn(f"rlalign's {feature} fast path is off: this torch / transformers lacks {', '.join(gone)}; the plain path runs", RuntimeWarning, stacklevel=2)
    return not gone
