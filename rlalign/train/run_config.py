"""The config fields of every LM training run: the starting model and how to hold it
(:class:`ModelConfig`), the optimiser (:class:`OptimConfig`), and where a run writes, its seed and
trackers (:class:`RunConfig`, which each trainer's config extends).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, TypeAdapter, model_validator

from rlalign.config import Config
from rlalign.lm.models import LoraConfig
from rlalign.train.metrics import check_trackers

__all__ = [
    "OptimConfig",
    "TinyModelConfig",
    "ModelConfig",
    "RunConfig",
    "check_output_dir",
]


Beta = Annotated[float, Field(ge=0, lt=1)]  # an Adam moment's decay (torch refuses any other mid-run)


class OptimConfig(Config):
    """AdamW with linear warm-up then cosine decay to ``min_lr_ratio`` * lr."""

    lr: float = Field(1e-3, gt=0, description="peak learning rate")
    weight_decay: float = Field(0.0, ge=0, description="decoupled weight decay (AdamW)")
    betas: tuple[Beta, Beta] = Field((0.9, 0.95), description="Adam beta1, beta2 (each in [0, 1))")
    eps: float = Field(1e-8, gt=0, description="Adam epsilon")
    warmup_steps: int = Field(0, ge=0, description="linear warm-up from 0 over this many steps")
    min_lr_ratio: float = Field(0.1, ge=0, le=1, description="final learning rate as a fraction of lr (cosine decay); 1 = constant")
    grad_clip: float | None = Field(1.0, gt=0, description="clip the global gradient norm to this value; null = no clipping")
    bf16_rounding: Literal["nearest", "stochastic"] = Field(
        "nearest", description="bfloat16 weights (model.dtype: bfloat16): nearest = torch's AdamW, bfloat16 moments (8 bytes a weight), refused where "
        "most steps of lr would round away; stochastic = each step in float32 with float32 moments, the weights rounded stochastically, every "
        "step kept in expectation (12 bytes a weight). Float32 weights take the exact step either way"
    )


class TinyModelConfig(Config):
    """Shape of the recipe's tiny Llama, built when no model path is given."""

    hidden_size: int = Field(128, ge=8, description="width of the residual stream")
    num_layers: int = Field(4, ge=1, description="number of decoder layers")
    num_heads: int = Field(4, ge=1, description="attention heads (hidden_size must be divisible by it)")
    intermediate_size: int = Field(256, ge=8, description="width of the MLP")
    seed: int = Field(0, description="seed of the random initialisation")

    @model_validator(mode="after")
    def _heads_divide_the_width(self) -> TinyModelConfig:
        if self.hidden_size % self.num_heads:
            raise ValueError(f"hidden_size={self.hidden_size} must be divisible by num_heads={self.num_heads} (each head gets hidden_size / num_heads)")
        return self


class ModelConfig(Config):
    """Which checkpoint to start from and how to hold it."""

    path: str | None = Field(
        None, description="HF checkpoint dir, Hub id, or a LoRA adapter dir (adapter_config.json: see adapter); null = build the tiny recipe model in <output_dir>/base_model"
    )
    adapter: Literal["merge", "train"] = Field(
        "merge", description="when path is a LoRA adapter dir: merge it into its base and train the merged model (fresh adapters if lora is set), "
        "or keep training that adapter; either way the reference, critic and reward-model backbone start from base + adapter"
    )
    gguf_file: str | None = Field(None, description="a .gguf file inside path to load instead of safetensors")
    dtype: Literal["float32", "bfloat16"] = Field("float32", description="parameter dtype")
    device: str = Field("cpu", description="torch device, e.g. cpu or cuda:0")
    lora: LoraConfig | None = Field(None, description="train LoRA adapters instead of all weights (policy models only)")
    autocast: Literal["none", "bfloat16"] = Field(
        "none", description="run forwards under torch.autocast in bfloat16 with float32 master weights (CPUs with AMX / AVX512-BF16, GPUs)"
    )
    attn_implementation: str | None = Field(
        None, description="transformers attention kernel for every model of the run (null = its default, sdpa); eager is faster for short sequences on CPU"
    )
    sharding: Literal["ddp", "fsdp"] = Field(
        "ddp", description="under torchrun: ddp = a full copy per process (DDP); fsdp = parameters, gradients and optimiser state sharded (FSDP2)"
    )
    logits_limit_mb: float = Field(
        1024.0, ge=0, description="largest float32 logits (rows x completion tokens x vocabulary x 4 bytes) a training, reference, pi_old "
        "or distillation pass makes; above it the log-probs come from the last hidden states and the LM head in chunks, with no logits (one more head "
        "matmul in backward; Llama, Qwen2/3, Mistral, GPT-2, Phi-3, OLMo-2 heads in one process); 0 = always",
    )
    memory_fraction: float = Field(
        0.9, gt=0, le=1, description="the share of the device's memory (of what is available, on a CPU) that micro_batch_size: auto plans "
        "each pass's rows to stay within, the rest left for the allocator's slack and other work"
    )
    gradient_checkpointing: bool = Field(
        False, description="recompute each layer's activations in backward instead of storing them: the same gradients, less memory, about a third more compute"
    )
    tiny: TinyModelConfig = Field(default_factory=TinyModelConfig, description="shape of the tiny model built when path is null")

    @model_validator(mode="after")
    def _adapter(self) -> ModelConfig:
        if self.adapter == "train" and self.lora is not None:
            raise ValueError("model.adapter: train keeps training the saved adapter; model.lora would add fresh ones on top: set one of them")
        return self


