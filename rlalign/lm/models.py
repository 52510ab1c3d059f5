"""Load a policy, a frozen reference and the tokenizer from any HF causal-LM checkpoint.

    policy = load_policy("runs/sft/final", dtype="bfloat16", lora=LoraConfig(r=16))
    with reference_policy(policy) as ref:         # LoRA: the same weights with adapters disabled
        ref_logp = rollout_logprobs(ref, rollout)     # rlalign.lm.logprobs

The reward model and the critic (a scalar head on the backbone) are :mod:`rlalign.lm.heads`; the
switches of a loaded model's forwards (attention kernel, activation checkpointing, eval mode) are
:mod:`rlalign.lm.model_modes`.

Dropout is switched off everywhere (config fields and modules): RL compares log-probs of the
same tokens across forward passes (ratio = 1 on the first minibatch), which dropout would break.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import inspect
import json
import os
import re
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Literal

import torch
from pydantic import Field
from safetensors import safe_open
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PretrainedConfig, PreTrainedModel, PreTrainedTokenizerBase

from rlalign.config import Config
from rlalign.errors import RLAlignError

__all__ = [
    "DType",
    "LoraConfig",
    "torch_dtype",
    "ModelLoadError",
    "resolve_model_path",
    "check_checkpoint_dir",
    "context_length",
    "adapter_base",
    "load_tokenizer",
    "disable_dropout",
    "dropout_as_loaded",
    "load_policy",
    "load_reference",
    "apply_lora",
    "set_adapter_dropout",
    "reference_policy",
    "unwrap_causal_lm",
    "cast_copy",
    "hold_matmul_weights",
    "copy_weights",
]

DType = Literal["float32", "bfloat16", "float16"]
_ADAPTER_FILE = "adapter_config.json"




class LoraConfig(Config):
    """Low-rank adapters (Hu et al. 2021) through peft: W' = W + (alpha / r) * B A."""

    r: int = Field(16, ge=1, description="rank of the update B A")
    alpha: float = Field(32.0, gt=0, description="scale numerator: the update is multiplied by alpha / r")
    dropout: float = Field(0.0, ge=0, lt=1, description="dropout on the adapter input (0 keeps RL ratios exact)")
    target_modules: list[str] | str = Field("all-linear", description="module names to adapt, or 'all-linear'")


def torch_dtype(name: DType | torch.dtype) -> torch.dtype:
    """'float32' -> torch.float32, 'bfloat16' -> torch.bfloat16, 'float16' -> torch.float16."""
    if isinstance(name, torch.dtype):
        return name
    table = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    if name not in table:
        raise ValueError(f"dtype {name!r} is not one of {sorted(table)}")
    return table[name]


class ModelLoadError(RLAlignError, OSError):
    """A model or tokenizer directory that cannot be loaded; the message names the directory or file."""


_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def resolve_model_path(path: str | Path) -> Path:
    """A local directory as it is; a Hugging Face Hub id (``org/name``) that is not a local directory
    through the Hub cache: its cached snapshot. Nothing is downloaded unless the environment asks for
    it explicitly with ``HF_HUB_OFFLINE=0``.

    Raises:
        ModelLoadError: no such directory, or a Hub id with no cached copy that cannot be downloaded.
    """
    if Path(path).is_dir() or not _HUB_ID.match(str(path)):
        return Path(path)
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return Path(snapshot_download(str(path), local_files_only=True))
    except LocalEntryNotFoundError:
        if os.environ.get("HF_HUB_OFFLINE") != "0":
            raise ModelLoadError(f"{path!r} is neither a local directory nor in the Hugging Face cache, and rlalign downloads nothing "
                                 "unless asked: set HF_HUB_OFFLINE=0 to let it download, or give a local directory") from None
    try:
        return Path(snapshot_download(str(path)))
    except Exception as err:  # no network, no such repository, no access
        raise ModelLoadError(f"{path!r} is neither a local directory nor in the Hugging Face cache, and downloading it failed "
                             f"({type(err).__name__}: {str(err)[:200]})") from None


def check_checkpoint_dir(path: str | Path, gguf_file: str | None = None) -> Path:
    """``path`` (or a Hub id, :func:`resolve_model_path`) as a Hugging Face checkpoint directory: it
    exists, holds ``config.json`` (or the GGUF file, or a saved adapter), and every safetensors file
    in it has a whole header. Returns the directory.

    Raises:
        ModelLoadError: naming what is missing or the corrupt file.
    """
    path = resolve_model_path(path)
    if not path.is_dir():
        raise ModelLoadError(f"model directory {str(path)!r} does not exist")
    marker = gguf_file or ("config.json" if not (path / _ADAPTER_FILE).is_file() else _ADAPTER_FILE)
    if not (path / marker).is_file():
        raise ModelLoadError(f"{str(path)!r} is not a Hugging Face checkpoint directory: it has no {marker}")
    if marker == _ADAPTER_FILE:
        _check_weight_adapter(path)
    for weights in sorted(path.glob("*.safetensors")):
        try:
            with safe_open(str(weights), "pt"):  # reads the header and checks it against the file's size
                pass
        except Exception as err:  # safetensors raises its own error kinds
            raise ModelLoadError(f"weights file {weights} is corrupt or truncated ({type(err).__name__}: {err})") from None
    return path


