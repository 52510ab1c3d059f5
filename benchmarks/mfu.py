"""Model FLOPs utilisation of one rlalign GRPO step on this machine.

    .venv/bin/python benchmarks/mfu.py --steps 3 --out runs/bench/mfu_smollm2.json
    .venv/bin/python benchmarks/mfu.py --steps 3 --threads 2
    .venv/bin/python benchmarks/mfu.py --steps 3 --autocast     # model.autocast=bfloat16 (float32 master weights)
    .venv/bin/python benchmarks/mfu.py --steps 3 --fast         # + eager training attention, SDPA decode, bfloat16 sampling copy
    .venv/bin/python benchmarks/mfu.py --steps 4 --autocast --compile   # the compiled training forward (step 1 compiles; SDPA: compile rejects eager attention)
    .venv/bin/python benchmarks/mfu.py --steps 3 --fast --ceiling       # + the update's ceiling: its matmuls replayed alone (4. below)
    python benchmarks/mfu.py --device cuda --shape llama-1b --autocast --bf16-sampler --prompts 8 --new-tokens 256 --steps 3   # on a GPU (tools/gpu_check.sh)

1. Peak: ``torch.matmul`` of two n x n matrices (n = 2048 on the CPU, 8192 on a GPU), float32 and
   bfloat16, best of ``--repeats`` timed runs after a warm-up, 2 n^3 FLOPs each, at the step's
   thread count (on a GPU each run is timed between two device synchronisations).
2. FLOPs of one GRPO step, counted analytically from the step's shapes (B rows = prompts x G, P the
   left-padded prompt length, C completion tokens), with N_body the parameters of the decoder
   layers' linear maps, N_head = V x H the LM head, L layers, d = heads x head_dim, and attention
   counted as 4 L d T per token (QK^T and AV, T the context length, no causal halving: the PaLM
   convention):
       generation  prefill 2 N_body U P + 2 N_head U (each of the U distinct prompts once, logits at
                   the last position only),
                   then per decode step 2 (N_body + N_head) B + attention over the cache
       reference   forward over B (P + C) positions: 2 N_body B (P + C) + 2 N_head B C
                   (the LM head at the C positions that predict completion tokens) + attention;
                   with shared prompts (one process: each of the U groups' prompts but its last
                   token runs once, with one position's unused logits; each row then runs its last
                   prompt token and C - 1 completion tokens against that cache)
                   2 N_body U (P - 1) + 2 N_head U + U attn(P - 1, P - 1) + 2 (N_body + N_head) B C
                   + B attn(C, P + C - 1), the positions it runs; none with ``--beta 0`` (no
                   reference pass runs)
       policy      forward + backward = 3 x the reference forward
       pi_old      only when the sampler's numerics differ (bfloat16) and a rollout gets more than one
                   update (mu x minibatches > 1; with one update pi_old is the detached training
                   forward): one more no-grad forward, = the reference forward
   MFU counts the model's work on the completions, not padding: every phase counts each row's own
   completion length C_i in place of C (the sums above run over rows; generation counts a row at
   decode steps t < C_i only), the prompts at their padded length P. B x max C would count padding
   past a row's end, which rlalign mostly does not run (it packs ragged rows): on the tiny model at
   mean 28-33 of max 48 tokens that was 1.03-1.19x the reference pass's executed matmul FLOPs, the
   C_i count 0.69-0.81x of them (what packing leaves of the padding is not counted).
   Random weights never emit EOS, so there every row runs the full ``--new-tokens``: C_i = C.
3. The step: ``rlalign.train.grpo.grpo_step`` on a LlamaForCausalLM with SmolLM2-135M's shape and
   random weights (``--shape tiny`` for the recipe's tiny Llama, ``--shape llama-1b`` for
   Llama-3.2-1B's decoder with SmolLM2's vocabulary, 1.07B parameters), the SmolLM2 tokenizer and chat
   prompts, 2 prompts x G = 8 x 32 new tokens, beta 0.04 (so a reference pass runs), float32
   (``--autocast``: the trainer's ``model.autocast=bfloat16``; ``--dtype bfloat16``: bfloat16 weights).
   The first step is warm-up; the median of the others is reported, with its phases
   (generate / score / reference + train, from the step's own metrics).

MFU = FLOPs / time / peak, against both peaks (the float32 one is the fair ceiling of a float32 step).

4. ``--ceiling`` (with ``--fast``: eager attention in training, so every attention product is a
   ``bmm``; SDPA's fused kernels are not replayed): how far this machine's own kernels let the
   update go at these shapes. One more step runs under a dispatch mode that records every matmul
   of the update (``mm``, ``addmm``, ``bmm``, ``baddbmm``: sizes, strides, dtypes) with its phase
   (the forward with grad, or autograd's backward), and times ``clip_grad_norm_`` and
   ``optimizer.step`` outside that mode. The matmuls are then replayed alone, in the recorded
   order, each on its own fresh tensors of the recorded layout (so no weight is cache-hot that
   the real step would read from memory; median of three replays). The update's floor is its
   matmuls plus clipping and AdamW (memory-bound kernels over every parameter, gradient and
   moment); everything else (norms, activations, casts, softmax, attention masks, the
   log-softmax over the vocabulary) would have to cost nothing to reach it. The update's FLOPs of
   that same step over the floor, against the bfloat16 peak, is the ceiling of its MFU here.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _lm_bench as lb  # noqa: E402



def matmul_peak(dtype: torch.dtype, n: int = 2048, repeats: int = 10, device: str = "cpu") -> float:
    """Best GFLOP/s of ``a @ b`` (n x n, random) over ``repeats`` runs, after two warm-up runs."""
    a, b = torch.randn(n, n, dtype=dtype, device=device), torch.randn(n, n, dtype=dtype, device=device)
    for _ in range(2):
        torch.matmul(a, b)
    best = float("inf")
    for _ in range(repeats):
        lb.synchronize(device)
        t0 = time.perf_counter()
        torch.matmul(a, b)
        lb.synchronize(device)
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best / 1e9


MATMULS = ("mm", "addmm", "bmm", "baddbmm")


def record_matmuls(step, optimizer: torch.optim.Optimizer):
    """Run ``step()`` recording each matmul of the update as (phase, op, per-argument (size,
    stride, dtype) or value, kwargs); phase: "update_forward" (grad enabled) or "update_backward"
    (inside autograd's backward); no-grad passes (sampling, reference) are not recorded. Returns
    the calls, the seconds spent in ``clip_grad_norm_`` and ``optimizer.step`` (run outside the
    recording mode), and what ``step()`` returned."""
    from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

    calls: list[tuple] = []

    class Recorder(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.overloadpacket.__name__ in MATMULS and (torch._C._current_graph_task_id() != -1 or torch.is_grad_enabled()):
                phase = "update_backward" if torch._C._current_graph_task_id() != -1 else "update_forward"
                layout = [(tuple(a.shape), a.stride(), a.dtype) if isinstance(a, torch.Tensor) else a for a in args]
                calls.append((phase, func, layout, dict(kwargs or {})))
            return func(*args, **(kwargs or {}))

    seconds = {"clip_grad_norm": 0.0, "optimizer_step": 0.0}

    def timed(name, fn):
        def wrapper(*args, **kwargs):
            with _disable_current_modes():
                t0 = time.perf_counter()
                out = fn(*args, **kwargs)
                seconds[name] += time.perf_counter() - t0
            return out

        return wrapper

    clip, optimizer_step = torch.nn.utils.clip_grad_norm_, optimizer.step
    torch.nn.utils.clip_grad_norm_, optimizer.step = timed("clip_grad_norm", clip), timed("optimizer_step", optimizer_step)
    try:
        with Recorder():
            returned = step()
    finally:
        torch.nn.utils.clip_grad_norm_, optimizer.step = clip, optimizer_step
    return calls, seconds, returned


def replay_matmuls(calls: list[tuple], repeats: int = 3) -> dict[str, float]:
    """Seconds per phase of the recorded matmuls run alone, in order, each on its own random
    tensors of the recorded layouts (median of ``repeats`` replays)."""

    def tensor(size, stride, dtype):
        extent = 1 + sum((n - 1) * st for n, st in zip(size, stride))
        return torch.randn(extent, dtype=dtype).as_strided(size, stride)

    prepared = [(phase, func, [tensor(*a) if isinstance(a, tuple) and len(a) == 3 and isinstance(a[2], torch.dtype) else a for a in layout], kwargs)
                for phase, func, layout, kwargs in calls]
    runs = []
    for _ in range(repeats + 1):  # the first replay warms up
        per_phase: dict[str, float] = {}
        for phase, func, args, kwargs in prepared:
            t0 = time.perf_counter()
            func(*args, **kwargs)
            per_phase[phase] = per_phase.get(phase, 0.0) + time.perf_counter() - t0
        runs.append(per_phase)
    return {phase: statistics.median(r.get(phase, 0.0) for r in runs[1:]) for phase in runs[0]}


def random_checkpoint(shape: str) -> Path:
    """A random-weight checkpoint (model + SmolLM2's tokenizer) of ``shape`` (``_lm_bench.RANDOM_SHAPES``), or the tiny recipe model."""
    return lb.tiny_checkpoint() if shape == "tiny" else lb.random_checkpoint(shape)


def model_dims(config) -> dict:
    h, layers = config.hidden_size, config.num_hidden_layers
    heads, kv = config.num_attention_heads, config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or h // heads
    ffn = config.intermediate_size
    per_layer = h * heads * head_dim + 2 * h * kv * head_dim + heads * head_dim * h + 3 * h * ffn  # q, k, v, o, gate/up/down
    return {"n_body": layers * per_layer, "n_head": config.vocab_size * h, "layers": layers, "d_attn": heads * head_dim}


def step_flops(
    dims: dict, batch: int, prompt_len: int, completion_len: int, decode_steps: int, groups: int | None = None, prefill_rows: int | None = None,
    completion_lens: Sequence[int] | None = None,
) -> dict[str, float]:
    """Analytic FLOPs of one GRPO step's three phases (see the module docstring). ``groups``: the
    training and reference forwards run each of the U groups' prompts once (shared prompts);
    ``prefill_rows``: the sampler's prefill runs this many rows (its distinct prompts; default B);
    ``completion_lens``: each row's completion tokens C_i, counted by every phase in place of
    ``completion_len`` (default: every row ``completion_len``)."""
    nb, nh, layers, d = dims["n_body"], dims["n_head"], dims["layers"], dims["d_attn"]
    attn = lambda tokens, context: 4 * layers * d * tokens * context  # noqa: E731
    rows = batch if prefill_rows is None else prefill_rows
    lens = [completion_len] * batch if completion_lens is None else list(completion_lens)
    if len(lens) != batch:
        raise ValueError(f"completion_lens has {len(lens)} rows, not {batch}")
    gen = 2 * nb * rows * prompt_len + 2 * nh * rows + rows * attn(prompt_len, prompt_len)
    for t in range(1, decode_steps):  # decode step t feeds token t-1 at context P + t, for the rows still running (C_i > t)
        live = sum(c > t for c in lens)
        gen += 2 * (nb + nh) * live + live * attn(1, prompt_len + t)
    p = prompt_len
    if groups is None or p == 1:  # one forward over prompt + completion per row (a one-token prompt shares nothing)
        forward = sum(2 * nb * (p + c) + 2 * nh * c + attn(p + c, p + c) for c in lens)
    else:  # U rows of P - 1 prompt tokens (one position's logits), then B rows of the last prompt token + C_i - 1 completion tokens
        forward = 2 * nb * groups * (p - 1) + 2 * nh * groups + groups * attn(p - 1, p - 1)
        forward += sum(2 * (nb + nh) * c + attn(c, p + c - 1) for c in lens)
    return {"generate": gen, "reference": forward, "policy_fwd_bwd": 3 * forward}


def capture_completion_lengths() -> list[list[int]]:
    """Each later GRPO step's per-row completion lengths (EOS included), appended to the returned list:
    ``grpo.completion_stats``, which ``grpo_step`` looks up at call time, wrapped in this process."""
    from rlalign.train import grpo

    seen: list[list[int]] = []
    inner = grpo.completion_stats

    def wrapper(rollout, *args, **kwargs):
        seen.append([int(n) for n in rollout.completion_lengths().tolist()])
        return inner(rollout, *args, **kwargs)

    grpo.completion_stats = wrapper
    return seen


def profile_step(setup, part: str, device: str) -> str:
    """One more step with ``part`` ("step": all of it; "update": the policy update's forwards, backwards,
    clipping and AdamW, ``Updater.accumulated_step``) under torch.profiler: the operators by self
    device time (on a GPU) and self host time."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.startswith("cuda")
    profiles = []

    def profiled(fn):
        def run(*args, **kwargs):
            with profile(activities=[ProfilerActivity.CPU] + [ProfilerActivity.CUDA] * cuda) as prof:
                out = fn(*args, **kwargs)
                lb.synchronize(device)
            profiles.append(prof)
            return out

        return run

    if part == "update":
        setup.updater.accumulated_step = profiled(setup.updater.accumulated_step)  # this instance only
        try:
            setup.step()
        finally:
            del setup.updater.accumulated_step
    else:
        profiled(setup.step)()
    events = profiles[0].key_averages()  # the first update of the step (mu x minibatches may make more)
    tables = [events.table(sort_by=key, row_limit=25, max_name_column_width=70) for key in ["self_device_time_total"] * cuda + ["self_cpu_time_total"]]
    return f"{part}, {len(profiles)} profiled call(s), the first shown:\n" + "\n".join(tables)


def run(args) -> dict:
    torch.set_num_threads(args.threads)
    from rlalign.lm.encoding import encode_prompts
    from rlalign.tasks import TASKS
    from rlalign.train.grpo import GRPOConfig
    from rlalign.train.passes import share_prompts
    from rlalign.train.rollouts import prompt_batch

    n = args.n or (8192 if args.device.startswith("cuda") else 2048)
    peaks = {"float32": matmul_peak(torch.float32, n, args.repeats, args.device), "bfloat16": matmul_peak(torch.bfloat16, n, args.repeats, args.device)}
    path = random_checkpoint(args.shape)
    if args.shape == "tiny":
        records, reward = TASKS["arithmetic"].prompt_records("train", 256, 0), lb.arithmetic_reward
    else:
        records, reward = lb.chat_arithmetic_records(256, 0), lb.chat_arithmetic_reward
    cfg = GRPOConfig.model_validate(
        dict(
            output_dir=tempfile.mkdtemp(prefix="bench_mfu_"), seed=0, num_threads=args.threads,
            model=dict(path=str(path), dtype=args.dtype, autocast="bfloat16" if args.autocast or args.fast else "none",
                       attn_implementation="eager" if args.fast else None, device=args.device),
            sampling=dict(max_new_tokens=args.new_tokens, temperature=0.7,
                          attn_implementation="sdpa" if args.fast else None, dtype="bfloat16" if args.fast or args.bf16_sampler else None),
            optim=dict(lr=1e-6, betas=(0.9, 0.95), warmup_steps=0, min_lr_ratio=1.0, grad_clip=1.0, bf16_rounding=args.bf16_rounding),
            steps=args.steps, prompts_per_step=args.prompts, group_size=args.group_size, beta=args.beta, progress=False, plots=False,
            compile=args.compile, micro_batch_size=None if args.micro_batch_size == "null" else args.micro_batch_size,
        )
    )
    if args.memory_cap_gb and args.device.startswith("cuda"):
        torch.cuda.set_per_process_memory_fraction(min(1.0, args.memory_cap_gb * 1e9 / torch.cuda.mem_get_info()[1]))
    setup = lb.GRPOSetup(cfg, records, reward)  # grpo.train()'s setup, without its outer loop
    dims = model_dims(setup.policy.config)
    lengths = capture_completion_lengths()  # lengths[-1]: the last step's C_i

    def next_prompt_len() -> int:
        batch = [ex.prompt for ex in prompt_batch(setup.run.prompts, setup.state.step, cfg.prompts_per_step, cfg.seed)]
        return max(len(ids) for ids in encode_prompts(setup.run.tokenizer, batch))  # left-padded to the longest

    def counted_flops(prompt_len: int, metrics: dict) -> tuple[dict, dict, int]:
        rows = cfg.prompts_per_step * cfg.group_size
        completion_len = int(metrics["completion_len/max"])  # the rollout's C (every row runs to the cap with random weights)
        shared = share_prompts(setup.updater.model) and not cfg.compile  # the compiled training forward runs prompt + completion per row
        flops = step_flops(dims, rows, prompt_len, completion_len, completion_len, cfg.prompts_per_step if shared else None, cfg.prompts_per_step, lengths[-1])
        flops_full = step_flops(dims, rows, prompt_len, completion_len, completion_len, completion_lens=lengths[-1])  # had every row run its own prompt
        if cfg.recompute_old_logprobs and cfg.mu * cfg.num_minibatches > 1:  # log pi_old recomputed by one more no-grad forward
            flops["old_logp"] = flops["reference"]
        if cfg.beta == 0:  # no reference model, no reference pass (lb.GRPOSetup, grpo_step)
            del flops["reference"], flops_full["reference"]
        return flops, flops_full, completion_len

    steps = []
    for _ in range(args.steps):
        prompt_len = next_prompt_len()
        lb.synchronize(args.device)
        if args.device.startswith("cuda"):  # the step's own peak (the trainer's outer loop, which records it, is not run here)
            torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        metrics = setup.step()
        lb.synchronize(args.device)
        dt = time.perf_counter() - t0
        if args.device.startswith("cuda"):
            metrics["memory/peak_mb"] = torch.cuda.max_memory_allocated() / 2**20
        flops, flops_full, completion_len = counted_flops(prompt_len, metrics)
        steps.append({"time": dt, "prompt_len": prompt_len, "completion_len": completion_len, "clipped_frac": metrics["completion_len/clipped_frac"],
                      "t_generate": metrics["time/generate"], "t_score": metrics["time/score"], "t_train": metrics["time/train"], "flops": flops,
                      "t_update": metrics["time/update"], "flops_full_forward": flops_full,
                      "ratio_dev_first": metrics["ratio_dev/first"], "logprob_mismatch": metrics.get("logprob_mismatch"), "kl": metrics.get("kl"),
                      "peak_gpu_mb": metrics.get("memory/peak_mb"), "micro_rows": metrics.get("memory/micro_rows"), "pass_rows": metrics.get("memory/pass_rows"), "budget_mb": metrics.get("memory/budget_mb")})
        print(f"step {len(steps)}: {dt:.2f} s (generate {metrics['time/generate']:.2f}, ref + train {metrics['time/train']:.2f}), P={prompt_len}, C={completion_len}, "
              f"rows per update forward {metrics.get('memory/micro_rows')}, per no-grad pass {metrics.get('memory/pass_rows')} "
              f"(planned for {metrics.get('memory/budget_mb')} MB), "
              f"peak GPU memory {metrics.get('memory/peak_mb')} MB, "
              f"max |ratio - 1| before the update {metrics['ratio_dev/first']:.2e}, sampler-vs-training log-prob mismatch {metrics.get('logprob_mismatch')}",
              file=sys.stderr)

    timed = steps[1:] or steps
    med = lambda key: statistics.median(s[key] for s in timed)  # noqa: E731
    flops_gen = statistics.median(s["flops"]["generate"] for s in timed)
    flops_train = statistics.median(sum(v for k, v in s["flops"].items() if k != "generate") for s in timed)
    flops_total = flops_gen + flops_train
    flops_update = statistics.median(s["flops"]["policy_fwd_bwd"] for s in timed)
    result = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "threads": args.threads, "dtype": args.dtype, "bf16_rounding": args.bf16_rounding, "autocast_bf16": args.autocast or args.fast, "fast": args.fast, "compile": args.compile,
        "shape": args.shape, "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu", "matmul_n": n,
        "bf16_sampler": args.fast or args.bf16_sampler,
        "peak_gflops": peaks, "dims": dims, "n_params": lb.count_parameters(setup.policy), "load": lb.machine_load(),
        "steps": steps, "median_step_s": med("time"), "median_generate_s": med("t_generate"), "median_ref_train_s": med("t_train"),
        "median_update_s": med("t_update"), "flops_update": flops_update,
        "flops_generate": flops_gen, "flops_ref_train": flops_train, "flops_step": flops_total,
        "torch": torch.__version__, "rlalign_commit": lb.code_version(), "micro_batch_size": args.micro_batch_size,
        "memory_cap_gb": args.memory_cap_gb, "peak_gpu_mb": max((s["peak_gpu_mb"] or 0.0) for s in steps) or None,
    }
    if args.ceiling:
        prompt_len = next_prompt_len()
        calls, seconds, metrics = record_matmuls(setup.step, setup.updater.optimizer)
        recorded_update_flops = counted_flops(prompt_len, metrics)[0]["policy_fwd_bwd"]  # this step's own shapes
        matmul_s = replay_matmuls(calls)
        update_matmul_s = matmul_s.get("update_forward", 0.0) + matmul_s.get("update_backward", 0.0)
        floor_s = update_matmul_s + seconds["clip_grad_norm"] + seconds["optimizer_step"]
        result["ceiling"] = {
            "matmul_calls": len(calls), "matmul_s": matmul_s, "clip_grad_norm_s": seconds["clip_grad_norm"], "optimizer_step_s": seconds["optimizer_step"],
            "prompt_len": prompt_len, "update_flops": recorded_update_flops, "update_floor_s": floor_s,
            "update_matmul_gflops": recorded_update_flops / update_matmul_s / 1e9, "update_ceiling_gflops": recorded_update_flops / floor_s / 1e9,
        }
    if args.profile:  # one more step, all of it or its policy update alone, under torch.profiler
        result["profile"] = profile_step(setup, args.profile, args.device)
    result["achieved_gflops"] = {
        "step": flops_total / result["median_step_s"] / 1e9,
        "generate": flops_gen / result["median_generate_s"] / 1e9,
        "ref_train": flops_train / result["median_ref_train_s"] / 1e9,
        "update": flops_update / result["median_update_s"] / 1e9,
    }
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", choices=["smollm2", "llama-1b", "qwen-0.5b", "tiny"], default="smollm2")
    parser.add_argument("--device", default="cpu", help="model.device of the step and the device of the peak matmuls: cpu or cuda")
    parser.add_argument("--steps", type=int, default=3, help="GRPO steps; the first is warm-up")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="parameter dtype of policy and reference")
    parser.add_argument("--bf16-rounding", choices=["nearest", "stochastic"], default="stochastic",
                        help="optim.bf16_rounding with --dtype bfloat16 (nearest is refused at this lr: most steps would round away)")
    parser.add_argument("--autocast", action="store_true", help="model.autocast=bfloat16: forwards in bfloat16 autocast, float32 master weights")
    parser.add_argument("--fast", action="store_true", help="--autocast with eager training attention, SDPA decode and a bfloat16 sampling copy")
    parser.add_argument("--compile", action="store_true", help="the trainer's compile option (the first, untimed step compiles; not with --fast)")
    parser.add_argument("--bf16-sampler", action="store_true", help="sampling.dtype=bfloat16 alone: the decode loop on a bfloat16 copy, training attention left at its default")
    parser.add_argument("--prompts", type=int, default=2)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--beta", type=float, default=0.04)
    parser.add_argument("--n", type=int, default=None, help="matmul size of the peak measurement (default 2048 on the CPU, 8192 on a GPU)")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--ceiling", action="store_true", help="one more step: replay its matmuls alone and time clipping + AdamW (see 4. above)")
    parser.add_argument("--micro-batch-size", default="auto", help="the trainer's micro_batch_size: auto (rows from the memory budget), null, or rows")
    parser.add_argument("--memory-cap-gb", type=float, help="CUDA: hold this process to that much of the card (set_per_process_memory_fraction), "
                        "e.g. 80 for an 80 GB GPU's budget on a larger one")
    parser.add_argument("--profile", nargs="?", const="step", choices=["step", "update"],
                        help="then one more step under torch.profiler, all of it (step, the default) or its policy update alone: the operators by self device and host time")
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    if args.ceiling and args.device != "cpu":
        parser.error("--ceiling times the replayed matmuls with the host clock, CPU only")
    if args.ceiling and not args.fast:
        parser.error("--ceiling needs --fast: eager attention in training, whose products are bmm calls (SDPA's fused kernels are not replayed)")
    r = run(args)
    g = r["achieved_gflops"]
    print(f"\nMFU of one rlalign GRPO step, {r['shape']} shape ({r['n_params'] / 1e6:.1f}M parameters, {r['dtype']}"
          f"{', bf16 autocast' if r['autocast_bf16'] else ''}), {args.prompts} x {args.group_size} x {args.new_tokens} new tokens, "
          f"on {r['device']}, {r['threads']} thread(s), load {r['load']}, rlalign {r['rlalign_commit']}\n")
    print(f"matmul peak ({r['matmul_n']}x{r['matmul_n']}, best of {args.repeats}): float32 {r['peak_gflops']['float32']:.1f} GFLOP/s, "
          f"bfloat16 {r['peak_gflops']['bfloat16']:.1f} GFLOP/s\n")
    print("| phase | GFLOP | median s | GFLOP/s | MFU vs fp32 peak | MFU vs bf16 peak |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, flops, secs, rate in (
        ("generate", r["flops_generate"], r["median_generate_s"], g["generate"]),
        ("reference + policy fwd/bwd + AdamW" + (" + pi_old forward" if any("old_logp" in s["flops"] for s in r["steps"]) else ""),
         r["flops_ref_train"], r["median_ref_train_s"], g["ref_train"]),
        ("  of which the policy update (fwd + bwd + clip + AdamW)", r["flops_update"], r["median_update_s"], g["update"]),
        ("whole step", r["flops_step"], r["median_step_s"], g["step"]),
    ):
        print(f"| {name} | {flops / 1e9:.1f} | {secs:.2f} | {rate:.1f} | {rate / r['peak_gflops']['float32']:.1%} | {rate / r['peak_gflops']['bfloat16']:.1%} |")
    rows = sorted({(s["micro_rows"], s["pass_rows"]) for s in r["steps"]})
    print(f"\nmemory: micro_batch_size {r['micro_batch_size']}, rows per update forward / per no-grad pass {rows}, "
          f"peak GPU memory of a step {r['peak_gpu_mb']} MB" + (f" (process capped at {r['memory_cap_gb']} GB)" if r["memory_cap_gb"] else ""))
    print("\nA float32 step's ceiling is the float32 peak; under bfloat16 autocast or bfloat16 weights the matmuls run in bfloat16, so the "
          "bfloat16 column is the one that applies (the float32 column can then pass 100%).")
    if "ceiling" in r:
        c, bf16_peak = r["ceiling"], r["peak_gflops"]["bfloat16"]
        mm = c["matmul_s"]
        print(f"\nCeiling of the policy update at these shapes ({c['matmul_calls']} matmuls of the update recorded in one more step, P = {c['prompt_len']}, replayed alone):\n")
        print("| part of the update | s | share of the measured update |")
        print("|---|---:|---:|")
        for name, secs in (("matmuls, forward", mm.get("update_forward", 0.0)), ("matmuls, backward", mm.get("update_backward", 0.0)),
                           ("clip_grad_norm_", c["clip_grad_norm_s"]), ("AdamW step", c["optimizer_step_s"]),
                           ("floor: the four above", c["update_floor_s"]), ("measured update", r["median_update_s"])):
            print(f"| {name} | {secs:.3f} | {secs / r['median_update_s']:.0%} |")
        print(f"\nThe update's matmuls alone run at {c['update_matmul_gflops']:.1f} GFLOP/s ({c['update_matmul_gflops'] / bf16_peak:.1%} of the bfloat16 peak); "
              f"at the floor the update would reach {c['update_ceiling_gflops']:.1f} GFLOP/s, an MFU of {c['update_ceiling_gflops'] / bf16_peak:.1%} "
              f"(measured: {g['update'] / bf16_peak:.1%}).")
    if "profile" in r:
        print(f"\nOne more step under torch.profiler, operators by self time:\n{r['profile']}")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(r, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
