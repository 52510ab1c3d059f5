"""Load a policy, a frozen reference, a critic and a reward model from any HF causal-LM checkpoint.

    policy = load_policy("runs/sft/final", dtype="bfloat16", lora=LoraConfig(r=16))
    with reference_policy(policy) as ref:         # LoRA: the same weights with adapters disabled
        ref_logp = rollout_logprobs(ref, rollout)     # rlalign.lm.logprobs
    reward_model = load_reward_model("runs/rm/final")           # backbone + scalar head, frozen
    critic = load_critic("runs/rm/final")                       # critic initialised from the RM

Value and reward are a scalar head ``nn.Linear(hidden, 1)`` on the last hidden state of the
backbone (``AutoModel``: the causal LM without its vocabulary projection; seed 003, sections 4 and
7). A sequence's reward is the head's output at its last non-padding token. The head runs in
float32 whatever the backbone's dtype.

A reward model trained by ``rlalign rm`` has a head without bias and saves as a Hugging Face
``<Arch>ForSequenceClassification`` checkpoint with one label (backbone under the class's
``base_model_prefix``, head as ``score.weight``), which ``AutoModelForSequenceClassification``
loads whole. A critic (head with a bias) saves as an ordinary backbone checkpoint
(``save_pretrained``, safetensors) plus ``value_head.safetensors``. Either format, and any one-label
``*ForSequenceClassification`` checkpoint, loads back with its head; loading a directory with no head
(an SFT or base checkpoint) starts a fresh one, which is how a reward model or critic is initialised
from an SFT model, and a critic from a reward model.

Dropout is switched off everywhere (config fields and modules): RL compares log-probs of the
same tokens across forward passes (ratio = 1 on the first minibatch), which dropout would break.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import inspect
import json
import logging
import os
import re
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Literal

import torch
from pydantic import Field
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch import Tensor, nn
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer, PretrainedConfig, PreTrainedModel, PreTrainedTokenizerBase

from rlalign.config import Config, ConfigError
from rlalign.core.advantages import last_token_index
from rlalign.core.masks import position_ids_from_mask
from rlalign.errors import RLAlignError

__all__ = [
    "DType",
    "LoraConfig",
    "HEAD_FILE",
    "torch_dtype",
    "ModelLoadError",
    "resolve_model_path",
    "check_checkpoint_dir",
    "context_length",
    "load_tokenizer",
    "disable_dropout",
    "load_policy",
    "load_reference",
    "apply_lora",
    "reference_policy",
    "unwrap_causal_lm",
    "enable_gradient_checkpointing",
    "is_checkpointing",
    "evaluating",
    "attention_kernel",
    "cast_copy",
    "hold_matmul_weights",
    "copy_weights",
    "ScalarHeadModel",
    "load_reward_model",
    "load_critic",
]

DType = Literal["float32", "bfloat16", "float16"]
HEAD_FILE = "value_head.safetensors"
REWARD_INPUT_KEY = "rlalign_reward_input"  # config.json: how a reward model reads prompt + completion ("eos": as rlalign rm trains it)
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
    for weights in sorted(path.glob("*.safetensors")):
        try:
            with safe_open(str(weights), "pt"):  # reads the header and checks it against the file's size
                pass
        except Exception as err:  # safetensors raises its own error kinds
            raise ModelLoadError(f"weights file {weights} is corrupt or truncated ({type(err).__name__}: {err})") from None
    return path


def context_length(path: str | Path, gguf_file: str | None = None) -> int | None:
    """The most positions the model at ``path`` (or, for a saved adapter, its base) takes
    (``max_position_embeddings``), or None when its config does not say."""
    path = resolve_model_path(path)
    if (path / _ADAPTER_FILE).is_file():
        path = Path(json.loads((path / _ADAPTER_FILE).read_text())["base_model_name_or_path"])
    config = _load_config(path, gguf_file).get_text_config(decoder=True)
    return getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)


def load_tokenizer(path: str | Path, gguf_file: str | None = None) -> PreTrainedTokenizerBase:
    """The checkpoint's tokenizer, with a pad token (EOS when it has none) and left padding."""
    kwargs = {"gguf_file": gguf_file} if gguf_file else {}
    tokenizer = AutoTokenizer.from_pretrained(str(check_checkpoint_dir(path, gguf_file)), **kwargs)
    if tokenizer.pad_token_id is None:
        if tokenizer.eos_token_id is None:
            raise ValueError(f"tokenizer of {path} has neither a pad nor an EOS token")
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    return tokenizer