def _check_weight_adapter(path: Path) -> None:
    """A saved peft adapter that changes weights (LoRA and its kin), not one that adds virtual tokens
    (prompt or prefix tuning: the training passes would place the completion's log-probs at the wrong
    positions, and packed rows would see each other's tokens through its cache)."""
    from peft import PeftConfig

    config = PeftConfig.from_pretrained(str(path))
    if config.is_prompt_learning:
        raise ModelLoadError(f"{path / _ADAPTER_FILE}: peft_type {config.peft_type.value} adds virtual tokens to every sequence; "
                             "rlalign trains and loads LoRA adapters (model.lora), or a full checkpoint")


def adapter_base(path: str | Path) -> str:
    """The base model the saved LoRA adapter at ``path`` loads: its ``adapter_config.json``'s ``base_model_name_or_path``."""
    return json.loads((Path(path) / _ADAPTER_FILE).read_text())["base_model_name_or_path"]


def context_length(path: str | Path, gguf_file: str | None = None) -> int | None:
    """The most positions the model at ``path`` (or, for a saved adapter, its base) takes
    (``max_position_embeddings``), or None when its config does not say."""
    path = resolve_model_path(path)
    if (path / _ADAPTER_FILE).is_file():
        path = Path(adapter_base(path))
    config = _load_config(path, gguf_file).get_text_config(decoder=True)
    return getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)


def load_tokenizer(path: str | Path, gguf_file: str | None = None) -> PreTrainedTokenizerBase:
    """The checkpoint's tokenizer, with a pad token (EOS when it has none) and left padding."""
    kwargs = {"gguf_file": gguf_file} if gguf_file else {}
    missing = f"{path} holds no tokenizer: save the one its model was trained with beside the weights (tokenizer.save_pretrained)"
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(check_checkpoint_dir(path, gguf_file)), **kwargs)
    except (OSError, ValueError) as err:  # no tokenizer files, or none transformers can read
        if isinstance(err, RLAlignError):
            raise
        raise ModelLoadError(f"{missing} ({type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''})") from None
    if len(tokenizer.get_vocab()) <= len(set(tokenizer.all_special_ids)):  # transformers builds an empty one from a GPT-2 config alone
        raise ModelLoadError(f"{missing}; transformers built an empty one from its config")
    if tokenizer.pad_token_id is None:
        if tokenizer.eos_token_id is None:
            raise ModelLoadError(f"tokenizer of {path} has neither a pad nor an EOS token")
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    return tokenizer


_DROPOUT_AS_LOADED: dict[int, dict[str, float]] = {}  # id(config) -> the dropout fields zeroed in it, as loaded (saved so)


def _zero_dropout_config(config: PretrainedConfig) -> PretrainedConfig:
    zeroed = {}
    for key, value in list(config.to_dict().items()):
        if isinstance(value, float) and ("dropout" in key or "pdrop" in key):
            setattr(config, key, 0.0)
            if value != 0.0:
                zeroed[key] = value
    _remember_dropout(config, zeroed)
    return config


def _remember_dropout(config: PretrainedConfig, zeroed: dict[str, float]) -> None:
    if not zeroed:
        return
    if id(config) not in _DROPOUT_AS_LOADED:
        weakref.finalize(config, _DROPOUT_AS_LOADED.pop, id(config), None)
    _DROPOUT_AS_LOADED.setdefault(id(config), {}).update(zeroed)


@contextlib.contextmanager
def dropout_as_loaded(*models: nn.Module) -> Iterator[None]:
    """While saving: the models' configs hold the dropout probabilities they were loaded with, which
    training zeroes (:func:`disable_dropout`), so a saved ``config.json`` keeps the model's own (TRL zeroes
    only the modules); zeroed again afterwards."""
    configs = {id(c): c for model in models for m in model.modules() if isinstance(c := getattr(m, "config", None), PretrainedConfig)}  # wrappers' too
    held = [(config, _DROPOUT_AS_LOADED.get(key, {})) for key, config in configs.items()]
    for config, values in held:
        for key, value in values.items():
            setattr(config, key, value)
    try:
        yield
    finally:
        for config, values in held:
            for key in values:
                setattr(config, key, 0.0)


