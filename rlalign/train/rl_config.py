"""The config pieces GRPO and PPO share: prompts, reward terms, sampling, the RL optimiser, and
:class:`RLConfig`, the fields of every RL run (where it writes, what it loads, how it logs and saves).

:class:`rlalign.train.grpo.GRPOConfig` and :class:`rlalign.train.ppo.PPOConfig` extend
:class:`RLConfig` with their algorithm's own fields; every field can be overridden on the command
line as ``key.sub=value``.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, field_validator, model_validator

from rlalign.agents.agent_config import AgentConfig
from rlalign.agents.env_config import EnvironmentConfig
from rlalign.config import Config
from rlalign.core.losses import AGGREGATION_MODES, Aggregation
from rlalign.lm.sampling import SamplingParams
from rlalign.train.run_config import ModelConfig, OptimConfig, RunConfig
from rlalign.train.tool_rollout import ToolsConfig

__all__ = [
    "DataConfig",
    "BUILTIN_REWARDS",
    "RemoteConfig",
    "JudgeConfig",
    "RewardConfig",
    "SamplingConfig",
    "RLOptimConfig",
    "COMPILE_HELP",
    "check_compile",
    "EvalConfig",
    "AsyncConfig",
    "RLConfig",
]


class DataConfig(Config):
    """Where the training prompts come from: an embedded task or a file (exactly one)."""

    task: Literal["arithmetic", "preference", "multiplication", "lookup", "lookup_value"] | None = Field(
        None, description="embedded offline task (rlalign.tasks) giving the prompts (multiplication: with tools, a calculator; lookup, lookup_value: with an environment)"
    )
    path: str | None = Field(
        None, description="TRL prompt-only data (a 'prompt' column, text or messages; other columns kept and passed to rewards, e.g. 'answer'): "
        "a JSON / JSONL / CSV / Parquet / Arrow file, a directory, or a Hub dataset name"
    )
    subset: str | None = Field(None, description="configuration (subset) of a Hub dataset")
    split: str = Field("train", description="split to read when the data has several (a single file has one)")
    columns: dict[str, str] = Field(default_factory=dict, description="columns to rename before reading, {name in the data: name rlalign reads}, e.g. {question: prompt}")
    num_prompts: int = Field(1024, ge=1, description="training prompts drawn from an embedded task")
    seed: int = Field(0, description="seed of the embedded task's prompt draw")

    @model_validator(mode="after")
    def _one_source(self) -> DataConfig:
        if (self.task is None) == (self.path is None):
            raise ValueError(f"set exactly one of data.task or data.path (got task={self.task!r}, path={self.path!r})")
        return self


BUILTIN_REWARDS = ("arithmetic", "preference", "multiplication", "exact_match", "math_answer", "format", "code_execution")


class RemoteConfig(Config):
    """How a remote reward (``reward_url``) is asked (rlalign.lm.remote_reward.RemoteReward)."""

    batch_size: int = Field(64, ge=1, description="rows per request")
    request_timeout_s: float = Field(60.0, gt=0, description="seconds one request may take (connect, send, wait, read)")
    max_retries: int = Field(3, ge=0, description="further tries of a request after a connection error, a timeout, 429 or 5xx (backoff doubling from 0.5 s)")
    max_concurrency: int = Field(4, ge=1, description="requests in flight at once")
    label_column: str | None = Field("answer", description="row column also sent as OpenRLHF's 'labels' (null: none)")
    token_env: str | None = Field(
        "RLALIGN_REWARD_TOKEN", description="environment variable holding the bearer token sent to the server, read when the term is built "
        "(unset: no token; null: never send one); the token itself never goes in a config"
    )


class JudgeConfig(Config):
    """A generative judge (rlalign.lm.judge.JudgeReward): a causal LM asked a rubric per completion,
    its answer parsed to a score in [0, 1]. A local checkpoint (``model``) or an OpenAI-compatible server
    (``base_url`` + ``model_name``), exactly one."""

    model: str | None = Field(None, description="local causal-LM checkpoint that judges, decoded greedily (frozen, on model.device in model.dtype)")
    base_url: str | None = Field(None, description="OpenAI-compatible server that judges, e.g. http://127.0.0.1:8000/v1")
    model_name: str | None = Field(None, description="the model the server serves (with base_url)")
    template: str | None = Field(None, description="the user message: {prompt}, {completion} and any row column by name (null: the built-in 0-10 rubric)")
    pattern: str | None = Field(None, description="regular expression whose first group is the score in the answer (null: 'Score: 7' / '7/10')")
    system_prompt: str | None = Field(None, description="a system message before the rubric (null: none)")
    min_score: float = Field(0.0, description="lowest score the rubric gives; x maps to (x - min_score) / (max_score - min_score)")
    max_score: float = Field(10.0, description="highest score the rubric gives")
    max_new_tokens: int = Field(16, ge=1, description="length of the judge's answer")
    max_failure_fraction: float = Field(
        0.5, ge=0, le=1, description="largest share of a call's answers that may fail to parse (each None, counted as reward/<name>/parse_failed); above it, an error"
    )

    @model_validator(mode="after")
    def _one_judge(self) -> JudgeConfig:
        if (self.model is None) == (self.base_url is None):
            raise ValueError("set exactly one of judge.model (a local checkpoint) or judge.base_url (an OpenAI-compatible server)")
        if (self.base_url is None) != (self.model_name is None):
            raise ValueError("judge.model_name goes with judge.base_url, and judge.base_url needs it")
        if not self.max_score > self.min_score:
            raise ValueError(f"judge.max_score ({self.max_score}) must be greater than judge.min_score ({self.min_score})")
        return self


class RewardConfig(Config):
    """One weighted term of the reward: a reward function, a reward model, a remote reward or a judge (exactly one)."""

    function: str | None = Field(
        None,
        description="arithmetic | preference | multiplication (the task's reward) | exact_match | math_answer (vs the prompts' 'answer' column, "
        "math_answer through math-verify) | format (regex 'pattern') | code_execution (runs the completion's code with the prompts' "
        "'tests' column in a sandbox) | 'package.module:function': TRL's reward convention (keywords prompts, completions (messages "
        "for conversational prompts), completion_ids, trainer_state and the row's other columns) or fn(prompts, completions)",
    )
    reward_model: str | None = Field(
        None, description="reward-model checkpoint: one written by rlalign rm or any Hugging Face *ForSequenceClassification checkpoint with one label "
        "(or an older rlalign backbone + value_head.safetensors); its score at the end of prompt + response is the reward"
    )
    reward_url: str | None = Field(
        None, description="a reward server's endpoint (rlalign serve-reward, OpenRLHF's serve_rm, docs/reward_protocol.md), e.g. http://127.0.0.1:5000/score; "
        "asked with the prompts, completions and the rows' columns"
    )
    remote: RemoteConfig = Field(default_factory=RemoteConfig, description="reward_url: batching, time limit per request, retries")
    judge: JudgeConfig | None = Field(None, description="a generative judge (an LLM asked a rubric per completion)")
    input_format: Literal["auto", "text", "eos"] = Field(
        "auto",
        description="reward_model: how prompt + completion reach it. text: as transformers and TRL score a Hugging Face reward model "
        "(prompt + completion as its tokenizer encodes the text, no special tokens added, conversations through its chat template, "
        "the score at the last non-padding token); eos: as rlalign rm trains (the completion closed by EOS, the score at that EOS); "
        "auto: what the checkpoint's config.json records (rlalign_reward_input, written by rlalign rm), else text",
    )
    pattern: str | None = Field(None, description="regular expression the whole completion must match (function: format)")
    weight: float = Field(1.0, description="coefficient of this term in the total reward")
    on_error: Literal["raise", "skip"] = Field(
        "raise",
        description="a call that raises, times out or returns a value that is not a finite number: raise = stop with an error naming "
        "the term and the prompt; skip = leave those completions out of training (no advantage, no loss) and count them as reward/<name>/failed",
    )
    timeout_s: float | None = Field(None, gt=0, description="time limit of one call of this term on a batch (null = none)")
    name: str | None = Field(None, description="metric name, reward/<name>/mean; defaults to the function name or 'rm'")
    partial_credit: bool = Field(False, description="function: code_execution: score the share of tests passed instead of 1 only when all pass")
    code_format: Literal["auto", "asserts", "mbpp", "humaneval", "stdio", "call"] = Field(
        "auto", description="function: code_execution: the format of each row's tests; auto = by its columns (test + entry_point: humaneval, "
        "test_list: mbpp, input_output / verification_info / public_tests or JSON tests: stdio, or call with a fn_name, tests: asserts)",
    )
    case_timeout_s: float = Field(
        4.0, gt=0, description="function: code_execution: CPU seconds one test case may use (an assert, a call, a run on one input); "
        "the wall clock is only a generous backstop (wall_factor times this)",
    )
    wall_factor: float = Field(
        10.0, ge=1, description="function: code_execution: the wall-clock backstop of a case (and of the program's start) as a multiple of its CPU limit",
    )
    on_timeout: Literal["skip", "zero"] = Field(
        "skip", description="function: code_execution: a completion whose run hit the wall-clock backstop twice (a host too slow, not a program "
        "over its CPU limit): skip = leave it out of training, as on_error: skip does, counted as reward/<name>/timed_out; zero = score it 0",
    )
    allow_weak_sandbox: bool = Field(
        False, description="function: code_execution: run where bubblewrap cannot isolate programs, in a weak sandbox a hostile program can escape"
    )

    @model_validator(mode="after")
    def _one_source(self) -> RewardConfig:
        sources = {"function": self.function, "reward_model": self.reward_model, "reward_url": self.reward_url, "judge": self.judge}
        given = [key for key, value in sources.items() if value is not None]
        if len(given) != 1:
            raise ValueError(f"set exactly one of function, reward_model, reward_url or judge (got {', '.join(given) or 'none'})")
        if self.function is not None and ":" not in self.function and self.function not in BUILTIN_REWARDS:
            raise ValueError(f"function {self.function!r} is neither a built-in ({', '.join(BUILTIN_REWARDS)}) nor 'package.module:function'")
        if (self.function == "format") != (self.pattern is not None):
            raise ValueError("'pattern' goes with function: format, and format needs a pattern")
        if self.reward_model is None and self.input_format != "auto":
            raise ValueError("input_format goes with reward_model")
        code_fields = {"partial_credit": self.partial_credit, "allow_weak_sandbox": self.allow_weak_sandbox, "code_format": self.code_format != "auto",
                       "case_timeout_s": self.case_timeout_s != 4.0, "wall_factor": self.wall_factor != 10.0, "on_timeout": self.on_timeout != "skip"}
        if self.function != "code_execution" and any(code_fields.values()):
            raise ValueError(f"{', '.join(k for k, v in code_fields.items() if v)}: only for function: code_execution")
        return self

    @property
    def label(self) -> str:
        """The term's metric name: ``name``, else rm, remote, judge, or the function's name."""
        if self.name:
            return self.name
        if self.function is not None:
            return str(self.function).split(":")[-1]
        return "rm" if self.reward_model else "remote" if self.reward_url else "judge"


class SamplingConfig(Config):
    """How completions are drawn during training."""

    max_new_tokens: int = Field(32, ge=1, description="completion length cap; a completion without EOS by then is 'truncated'")
    temperature: float = Field(1.0, gt=0, description="softmax temperature (> 0: RL needs a stochastic policy); training log-probs use the same")
    top_k: int = Field(0, ge=0, description="keep the k most likely tokens (0 = off)")
    top_p: float = Field(1.0, gt=0, le=1, description="nucleus sampling mass (1 = off)")
    attn_implementation: str | None = Field(
        None, description="attention kernel for the decode loop only (null = model.attn_implementation); e.g. sdpa with eager for training on CPU"
    )
    dtype: Literal["bfloat16", "float16"] | None = Field(
        None,
        description="run the decode loop on a copy of the policy held in this dtype, refreshed after each update "
        "(half a policy of memory more; null = sample from the policy itself, under model.autocast if set)",
    )
    compile: bool = Field(
        False,
        description="torch.compile the decode step and the draw (static shapes; one compile per batch size and cache-length bucket, "
        "paid in the first steps; at most 64 versions per process, then eager with a warning); speed in benchmarks/RESULTS.md. "
        "Not under model.autocast without sampling.dtype, nor with model.sharding fsdp",
    )
    cuda_graphs: bool = Field(
        False,
        description="with sampling.compile on a CUDA device, capture the compiled decode step in CUDA graphs (inductor's cudagraph trees): "
        "one graph replay a step instead of a launch per kernel; no effect on a CPU",
    )
    pack_weights: bool = Field(
        True,
        description="with sampling.dtype on a CPU, hold the copy's linear weights in oneDNN's blocked layout (the same values, "
        "read faster by the decode loop, for one more copy of those weights; figures in benchmarks/RESULTS.md)",
    )

    def params(self) -> SamplingParams:
        return SamplingParams(self.max_new_tokens, self.temperature, self.top_k, self.top_p)

    @property
    def packed_copy(self) -> bool:
        """Whether the copy in ``dtype`` gets packed linear weights (``pack_weights``)."""
        return self.dtype is not None and self.pack_weights


class RLOptimConfig(OptimConfig):
    """:class:`rlalign.train.run_config.OptimConfig` with RL defaults: a small, constant learning rate."""

    lr: float = Field(1e-5, gt=0, description="peak learning rate")
    min_lr_ratio: float = Field(1.0, ge=0, le=1, description="final learning rate as a fraction of lr (cosine decay); 1 = constant")


COMPILE_HELP = (
    "torch.compile the policy's training forward and backward, the pi_old recompute and the reference pass (dynamic shapes; compiled during "
    "the first step; the decode loop has sampling.compile). "
    "The compile time pays back only over a long run; figures in benchmarks/RESULTS.md. The compiled passes run every row's prompt (no shared prompts)"
)


def check_compile(compile: bool, model: ModelConfig, sampling: SamplingConfig) -> None:
    """torch 2.13's inductor fails on transformers' eager attention with dynamic shapes (ValueRangeError
    in its symbolic shapes, seen on Llama); SDPA compiles. The compiled decode step needs a StaticCache,
    which autocast rules out (keys and values reach the cache in different dtypes), and whole weights."""
    if compile and model.attn_implementation == "eager":
        raise ValueError("compile=true needs model.attn_implementation sdpa (or null): the eager attention does not compile with dynamic shapes")
    if sampling.compile and model.autocast != "none" and sampling.dtype is None:
        raise ValueError("sampling.compile=true does not work under model.autocast: also set sampling.dtype (e.g. bfloat16) to sample from a low-precision copy")
    if sampling.cuda_graphs and not sampling.compile:
        raise ValueError("sampling.cuda_graphs=true captures the compiled decode step: also set sampling.compile=true")
    if sampling.compile and model.sharding == "fsdp":
        raise ValueError("sampling.compile=true needs whole weights on every rank; with model.sharding=fsdp leave it false")


class EvalConfig(Config):
    """Evaluation during GRPO and PPO: completions of held-out prompts, scored by every reward term."""

    enabled: bool = Field(True, description="evaluate before the first step, every 'every' steps and after the last (when there are held-out prompts)")
    every: int = Field(0, ge=0, description="evaluate every this many steps; 0 = before the first step and after the last only")
    data: DataConfig | None = Field(
        None, description="held-out prompts (fields as data: task, or path with split, subset, columns); null = the eval split of the training "
        "task (training prompts from a file have none: set eval.data to evaluate)"
    )
    num_prompts: int = Field(64, ge=1, description="held-out prompts evaluated (the first this many)")
    num_samples: int = Field(1, ge=1, description="completions per prompt; more than 1 logs pass@k for k = 1, 2, 4, ... up to it (needs temperature > 0)")
    temperature: float = Field(0.0, ge=0, description="0 = greedy; otherwise sampled at this temperature (top_k, top_p off)")
    max_new_tokens: int | None = Field(None, ge=1, description="tokens generated per completion; null = sampling.max_new_tokens")
    pass_threshold: float = Field(1.0, description="a completion passes (pass@k) when its total reward is at least this (1: a rule reward's full score)")
    batch_size: int = Field(64, ge=1, description="prompts per generation batch")
    num_samples_logged: int = Field(8, ge=0, description="completions written to eval_samples.jsonl and the trackers' table at each evaluation")

    @model_validator(mode="after")
    def _samples_need_temperature(self) -> EvalConfig:
        if self.num_samples > 1 and self.temperature == 0:
            raise ValueError(f"eval.num_samples={self.num_samples} greedy completions would all be the same: set eval.temperature > 0 (e.g. 1.0)")
        return self


class AsyncConfig(Config):
    """Asynchronous rollouts (rlalign.train.async_source): a producer process samples and scores ahead
    of the learner, which publishes its weights after each update."""

    enabled: bool = Field(False, description="sample and score apart from the learner while it learns: in a producer process beside it (CPU), or on producer ranks")
    producers: int = Field(
        0, ge=0, description="under torchrun: the last this-many ranks only sample and score (rlalign.train.rank_source) and the others learn; "
        "0: one producer process beside a one-process learner"
    )
    max_staleness: int = Field(
        1, ge=0, description="k: the rollout of step s is sampled by the policy after exactly max(0, s - k) learner steps; 0 reproduces the synchronous run"
    )
    learner_threads: int = Field(1, ge=1, description="torch threads of the learner process")
    producer_threads: int = Field(1, ge=1, description="torch threads of the producer process")
    weight_transport: Literal["auto", "broadcast", "shared"] = Field(
        "auto", description="producer ranks: how the learner's weights reach them (rlalign.train.weight_sync): broadcast (any node), shared "
        "(producers on learner rank 0's host map its slots: shared memory, CUDA IPC on GPUs), auto: shared when every producer is on that host"
    )
    timeout_s: float = Field(600.0, gt=0, description="longest wait for one rollout or weight transfer before the run stops, naming what the producer was doing")


TRL_AGGREGATIONS = {"grpo": "seq-mean-token-mean", "bnpo": "token-mean", "dapo": "token-mean", "dr_grpo": "seq-mean-token-sum-norm"}  # TRL loss_type -> rlalign aggregation


class RLConfig(RunConfig):
    """The fields every RL run has; GRPO and PPO set their own defaults for some of them."""

    output_dir: str = Field("runs/rl", description="run directory: metrics.jsonl, samples.jsonl, checkpoints/, final/, curves.png")
    reference: str | None = Field(None, description="frozen reference checkpoint for the KL term; null = the policy's start (LoRA: the base with adapters off)")
    data: DataConfig = Field(default_factory=lambda: DataConfig(task="arithmetic"), description="training prompts")
    rewards: list[RewardConfig] = Field(default_factory=list, description="reward terms, summed with their weights (train() also takes Python reward functions)")
    sampling: SamplingConfig = Field(default_factory=SamplingConfig, description="sampling during training")
    optim: RLOptimConfig = Field(default_factory=RLOptimConfig, description="the policy's AdamW, schedule and gradient clipping")
    steps: int = Field(100, ge=1, description="RL steps (one rollout each)")
    prompts_per_step: int = Field(8, ge=1, description="prompts per rollout")
    num_minibatches: int = Field(1, ge=1, description="optimiser steps per pass over the rollout")
    micro_batch_size: Annotated[int, Field(ge=1)] | Literal["auto"] | None = Field(
        "auto", description="rows per forward and backward: each optimiser step accumulates its minibatch's gradient over micro-batches "
        "of this many rows (the same update, less memory); also the rows per reference and pi_old pass; null = the whole minibatch; auto = "
        "as many as the memory budget holds (model.memory_fraction of the device; rlalign.train.memory_plan measures what a row keeps)"
    )
    aggregation: Aggregation = Field("seq-mean-token-mean", description=f"token-loss reduction, one of {', '.join(AGGREGATION_MODES)} "
                                     "(token-mean by default with loss_type: cispo)")
    eval: EvalConfig = Field(default_factory=EvalConfig, description="evaluation on held-out prompts (eval/* metrics, eval_samples.jsonl)")
    sample_every: int = Field(10, ge=1, description="log a few completions with their rewards every N steps (samples.jsonl)")
    num_samples_logged: int = Field(4, ge=0, description="completions logged each time")
    compile: bool = Field(False, description=COMPILE_HELP)
    loss_type: Literal["clip", "cispo", "sapo"] = Field(
        "clip", description="the per-token policy objective: clip = PPO's clipped surrogate (GRPO, DAPO, GSPO); cispo = -sg(clip(r, "
        "1 - cispo_eps_low, 1 + cispo_eps_high)) A log pi (MiniMax-M1: clipped tokens keep their gradient); sapo = -(4 / tau) sigmoid(tau (r - 1)) A, "
        "a smooth gate in place of the clip (Gao et al. 2025)"
    )
    dual_clip: float | None = Field(None, gt=1, description="cap the loss of negative-advantage tokens at -c * A (dual clip, c > 1; loss_type clip); null = off")
    cispo_eps_low: float | None = Field(None, gt=0, lt=1, description="CISPO: clip the importance weight below at 1 - this; null = no lower bound (MiniMax-M1)")
    cispo_eps_high: float = Field(
        4.0, gt=0, description="CISPO: clip the importance weight above at 1 + this (4: a cap of 5, TRL's recommended epsilon_high for cispo)"
    )
    sapo_temperature_pos: float = Field(1.0, gt=0, description="SAPO: gate temperature tau of tokens with A > 0 (larger: the gate closes faster off r = 1)")
    sapo_temperature_neg: float = Field(1.05, gt=0, description="SAPO: gate temperature tau of tokens with A <= 0")
    tis_cap: float | None = Field(
        None, gt=0, description="importance weight of the sampling (behaviour) policy: weight each token's policy loss by pi_old / pi_sampler, "
        "truncated at tis_cap or masked above it (tis_mode), when they differ: a low-precision sampler, or asynchronous rollouts (then pi_old is "
        "the learner's proximal policy); e.g. 2.0; null = off (unless tis_min is set)"
    )
    tis_min: float | None = Field(
        None, gt=0, description="lower bound of that weight: truncate raises it to tis_min, mask drops tokens below it; with tis_cap and "
        "tis_mode mask, the band [tis_min, tis_cap] outside which tokens leave the loss (IcePop, e.g. 0.5 and 5.0); null = none"
    )
    tis_mode: Literal["truncate", "mask"] = Field(
        "truncate", description="truncate: w = clip(pi_old / pi_sampler, tis_min, tis_cap) (Yao et al. 2025); "
        "mask: w = pi_old / pi_sampler inside [tis_min, tis_cap], else 0 (the token leaves the loss)"
    )
    tis_level: Literal["token", "sequence"] = Field(
        "token", description="token: one weight per token; sequence: one per completion, the product of its token ratios "
        "exp(sum_t (log pi_old - log pi_sampler)), truncated or masked as a whole (TRL's sequence_truncate / sequence_mask)"
    )
    dynamic_sampling: bool = Field(
        False, description="DAPO dynamic sampling: drop groups whose rewards all tie and draw more prompts until the step holds prompts_per_step "
        "informative groups (one process only; needs groups: GRPO)"
    )
    max_sampling_rounds: int = Field(4, ge=1, description="dynamic sampling: at most this many draws of prompts_per_step prompts per step; then tied groups fill the step")
    tools: ToolsConfig | None = Field(
        None, description="multi-turn tool use (rlalign.train.tool_rollout): tool results appended between turns and left out of the loss; "
        "rewards score the last turn; under torchrun each rank runs its share; null = single-turn"
    )
    environment: EnvironmentConfig | None = Field(
        None, description="multi-turn episodes against a Python environment (rlalign.train.env_source): chat-template tool calls, token-exact, "
        "batched; rewards from the environment and/or the reward terms; null = off"
    )
    agent: AgentConfig | None = Field(
        None, description="rollouts by agent code written against the openai client, served the policy at a local OpenAI-compatible endpoint "
        "(rlalign.agents.agent_source): each call is a row, an episode's rows share its advantage and count once; under torchrun GRPO with DDP only; null = off"
    )
    async_rollouts: AsyncConfig = Field(default_factory=AsyncConfig, description="asynchronous rollout producer with bounded staleness")

    @model_validator(mode="before")
    @classmethod
    def _cispo_aggregates_tokens(cls, data: object) -> object:
        """``loss_type: cispo`` with no aggregation given: token-mean, the batch's tokens as the normaliser, as MiniMax-M1
        (eq. 4) and TRL's ``loss_type: cispo`` have it (a TRL config's cispo would otherwise be averaged per sequence)."""
        if isinstance(data, dict) and data.get("loss_type") == "cispo" and "aggregation" not in data:
            return {**data, "aggregation": "token-mean"}
        return data

    @field_validator("loss_type", mode="before")
    @classmethod
    def _trl_loss_names(cls, value: object) -> object:
        if value in TRL_AGGREGATIONS:
            raise ValueError(
                f"loss_type={value!r} is TRL's name for the clipped surrogate with its aggregation: set loss_type: clip and "
                f"aggregation: {TRL_AGGREGATIONS[value]}"
            )
        return value

    @model_validator(mode="after")
    def _objective_options(self) -> RLConfig:
        if self.loss_type != "clip" and self.dual_clip is not None:
            raise ValueError(f"dual_clip caps the clipped surrogate's loss; loss_type={self.loss_type} has none: set dual_clip: null or loss_type: clip")
        own = {"cispo": ("cispo_eps_low", "cispo_eps_high"), "sapo": ("sapo_temperature_pos", "sapo_temperature_neg")}
        for loss_type, names in own.items():
            changed = [n for n in names if getattr(self, n) != type(self).model_fields[n].default]
            if changed and self.loss_type != loss_type:
                raise ValueError(f"{', '.join(changed)}: only for loss_type: {loss_type} (got loss_type: {self.loss_type})")
        if not self.dynamic_sampling and self.max_sampling_rounds != type(self).model_fields["max_sampling_rounds"].default:
            raise ValueError("max_sampling_rounds caps dynamic sampling's draws: set dynamic_sampling: true (GRPO; PPO and distillation have "
                             "no dynamic sampling), or leave max_sampling_rounds at its default")
        if not self.sampler_correction and (self.tis_mode != "truncate" or self.tis_level != "token"):
            raise ValueError("tis_mode and tis_level shape the sampler's importance weight: set tis_cap (and/or tis_min) to turn it on")
        if self.tis_cap is not None and self.tis_min is not None and self.tis_min >= self.tis_cap:
            raise ValueError(f"tis_min={self.tis_min} must be below tis_cap={self.tis_cap}")
        return self

    @model_validator(mode="after")
    def _compile_needs_sdpa(self) -> RLConfig:
        check_compile(self.compile, self.model, self.sampling)
        if self.tools is not None and self.dynamic_sampling:
            raise ValueError("tools: dynamic_sampling is not supported with multi-turn rollouts")
        if self.environment is not None and (self.tools is not None or self.dynamic_sampling):
            raise ValueError("environment: cannot be combined with tools or dynamic_sampling")
        if self.agent is not None:
            clash = [name for name, on in (("tools", self.tools is not None), ("dynamic_sampling", self.dynamic_sampling),
                                           ("kl_in: reward", getattr(self, "kl_in", "loss") == "reward")) if on]
            if clash:
                raise ValueError(f"agent: {', '.join(clash)} cannot be combined with agent rollouts (the agent's calls are the rollout)")
        if self.async_rollouts.enabled and self.async_rollouts.max_staleness > 0 and self.tis_cap is None:
            raise ValueError(
                "async_rollouts with max_staleness > 0 trains on rollouts of an older policy: set tis_cap (e.g. 2.0) for the behaviour "
                "policy's importance weight (the decoupled objective), or max_staleness: 0"
            )
        return self

    @property
    def sampler_correction(self) -> bool:
        """Whether each token's policy loss is weighted by the sampler's importance weight (tis_cap or tis_min set)."""
        return self.tis_cap is not None or self.tis_min is not None

    @property
    def stale(self) -> bool:
        """Whether rollouts may come from an older policy than the learner's (asynchronous, k > 0)."""
        return self.async_rollouts.enabled and self.async_rollouts.max_staleness > 0

    @property
    def recompute_old_logprobs(self) -> bool:
        """Whether the sampler's log-probs may differ from the training forward's by more than float32
        round-off (bfloat16 autocast, a low-precision sampling copy, or an older policy: asynchronous
        rollouts with k > 0): then log pi_old is recomputed by the learner (the proximal policy)."""
        return self.model.autocast != "none" or self.sampling.dtype is not None or self.stale