def _zero_dropout_config(config: PretrainedConfig) -> PretrainedConfig:
    for key, value in list(config.to_dict().items()):
        if isinstance(value, float) and ("dropout" in key or "pdrop" in key):
            setattr(config, key, 0.0)
    return config


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
    model = auto_cls.from_pretrained(str(path), config=_load_config(path, gguf_file), dtype=torch_dtype(dtype), **kwargs)
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
    """A trainable causal LM (dropout off). ``lora`` adds fresh adapters; a directory holding a
    saved adapter (``adapter_config.json``) reloads the base named there with that adapter, trainable.
    ``attn_implementation``: transformers' attention kernel (None = its default).
    """
    path = Path(path)
    if (path / _ADAPTER_FILE).is_file():
        from peft import PeftModel

        base_path = json.loads((path / _ADAPTER_FILE).read_text())["base_model_name_or_path"]
        base = _from_pretrained(AutoModelForCausalLM, base_path, dtype, device, gguf_file, attn_implementation)
        return disable_dropout(PeftModel.from_pretrained(base, str(path), is_trainable=True)).to(device)
    model = _from_pretrained(AutoModelForCausalLM, path, dtype, device, gguf_file, attn_implementation)
    if lora is not None:
        model = disable_dropout(apply_lora(model, lora))
    model.train()  # dropout is 0, so train mode only matters for modules like batch norm (none in LMs)
    return model


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


def unwrap_causal_lm(model: nn.Module) -> PreTrainedModel:
    """The transformers causal LM inside ``model`` (a peft model's base model, with its adapters)."""
    return model.get_base_model() if _is_peft(model) else model


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
    backbone.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    return model


def is_checkpointing(model: nn.Module) -> bool:
    """Whether a forward of ``model`` now recomputes activations in backward (and so drops a KV cache):
    checkpointing on, train mode, grad enabled."""
    backbone = model.backbone if isinstance(model, ScalarHeadModel) else unwrap_causal_lm(model)
    if not (model.training and torch.is_grad_enabled()):
        return False
    flag = "is_activation_checkpointing" if hasattr(type(backbone), "is_activation_checkpointing") else "is_gradient_checkpointing"  # renamed in transformers 5
    return bool(getattr(backbone, flag, False))


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


def cache_argument(model: nn.Module) -> str:
    """The keyword ``model``'s forward takes its KV cache by: ``cache`` from transformers 5.24 on,
    ``past_key_values`` before (and in models whose forward still names it so)."""
    return _cache_keyword(type(unwrap_causal_lm(model)).forward)


@functools.cache
def _cache_keyword(forward: Callable) -> str:
    """:func:`cache_argument` of a forward function, looked up once per function: ``inspect.signature``
    is not free, and a GRPO step asks several times (the prefill and every log-prob pass)."""
    return "cache" if "cache" in inspect.signature(forward).parameters else "past_key_values"


def last_token_values(values: Tensor, attention_mask: Tensor) -> Tensor:
    """``values`` (B, T) read at each row's last non-padding token -> (B,): a sequence's reward
    from :class:`ScalarHeadModel`'s per-token scalars (also when the model is wrapped in DDP)."""
    return values.gather(1, last_token_index(attention_mask)[:, None]).squeeze(1)


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