def disable_dropout(model: nn.Module) -> nn.Module:
    """Set every dropout probability to 0 (nn.Dropout modules, config fields, attention attributes)."""
    for module in model.modules():
        if isinstance(module, nn.Dropout):
            module.p = 0.0
        for attr in ("attention_dropout", "dropout"):  # attention modules keep a float copy of the config value
            if isinstance(getattr(module, attr, None), float):
                setattr(module, attr, 0.0)
    config = getattr(model, "config", None)
    if isinstance(config, PretrainedConfig):
        _zero_dropout_config(config)
    return model


def _load_config(path: str | Path, gguf_file: str | None) -> PretrainedConfig:
    kwargs = {"gguf_file": gguf_file} if gguf_file else {}
    return _zero_dropout_config(AutoConfig.from_pretrained(str(path), **kwargs))


def _from_pretrained(auto_cls, path: str | Path, dtype: DType, device: str, gguf_file: str | None, attn_implementation: str | None = None) -> PreTrainedModel:
    kwargs = {"gguf_file": gguf_file} if gguf_file else {}
    if attn_implementation:  # e.g. "eager" (faster than SDPA for short sequences on CPU), "sdpa", "flash_attention_2"
        kwargs["attn_implementation"] = attn_implementation
    path = check_checkpoint_dir(path, gguf_file)
    config = _load_config(path, gguf_file)
    model = auto_cls.from_pretrained(str(path), config=config, dtype=torch_dtype(dtype), **kwargs)
    if model.config is not config:  # a copy: it is saved, so it carries what was zeroed
        _remember_dropout(model.config, _DROPOUT_AS_LOADED.get(id(config), {}))
    return disable_dropout(model).to(device)


def apply_lora(model: PreTrainedModel, lora: LoraConfig) -> nn.Module:
    """Wrap ``model`` in a peft LoRA model; only adapter weights are trainable afterwards."""
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model

    peft_config = PeftLoraConfig(
        r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout, target_modules=lora.target_modules, task_type="CAUSAL_LM"
    )
    return get_peft_model(model, peft_config)


def load_policy(
    path: str | Path,
    dtype: DType = "float32",
    device: str = "cpu",
    lora: LoraConfig | None = None,
    gguf_file: str | None = None,
    attn_implementation: str | None = None,
) -> nn.Module:
    """A trainable causal LM in train mode (the model's own dropout off; LoRA's ``dropout`` on the adapters'
    input as configured, 0 by default). ``lora`` adds fresh adapters; a directory holding a saved adapter
    (``adapter_config.json``) reloads the base named there with that adapter, trainable, every dropout off (as
    it was saved, a PEFT adapter often has 0.05-0.1, which would make an RL step's first ratio differ from 1)
    unless ``lora`` is given too: then it is the adapters ``lora`` made, resumed, and they keep ``lora.dropout``.
    ``attn_implementation``: transformers' attention kernel (None = its default).
    """
    path = Path(path)
    if (path / _ADAPTER_FILE).is_file():
        from peft import PeftModel

        _check_weight_adapter(path)
        base_path = adapter_base(path)
        base = _from_pretrained(AutoModelForCausalLM, base_path, dtype, device, gguf_file, attn_implementation)
        model = disable_dropout(PeftModel.from_pretrained(base, str(path), is_trainable=True)).to(device)  # a saved adapter's dropout too: off
        if lora is not None:
            set_adapter_dropout(model, lora.dropout)
        return model.train()  # every module: from_pretrained left the base's in eval mode (no dropout, no activation checkpointing)
    model = disable_dropout(_from_pretrained(AutoModelForCausalLM, path, dtype, device, gguf_file, attn_implementation))
    if lora is not None:
        model = apply_lora(model, lora)  # after disable_dropout: the adapters keep lora.dropout
    model.train()  # train mode: LoRA's dropout if set (the model's own is 0)
    return model


def set_adapter_dropout(model: nn.Module, p: float) -> None:
    """Set the dropout on every LoRA adapter's input of ``model`` to ``p`` (peft holds one ``nn.Dropout``
    per adapter where it was made with a dropout above 0, an ``nn.Identity`` where not)."""
    for name, module in model.named_modules():
        if isinstance(module, nn.Dropout) and ".lora_dropout." in f".{name}.":
            module.p = p


def load_reference(
    path: str | Path, dtype: DType = "float32", device: str = "cpu", gguf_file: str | None = None, attn_implementation: str | None = None
) -> PreTrainedModel:
    """A frozen copy of a causal LM: eval mode, no parameter requires grad."""
    model = _from_pretrained(AutoModelForCausalLM, path, dtype, device, gguf_file, attn_implementation)
    model.eval()
    model.requires_grad_(False)
    return model


