"""How a loaded model runs its forwards: transformers' attention kernel for a block, activation
checkpointing, and eval mode for sampling and no-grad passes; for a causal LM (peft or not) or a
:class:`rlalign.lm.heads.ScalarHeadModel`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from rlalign.config import ConfigError
from rlalign.lm.heads import ScalarHeadModel
from rlalign.lm.models import unwrap_causal_lm

__all__ = [
    "attention_kernel",
    "enable_gradient_checkpointing",
    "checkpointing_enabled",
    "is_checkpointing",
    "evaluating",
]


@contextlib.contextmanager
def attention_kernel(model: nn.Module, attn_implementation: str | None) -> Iterator[nn.Module]:
    """``model`` with transformers' attention kernel set to ``attn_implementation`` for the block
    (None: unchanged), then set back: e.g. SDPA for a decode loop and eager for training forwards.
    A model that says it cannot switch (transformers' ``_can_set_attn_implementation``, where that
    exists) keeps its own."""
    causal_lm = unwrap_causal_lm(model)
    before = causal_lm.config._attn_implementation
    can_switch = getattr(causal_lm, "_can_set_attn_implementation", lambda: True)
    if attn_implementation is None or attn_implementation == before or not can_switch():
        yield model
        return
    causal_lm.set_attn_implementation(attn_implementation)
    try:
        yield model
    finally:
        causal_lm.set_attn_implementation(before)


def enable_gradient_checkpointing(model: nn.Module) -> nn.Module:
    """Recompute each decoder layer's activations in backward instead of keeping them (transformers'
    activation checkpointing, non-reentrant): the same gradients for less memory and about one more
    forward of compute. ``model``: a causal LM (peft or not) or a :class:`ScalarHeadModel`. It acts in
    train mode with grad enabled only, where it drops the KV cache, so the trainers sample and run
    their no-grad passes in eval mode (:func:`evaluating`) and do not share prompts in a checkpointed
    training forward (:func:`is_checkpointing`)."""
    backbone = model.backbone if isinstance(model, ScalarHeadModel) else unwrap_causal_lm(model)
    if not getattr(backbone, "supports_gradient_checkpointing", False):
        raise ConfigError(f"model.gradient_checkpointing: {type(backbone).__name__} does not support activation checkpointing")
    if hasattr(backbone, "activation_checkpointing_enable"):
        backbone.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:  # transformers before its rename (5.17 has only the older name)
        backbone.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


def checkpointing_enabled(model: nn.Module) -> bool:
    """Whether ``model`` has activation checkpointing turned on (:func:`enable_gradient_checkpointing`),
    whatever its mode: its training forwards (train mode, grad enabled) then recompute activations.
    ``model`` may be in DistributedDataParallel."""
    model = model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model
    backbone = model.backbone if isinstance(model, ScalarHeadModel) else unwrap_causal_lm(model)
    flag = "is_activation_checkpointing" if hasattr(type(backbone), "is_activation_checkpointing") else "is_gradient_checkpointing"  # renamed in transformers 5
    return bool(getattr(backbone, flag, False))


def is_checkpointing(model: nn.Module) -> bool:
    """Whether a forward of ``model`` now recomputes activations in backward (and so drops a KV cache):
    checkpointing on, train mode, grad enabled."""
    return model.training and torch.is_grad_enabled() and checkpointing_enabled(model)


@contextlib.contextmanager
def evaluating(model: nn.Module) -> Iterator[nn.Module]:
    """``model`` in eval mode inside the block, its mode restored after: a trained model's sampling and
    no-grad passes keep their KV cache under gradient checkpointing (dropout is 0 either way)."""
    was_training = model.training
    model.eval()
    try:
        yield model
    finally:
        model.train(was_training)