class _ScoreOnlyLoadReport(logging.Filter):
    """Drops transformers' load report when its only entries are unexpected ``score.*`` weights: the
    backbone of a sequence-classification checkpoint loads without its classifier, whose head
    :func:`_trained_head` reads. Any other entry keeps the whole report."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if "LOAD REPORT" not in message:
            return True
        rows = [[cell.strip() for cell in line.split("|")] for line in message.splitlines() if "|" in line][1:]  # after the header
        return not (rows and all(row[0].startswith("score.") and "UNEXPECTED" in row[1] for row in rows))


@contextlib.contextmanager
def _quiet_score_report() -> Iterator[None]:
    logger, report_filter = logging.getLogger("transformers.modeling_utils"), _ScoreOnlyLoadReport()
    logger.addFilter(report_filter)
    try:
        yield
    finally:
        logger.removeFilter(report_filter)


class ScalarHeadModel(nn.Module):
    """A backbone (transformer without LM head) and ``head = nn.Linear(hidden, 1)`` in float32.

    ``forward`` gives one scalar per token (critic values V(s_t)); :meth:`sequence_scores` reads the
    scalar at each row's last non-padding token (reward r(x, y), seed 003 section 4).

    ``bias=False`` builds the head without a bias: a reward model trained with Bradley-Terry (whose
    loss is blind to a constant added to every reward) has none, so that it saves as an exact Hugging
    Face sequence-classification checkpoint (:meth:`save_pretrained`). A critic keeps its bias.
    ``pad_token_id`` and ``eos_token_id`` (from the backbone's config; ``rlalign rm`` sets them from
    its tokenizer) go into that checkpoint's config.
    """

    def __init__(self, backbone: PreTrainedModel, head: nn.Linear | None = None, init_std: float | None = None, bias: bool = True):
        super().__init__()
        text_config = backbone.config.get_text_config()
        hidden = text_config.hidden_size
        self.backbone = backbone
        if head is None:
            head = nn.Linear(hidden, 1, bias=bias, dtype=torch.float32)
            nn.init.normal_(head.weight, std=init_std if init_std is not None else 1.0 / (hidden + 1) ** 0.5)
            if head.bias is not None:
                nn.init.zeros_(head.bias)
        self.head = head.to(device=next(backbone.parameters()).device, dtype=torch.float32)
        self.pad_token_id: int | None = text_config.pad_token_id
        self.eos_token_id: int | list[int] | None = text_config.eos_token_id

    @property
    def config(self) -> PretrainedConfig:
        return self.backbone.config

    def forward(self, input_ids: Tensor, attention_mask: Tensor, position_ids: Tensor | None = None) -> Tensor:
        """Per-token scalars. input_ids, attention_mask: (B, T), left or right padded. Returns (B, T) float32."""
        if position_ids is None:
            position_ids = position_ids_from_mask(attention_mask)
        hidden = self.backbone(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids).last_hidden_state  # (B, T, H)
        with torch.autocast(hidden.device.type, enabled=False):  # the scalar head stays float32 under a bfloat16 autocast
            return self.head(hidden.float()).squeeze(-1)  # (B, T)

    def sequence_scores(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        """The scalar at each row's last non-padding token. Returns (B,) float32."""
        return last_token_values(self(input_ids, attention_mask), attention_mask)

    def save_pretrained(self, path: str | Path, state_dict: dict[str, Tensor] | None = None) -> None:
        """Save to ``path``; from ``state_dict`` (keys ``backbone.*``, ``head.*``) when given, e.g.
        gathered from FSDP shards.

        A head without bias (a reward model from ``rlalign rm``) saves as a Hugging Face
        ``<Arch>ForSequenceClassification`` checkpoint: ``architectures`` that class (transformers'
        sequence-classification mapping of the backbone's config), one label (``id2label``),
        ``pad_token_id``, ``rlalign_reward_input: "eos"`` (it was trained on prompt + completion closed
        by EOS, so :class:`rlalign.lm.rewards.RewardModelReward` scores it so), the backbone's weights
        under the class's ``base_model_prefix`` and the head as ``score.weight`` (1, H), float32. It warns when the pad token is an EOS token:
        transformers' classifier reads the score at the last token that is not ``pad_token_id``,
        which is then the token before the closing EOS where rlalign reads it.

        A head with a bias (a critic) saves as the backbone checkpoint (``save_pretrained``) plus the
        head in ``value_head.safetensors``: Hugging Face's score layer has no bias, so this format
        keeps it rather than dropping it. A head without bias whose architecture transformers has no
        sequence-classification class for saves this way too (bias 0), with a warning.
        """
        path = Path(path)
        if self.head.bias is None:
            classifier = self._sequence_classifier()
            if classifier is not None:
                if state_dict is not None:
                    prefix = classifier.base_model_prefix
                    state_dict = {
                        **{f"{prefix}.{k.removeprefix('backbone.')}": v for k, v in state_dict.items() if k.startswith("backbone.")},
                        "score.weight": state_dict["head.weight"],
                    }
                classifier.save_pretrained(path, state_dict=state_dict)
                return
        if state_dict is None:
            self.backbone.save_pretrained(path)
            weight, bias = self.head.weight, self.head.bias
        else:
            self.backbone.save_pretrained(path, state_dict={k.removeprefix("backbone."): v for k, v in state_dict.items() if k.startswith("backbone.")})
            weight, bias = state_dict["head.weight"], state_dict.get("head.bias")
        if bias is None:
            bias = torch.zeros(1)
        head = {"weight": weight.detach().cpu().contiguous(), "bias": bias.detach().cpu().contiguous()}
        save_file(head, str(path / HEAD_FILE), metadata={"format": "rlalign-scalar-head"})

    def _sequence_classifier(self) -> PreTrainedModel | None:
        """The backbone's ``*ForSequenceClassification`` with one label, built on the meta device and
        holding this model's backbone and head weight (shared, nothing copied); None when transformers
        has no such class for it, or one whose layout is not backbone + bias-free ``score``."""
        config = copy.deepcopy(self.backbone.config)
        config.num_labels = 1
        pad = self.pad_token_id
        eos = {self.eos_token_id} if isinstance(self.eos_token_id, int) else set(self.eos_token_id or ())
        if pad is None and eos:
            pad = min(eos)
        config.pad_token_id = pad
        config.get_text_config().pad_token_id = pad
        setattr(config, REWARD_INPUT_KEY, "eos")  # trained on prompt + completion + EOS: scored so (rlalign.lm.rewards.reward_input_of)
        try:
            with torch.device("meta"):
                classifier = AutoModelForSequenceClassification.from_config(config)
        except (ValueError, KeyError):  # no sequence-classification class for this config
            classifier = None
        prefix = getattr(classifier, "base_model_prefix", "")
        score = getattr(classifier, "score", None)
        if (
            classifier is None
            or not isinstance(self.backbone, type(getattr(classifier, prefix, None)))
            or not isinstance(score, nn.Linear) or score.bias is not None or tuple(score.weight.shape) != tuple(self.head.weight.shape)
            or {name.split(".")[0] for name, _ in classifier.named_parameters()} != {prefix, "score"}
        ):
            warnings.warn(
                f"transformers has no sequence-classification model laid out as {type(self.backbone).__name__} + score for this reward model: "
                f"saved as the backbone + {HEAD_FILE} instead (rlalign loads it; AutoModelForSequenceClassification does not)", stacklevel=3,
            )
            return None
        if pad is None:
            warnings.warn(f"{type(self.backbone).__name__} reward model saved without pad_token_id: transformers' classifier scores only batches of one", stacklevel=3)
        elif pad in eos:
            warnings.warn(
                f"the reward model's pad token (id {pad}) is its EOS token: transformers' *ForSequenceClassification reads the score at the "
                "last token that is not pad_token_id, one token before the closing EOS where rlalign reads it, so its scores differ; "
                "give the tokenizer a pad token of its own to make them agree", stacklevel=3,
            )
        setattr(classifier, prefix, self.backbone)
        classifier.score.weight = self.head.weight
        return classifier

    @classmethod
    def from_pretrained(
        cls,
        path: str | Path,
        dtype: DType = "float32",
        device: str = "cpu",
        gguf_file: str | None = None,
        init_std: float | None = None,
        attn_implementation: str | None = None,
        require_head: bool = False,
        bias: bool = True,
    ) -> ScalarHeadModel:
        """Backbone from any causal-LM, backbone or sequence-classification checkpoint; the head from
        ``value_head.safetensors`` (a critic, or a reward model saved by an older rlalign), else from
        the ``score`` layer of a Hugging Face ``*ForSequenceClassification`` checkpoint with one label
        (a reward model saved by ``rlalign rm``), else freshly initialised, which ``require_head``
        forbids (a frozen reward model with a random head would score noise). ``bias=False`` builds
        a head without bias (see the class); a trained head's nonzero bias is then dropped with a
        warning (every score moves by the same constant, which Bradley-Terry cannot see).

        Raises:
            ModelLoadError: ``require_head`` and no trained head, or a head that does not fit (not one label).
        """
        with _quiet_score_report():
            backbone = _from_pretrained(AutoModel, path, dtype, device, gguf_file, attn_implementation)
        model = cls(backbone, init_std=init_std, bias=bias)
        head = _trained_head(resolve_model_path(path), model.head.in_features)
        if head is not None:
            if not bias:
                dropped = float(head.pop("bias").reshape(()))
                if dropped != 0.0:
                    warnings.warn(f"{path}: the reward head's bias {dropped:.4g} is dropped (a head trained by `rlalign rm` has none): every score moves by {-dropped:.4g}", stacklevel=2)
            model.head.load_state_dict(head)
        elif require_head:
            raise ModelLoadError(
                f"{path} has no trained reward head (no {HEAD_FILE}, nor a *ForSequenceClassification 'score' layer with one label): "
                "a reward model with a freshly initialised head would score noise; train one with `rlalign rm` or give a reward-model checkpoint"
            )
        return model.to(device)