def hold_matmul_weights(model: nn.Module, dtype: DType | torch.dtype) -> nn.Module:
    """Hold in ``dtype`` exactly the parameters that ``torch.autocast(dtype)`` casts at every forward:
    weights and biases of ``nn.Linear`` and transformers' ``Conv1D`` (GPT-2), unless another module
    shares them (a tied LM head stays with its embedding). Embeddings and norms keep their dtype.

    Under autocast the model then computes bit for bit what it computes with all weights in full
    precision (autocast's cast rounds the same way), without re-casting those weights every forward
    and in about half the memory. For a frozen reference under ``model.autocast``: at equal weights
    its log-probs equal the policy's, so the KL starts at exactly 0 (a fully bfloat16 copy, norms and
    embeddings included, starts ~2e-3 nats/token away on SmolLM2-135M). In place; returns ``model``.
    """
    from transformers.pytorch_utils import Conv1D

    matmul = (nn.Linear, Conv1D)
    shared = {id(p) for m in model.modules() if not isinstance(m, matmul) for p in m.parameters(recurse=False)}
    for module in model.modules():
        if isinstance(module, matmul):
            for param in module.parameters(recurse=False):
                if id(param) not in shared and param.is_floating_point():
                    param.data = param.data.to(torch_dtype(dtype))
    return model


def _is_peft(model: nn.Module) -> bool:
    return hasattr(model, "disable_adapter") and hasattr(model, "get_base_model")


@contextlib.contextmanager
def reference_policy(policy: nn.Module, reference: nn.Module | None = None) -> Iterator[nn.Module]:
    """The module whose log-probs are the reference log-probs, for the duration of the block.

    With a separate frozen ``reference`` it is that model. Without one, a LoRA ``policy`` serves
    as its own reference with adapters disabled (peft ``disable_adapter``), so no second copy of
    the weights is held. Anything else is an error: comparing the policy with itself gives KL = 0.
    """
    if reference is not None:
        yield reference
    elif _is_peft(policy):
        with policy.disable_adapter():
            yield policy
    else:
        raise ValueError("no reference: pass a frozen reference model, or use a LoRA policy (the base with adapters disabled)")


def unwrap_causal_lm(model: nn.Module) -> PreTrainedModel:
    """The transformers causal LM inside ``model`` (a peft model's base model, with its adapters)."""
    return model.get_base_model() if _is_peft(model) else model


def stop_token_ids(model: nn.Module, tokenizer) -> list[int]:
    """The ids that end a completion: the tokenizer's EOS and every id ``model``'s generation config lists
    (``eos_token_id``, an id or a list: an instruct model's end of turn, e.g. Llama 3's ``<|eot_id|>``), where
    transformers' ``generate`` and TRL stop. ``model`` may be wrapped (DDP, FSDP2, peft, a sampling copy)."""
    inner = getattr(model, "module", model)  # DDP
    config = getattr(unwrap_causal_lm(inner), "generation_config", None)
    listed = getattr(config, "eos_token_id", None)
    ids = [tokenizer.eos_token_id, *([listed] if isinstance(listed, int) else list(listed or []))]
    return list(dict.fromkeys(i for i in ids if i is not None))


def cache_argument(model: nn.Module) -> str:
    """The keyword ``model``'s forward takes its KV cache by: ``cache`` from transformers 5.24 on,
    ``past_key_values`` before (and in models whose forward still names it so)."""
    return _cache_keyword(type(unwrap_causal_lm(model)).forward)


@functools.cache
def _cache_keyword(forward: Callable) -> str:
    """:func:`cache_argument` of a forward function, looked up once per function: ``inspect.signature``
    is not free, and a GRPO step asks several times (the prefill and every log-prob pass)."""
    return "cache" if "cache" in inspect.signature(forward).parameters else "past_key_values"


def cast_copy(model: nn.Module, dtype: DType | torch.dtype) -> nn.Module:
    """A frozen copy of ``model`` with its parameters held in ``dtype`` (e.g. a bfloat16 copy of a
    float32 policy for the decode loop). Buffers keep their dtype (RoPE's inverse frequencies stay
    float32), tied weights stay tied, and no full-precision intermediate copy is made (the
    parameters are cast one by one and handed to ``deepcopy`` through its memo)."""
    memo = {id(p): nn.Parameter(p.detach().to(torch_dtype(dtype)), requires_grad=False) for p in model.parameters()}
    return copy.deepcopy(model, memo)


@torch.no_grad()
def copy_weights(target: nn.Module, source: nn.Module) -> None:
    """Copy ``source``'s parameters into ``target``'s (cast to its dtypes); same structure, e.g. a :func:`cast_copy`."""
    for dst, src in zip(target.parameters(), source.parameters(), strict=True):
        dst.copy_(src)