def check_output_dir(output_dir: str) -> None:
    """An empty ``output_dir`` would write the run into the current directory: refused."""
    if not output_dir.strip():
        raise ValueError("output_dir is empty: give the directory the run writes its files to")


class RunConfig(Config):
    """The fields of every LM training run (rlalign.train.loop): where it writes, its seed and
    threads, its starting model, how it saves and shows progress. Each trainer's config extends it."""

    output_dir: str = Field("runs/run", description="run directory: metrics.jsonl, checkpoints/, final/")
    seed: int = Field(0, description="seed of Python, NumPy and torch, of the data order and of the sampling / shuffling generator")
    num_threads: int | None = Field(None, ge=1, description="torch CPU threads (null = torch's default)")
    model: ModelConfig = Field(default_factory=lambda: ModelConfig(), description="starting checkpoint (e.g. an SFT run's final/), dtype, device, LoRA")
    save_every: int = Field(0, ge=0, description="checkpoint every N steps; 0 = only at the end")
    keep_last: int = Field(2, ge=1, description="checkpoints kept (older ones are deleted)")
    progress: bool = Field(True, description="show a progress bar with the step's headline metrics")
    report_to: list[Literal["jsonl", "tensorboard", "wandb"]] = Field(
        default_factory=lambda: ["jsonl"],
        description="trackers of the metrics: jsonl = <output_dir>/metrics.jsonl, which is always written (resume, curves.png and the "
        "summaries read it); tensorboard = event files in <output_dir>/tensorboard (pip install 'rlalign[tensorboard]'); "
        "wandb = a Weights & Biases run (pip install 'rlalign[wandb]'; project WANDB_PROJECT, default rlalign; WANDB_MODE=offline works without network)",
    )
    plots: bool = Field(True, description="write curves.png of the headline metrics at the end")
    overwrite: bool = Field(False, description="start afresh in an output_dir that holds a run, deleting its contents first (otherwise an error)")
    save_merged: bool = Field(
        False, description="LoRA runs: write final/ as the full model (adapter merged into its base, loadable with AutoModelForCausalLM) instead of the adapter alone"
    )
    ddp_timeout: float = Field(
        1800.0, gt=0, description="under torchrun: seconds a process waits in a collective for the others (a slow reward, a checkpoint of a large "
        "model) before the run stops with the backend's timeout error; transformers' and TRL's ddp_timeout"
    )

    @model_validator(mode="before")
    @classmethod
    def _legacy_tensorboard(cls, data: Any) -> Any:
        """``tensorboard: true`` (the field report_to replaced, in older YAMLs and checkpoints) adds
        tensorboard to report_to; ``tensorboard: false`` adds nothing."""
        if isinstance(data, dict) and "tensorboard" in data:
            data = dict(data)
            if TypeAdapter(bool).validate_python(data.pop("tensorboard")):
                report_to = list(data.get("report_to") or ["jsonl"])
                data["report_to"] = report_to + ["tensorboard"] * ("tensorboard" not in report_to)
        return data

    @model_validator(mode="after")
    def _output_dir(self) -> RunConfig:
        check_output_dir(self.output_dir)
        check_trackers(self.report_to)  # a missing package fails here, before the run directory is touched
        return self