def _trained_head(path: Path, hidden: int) -> dict[str, Tensor] | None:
    """{weight (1, H), bias (1,)} in float32 from ``value_head.safetensors`` or from a one-label
    sequence-classification checkpoint's ``score`` layer (bias 0 when it has none); None when neither."""
    head_file = path / HEAD_FILE
    if head_file.is_file():
        return {k: v.to(torch.float32) for k, v in load_file(str(head_file)).items()}
    config_file = path / "config.json"
    config = json.loads(config_file.read_text()) if config_file.is_file() else {}
    if not any(name.endswith("ForSequenceClassification") for name in config.get("architectures") or []):
        return None
    tensors: dict[str, Tensor] = {}
    for weights in sorted(path.glob("*.safetensors")):
        with safe_open(str(weights), "pt") as f:
            tensors.update({key: f.get_tensor(key) for key in f.keys() if key.split(".")[-2:-1] == ["score"]})
    weight = next((v for k, v in tensors.items() if k.endswith("score.weight")), None)
    if weight is None or tuple(weight.shape) != (1, hidden):
        shape = None if weight is None else tuple(weight.shape)
        raise ModelLoadError(f"{path}: a sequence-classification checkpoint whose score layer is {shape}, not one label over {hidden} hidden units")
    bias = next((v for k, v in tensors.items() if k.endswith("score.bias")), torch.zeros(1))
    return {"weight": weight.to(torch.float32), "bias": bias.to(torch.float32).reshape(1)}


def load_reward_model(
    path: str | Path, dtype: DType = "float32", device: str = "cpu", trainable: bool = False, gguf_file: str | None = None, attn_implementation: str | None = None
) -> ScalarHeadModel:
    """A reward model; frozen (eval, no grad) with a trained head required, unless ``trainable``
    (reward-model training, which may start from an SFT model with a fresh head, and trains a head
    without bias so that it saves as a Hugging Face sequence-classification checkpoint)."""
    model = ScalarHeadModel.from_pretrained(path, dtype, device, gguf_file, attn_implementation=attn_implementation, require_head=not trainable, bias=not trainable)
    if not trainable:
        model.eval()
        model.requires_grad_(False)
    return model


def load_critic(
    path: str | Path, dtype: DType = "float32", device: str = "cpu", gguf_file: str | None = None, attn_implementation: str | None = None
) -> ScalarHeadModel:
    """A trainable critic initialised from ``path``: a reward model keeps its head (in either save
    format; a bias of 0 when it has none, trained from there), an SFT model gets a fresh one."""
    return ScalarHeadModel.from_pretrained(path, dtype, device, gguf_file, attn_implementation=attn_implementation).train()
