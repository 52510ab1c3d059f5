"""The reward model and the critic: a backbone with a scalar head, from any HF causal-LM checkpoint.

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

The backbone loads as :mod:`rlalign.lm.models` loads a policy (dropout off, dtype, device).
"""

from __future__ import annotations

import contextlib
import copy
import json
import logging
import warnings
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch import Tensor, nn
from transformers import AutoModel, AutoModelForSequenceClassification, PretrainedConfig, PreTrainedModel

from rlalign.core.advantages import last_token_index
from rlalign.core.masks import position_ids_from_mask
from rlalign.lm.models import DType, ModelLoadError, _from_pretrained, resolve_model_path

__all__ = [
    "HEAD_FILE",
    "ScalarHeadModel",
    "load_reward_model",
    "load_critic",
]

HEAD_FILE = "value_head.safetensors"
REWARD_INPUT_KEY = "rlalign_reward_input"  # config.json: how a reward model reads prompt + completion ("eos": as rlalign rm trains it)


def last_token_values(values: Tensor, attention_mask: Tensor) -> Tensor:
    """``values`` (B, T) read at each row's last non-padding token -> (B,): a sequence's reward
    from :class:`ScalarHeadModel`'s per-token scalars (also when the model is wrapped in DDP)."""
    return values.gather(1, last_token_index(attention_mask)[:, None]).squeeze(1)


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

    def forward(self, input_ids: Tensor, attention_mask: Tensor | None, position_ids: Tensor | None = None) -> Tensor:
        """Per-token scalars. input_ids, attention_mask: (B, T), left or right padded; or no mask and the
        position ids of packed rows (:mod:`rlalign.core.packing`). Returns (B, T) float32."""
        if position_ids is None:
            position_ids = position_ids_from_mask(attention_mask)
        # no KV cache: none is read, and transformers keeps packed rows apart only in a forward without one
        hidden = self.backbone(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False).last_hidden_state  # (B, T, H)
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
    """{weight (1, H), bias (1,)} in float32 from ``value_head.safetensors`` or from a sequence-classification
    checkpoint's ``score`` layer (safetensors or ``pytorch_model*.bin``; bias 0 when it has none; of several labels,
    label 0, as TRL's GRPOTrainer reads ``logits[:, 0]``, with a warning); None when neither."""
    head_file = path / HEAD_FILE
    if head_file.is_file():
        return {k: v.to(torch.float32) for k, v in load_file(str(head_file)).items()}
    config_file = path / "config.json"
    config = json.loads(config_file.read_text()) if config_file.is_file() else {}
    if not any(name.endswith("ForSequenceClassification") for name in config.get("architectures") or []):
        return None
    tensors: dict[str, Tensor] = {}
    is_score = lambda key: key.split(".")[-2:-1] == ["score"]  # noqa: E731
    for weights in sorted(path.glob("*.safetensors")):
        with safe_open(str(weights), "pt") as f:
            tensors.update({key: f.get_tensor(key) for key in f.keys() if is_score(key)})
    if not tensors:  # a checkpoint saved in torch's format
        for weights in sorted(path.glob("pytorch_model*.bin")):
            tensors.update({key: v for key, v in torch.load(weights, map_location="cpu", weights_only=True).items() if is_score(key)})
    weight = next((v for k, v in tensors.items() if k.endswith("score.weight")), None)
    if weight is None or weight.dim() != 2 or weight.shape[1] != hidden:
        shape = None if weight is None else tuple(weight.shape)
        raise ModelLoadError(f"{path}: a sequence-classification checkpoint whose score layer is {shape}, not labels over {hidden} hidden units")
    if weight.shape[0] > 1:
        warnings.warn(f"{path}: the score layer has {weight.shape[0]} labels; the reward is label 0's logit, as TRL's GRPOTrainer reads it", stacklevel=3)
    bias = next((v for k, v in tensors.items() if k.endswith("score.bias")), torch.zeros(weight.shape[0]))
    return {"weight": weight[:1].to(torch.float32), "bias": bias.reshape(-1)[:1].to(torch.float32)}


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
