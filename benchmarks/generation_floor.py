"""rlalign's sampler against the memory-bandwidth floor of decoding, as GRPO samples.

    python benchmarks/generation_floor.py --device cuda --shape llama-1b --rows 64 256 --compile --cuda-graphs   # tools/gpu_check.sh
    .venv/bin/python benchmarks/generation_floor.py --shape smollm2 --rows 8 32 --new-tokens 64 --threads 2     # on this CPU

Each decode step of a batch has to read every weight the step uses once and each row's KV cache up to
that step; nothing can make it faster than those bytes over the memory's bandwidth. So:

1. Bandwidth: a copy of a large buffer (``--buffer-gb``) on the device, read + write bytes over the
   best of ``--repeats`` timed copies (``--bandwidth-gbs`` gives a figure instead).
2. Bytes a decode step reads, in the model's dtype (bfloat16 here, as ``sampling.dtype`` samples):
   the weights W, each parameter once (a tied LM head counts once; an untied input embedding is not
   read whole, only B of its rows, and is left out), and per row the cache 2 L H_kv d_head bytes a
   position (keys and values of every layer).
3. Floors of ``--new-tokens`` N tokens for B rows and prompts of P tokens: weights only, N W / bw (the
   issue's ~0.13 s at 1B: 2.1 GB over 4.3 TB/s x 256 tokens), and weights plus caches,
   sum over t < N of (W + B 2 L H_kv d_head (P + t)) / bw.
4. Measured: :func:`rlalign.lm.sampling.sample` on the model (random weights, seed 0; SDPA; prompts of
   ``--group-size`` G rows each, each prefilled once as GRPO's are) with no stop token, so every row
   runs N tokens; ``--compile`` / ``--cuda-graphs`` as ``sampling.compile`` / ``sampling.cuda_graphs``.
   Per batch size, ``--warmup`` calls (compiling and recording the graphs), then the median of
   ``--repeats`` timed ones. The whole call includes the prefill; the decode alone is that minus the
   median of a one-token call (prefill and one draw), against the floors of N - 1 tokens.

Prints one table (tokens/s, the two floors, measured over each) and writes it with the setup to
``--out`` as JSON. ``--profile`` then runs one more call of the first batch size under
``torch.profiler`` and prints the operators that took the most time on the device and on the host
(where a step's time goes when it is far above the floor).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _lm_bench as lb  # noqa: E402

from rlalign.lm.model_modes import attention_kernel, evaluating  # noqa: E402
from rlalign.lm.sampling import SamplingParams, sample  # noqa: E402



def copy_bandwidth(device: str, gigabytes: float, repeats: int) -> float:
    """Bytes per second a device-to-device copy of ``gigabytes`` moves (read + write), best of ``repeats``."""
    src = torch.ones(int(gigabytes * 1e9) // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)  # warm-up: pages touched, kernels loaded
    best = float("inf")
    for _ in range(repeats):
        lb.synchronize(device)
        start = time.perf_counter()
        dst.copy_(src)
        lb.synchronize(device)
        best = min(best, time.perf_counter() - start)
    return 2 * src.numel() * src.element_size() / best


def weight_bytes(model: nn.Module) -> int:
    """Bytes of the weights one decode step reads: every parameter once (shared ones, such as a tied
    LM head, once), less an input embedding that is not also the output layer (a step gathers only
    its batch's rows of it)."""
    embedding, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    skip = set() if embedding is head else {id(embedding)}
    unique = {id(p): p for p in model.parameters() if id(p) not in skip}
    return sum(p.numel() * p.element_size() for p in unique.values())


def cache_bytes_per_position(config, element_size: int) -> int:
    """Bytes of KV cache one position of one row holds: keys and values of every layer. 2 L H_kv d_head x element size."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim * element_size


def floor_seconds(weights: int, per_position: int, rows: int, prompt_len: int, steps: int, bandwidth: float) -> tuple[float, float]:
    """(weights only, weights and caches) floors of ``steps`` decode steps at ``bandwidth`` bytes/s:
    steps W / bw, and sum_{t < steps} (W + rows per_position (prompt_len + t)) / bw."""
    positions = steps * prompt_len + steps * (steps - 1) // 2  # sum_{t < steps} (P + t)
    return steps * weights / bandwidth, (steps * weights + rows * per_position * positions) / bandwidth


def build_model(shape: str, device: str, width: int | None = None) -> nn.Module:
    """A random-weight Llama of ``_lm_bench.RANDOM_SHAPES[shape]`` in bfloat16 on ``device`` (seed 0), no stop token;
    with ``width``, the shape's layers and vocabulary at that hidden width (2 heads, 1 KV head, an MLP of 2 x width):
    almost no weights or cache to read, so a step's time is what it costs beyond the floor, at the same depth."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = dict(lb.RANDOM_SHAPES[shape])
    if width is not None:
        config.update(hidden_size=width, intermediate_size=2 * width, num_attention_heads=2, num_key_value_heads=1, head_dim=width // 2)
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(LlamaConfig(**config))
    return model.to(torch.bfloat16).eval()


def time_sample(model: nn.Module, ids: torch.Tensor, mask: torch.Tensor, new_tokens: int, group_size: int, args) -> float:
    """Seconds of one :func:`sample` call of ``new_tokens`` tokens for every row (no stop token)."""
    lb.synchronize(args.device)
    start = time.perf_counter()
    rollout = sample(model, (ids, mask), SamplingParams(max_new_tokens=new_tokens, temperature=1.0, top_k=0, top_p=1.0), pad_token_id=0,
                     eos_token_ids=[-1], group_size=group_size, compile=args.compile, cuda_graphs=args.cuda_graphs)
    lb.synchronize(args.device)
    seconds = time.perf_counter() - start
    assert rollout.completion_ids.shape == (ids.shape[0] * group_size, new_tokens), rollout.completion_ids.shape
    return seconds


def prompts_of(model: nn.Module, rows: int, args) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows // G prompts of ``args.prompt_len`` random tokens (seeded by ``rows``) and their mask, on the device. Shape: (rows / G, P) each."""
    generator = torch.Generator().manual_seed(rows)
    ids = torch.randint(3, model.config.vocab_size, (rows // args.group_size, args.prompt_len), generator=generator).to(args.device)
    return ids, torch.ones_like(ids)


def median_seconds(model: nn.Module, rows: int, new_tokens: int, args) -> float:
    """Median of ``args.repeats`` timed calls after ``args.warmup`` untimed ones, for ``rows`` rows."""
    ids, mask = prompts_of(model, rows, args)
    for _ in range(args.warmup):
        time_sample(model, ids, mask, new_tokens, args.group_size, args)
    return statistics.median(time_sample(model, ids, mask, new_tokens, args.group_size, args) for _ in range(args.repeats))


def measure(model: nn.Module, rows: int, bandwidth: float, args) -> dict:
    """One row of the table: measured seconds, tokens/s and the floors for ``rows`` rows."""
    weights = weight_bytes(model)
    per_position = cache_bytes_per_position(model.config, next(model.parameters()).element_size())
    whole = median_seconds(model, rows, args.new_tokens, args)
    first = median_seconds(model, rows, 1, args)
    n = args.new_tokens
    floor_w, floor_kv = floor_seconds(weights, per_position, rows, args.prompt_len, n, bandwidth)
    decode_w, decode_kv = floor_seconds(weights, per_position, rows, args.prompt_len + 1, n - 1, bandwidth)
    decode = whole - first
    return {
        "rows": rows, "new_tokens": n, "whole_s": whole, "one_token_s": first, "decode_s": decode, "tokens_per_s": rows * n / whole,
        "floor_weights_s": floor_w, "floor_weights_cache_s": floor_kv, "decode_floor_weights_s": decode_w, "decode_floor_weights_cache_s": decode_kv,
        "whole_over_floor_weights": whole / floor_w, "decode_over_floor_weights": decode / decode_w, "decode_over_floor_weights_cache": decode / decode_kv,
    }


def profile_call(model: nn.Module, rows: int, args, top: int = 15) -> str:
    """The ``top`` operators of one :func:`sample` call of ``rows`` rows by self device time (on a GPU) and by self host time."""
    from torch.profiler import ProfilerActivity, profile

    ids, mask = prompts_of(model, rows, args)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if args.device.startswith("cuda") else [])
    with profile(activities=activities) as prof:
        seconds = time_sample(model, ids, mask, args.new_tokens, args.group_size, args)
    events = prof.key_averages()
    tables = [f"one call of {rows} rows under the profiler: {seconds:.3f} s"]
    for key in (["self_device_time_total"] if args.device.startswith("cuda") else []) + ["self_cpu_time_total"]:
        tables.append(events.table(sort_by=key, row_limit=top, max_name_column_width=60))
    return "\n".join(tables)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(lb.RANDOM_SHAPES), default="llama-1b")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--rows", type=int, nargs="+", default=[64, 256], help="batch sizes B (prompts x G)")
    parser.add_argument("--group-size", type=int, default=8, help="G rows per prompt; each prompt is prefilled once")
    parser.add_argument("--prompt-len", type=int, default=34, help="prompt tokens P (the chat prompts of benchmarks/grpo_vs_trl.py)")
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--compile", action="store_true", help="sampling.compile: the decode step under torch.compile")
    parser.add_argument("--cuda-graphs", action="store_true", help="sampling.cuda_graphs: the compiled step replayed as a CUDA graph")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--buffer-gb", type=float, default=None, help="size of the copied buffer (default 4 on a GPU, 0.5 on a CPU)")
    parser.add_argument("--bandwidth-gbs", type=float, default=None, help="the memory bandwidth in GB/s instead of measuring it")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    parser.add_argument("--width", type=int, default=None,
                        help="the shape's layers and vocabulary at this hidden width: a step's cost beyond reading the weights")
    parser.add_argument("--profile", action="store_true", help="then profile one call of the first batch size (torch.profiler)")
    parser.add_argument("--out", default=None, help="JSON file for the table and the setup")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if any(rows % args.group_size for rows in args.rows):
        parser.error(f"--rows must be multiples of --group-size {args.group_size}")
    if args.new_tokens < 2:
        parser.error("--new-tokens must be at least 2 (the decode alone is the call less a one-token call)")
    on_gpu = args.device.startswith("cuda")
    if args.bandwidth_gbs is not None:
        bandwidth = args.bandwidth_gbs * 1e9
    else:
        bandwidth = copy_bandwidth(args.device, args.buffer_gb or (4.0 if on_gpu else 0.5), args.repeats + 2)
    if args.width is not None and (args.width < 2 or args.width % 2):
        parser.error("--width must be an even number >= 2 (two heads)")
    model = build_model(args.shape, args.device, args.width)
    name = torch.cuda.get_device_name() if on_gpu else f"{platform.processor() or 'cpu'}, {torch.get_num_threads()} threads"
    setup = {
        "device": name, "shape": args.shape, "width": args.width, "parameters": lb.count_parameters(model), "weight_bytes": weight_bytes(model),
        "cache_bytes_per_position": cache_bytes_per_position(model.config, 2), "bandwidth_gbs": bandwidth / 1e9,
        "bandwidth_measured": args.bandwidth_gbs is None, "group_size": args.group_size, "prompt_len": args.prompt_len,
        "compile": args.compile, "cuda_graphs": args.cuda_graphs, "repeats": args.repeats, "torch": torch.__version__, "code": lb.code_version(),
    }
    print(f"{args.shape}{'' if args.width is None else f' at width {args.width}'} ({setup['parameters'] / 1e9:.2f}B parameters, {setup['weight_bytes'] / 1e9:.2f} GB of bfloat16 weights read a step) on {name}; "
          f"bandwidth {bandwidth / 1e9:.0f} GB/s ({'copy, measured' if setup['bandwidth_measured'] else 'given'}); prompts of {args.prompt_len} tokens, "
          f"G {args.group_size}, {args.new_tokens} new tokens, compile {args.compile}, CUDA graphs {args.cuda_graphs}, median of {args.repeats}")
    table = []
    with torch.no_grad(), evaluating(model), attention_kernel(model, "sdpa"):
        for rows in args.rows:
            table.append(measure(model, rows, bandwidth, args))
    print("| rows | whole call s | tokens/s | floor, weights s | whole / floor | decode s | decode / floor, weights | decode / floor, weights + cache |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in table:
        print(f"| {r['rows']} | {r['whole_s']:.3f} | {r['tokens_per_s']:.0f} | {r['floor_weights_s']:.3f} | {r['whole_over_floor_weights']:.2f}x | "
              f"{r['decode_s']:.3f} | {r['decode_over_floor_weights']:.2f}x | {r['decode_over_floor_weights_cache']:.2f}x |")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"setup": setup, "table": table}, indent=1))
    if args.profile:
        with torch.no_grad(), evaluating(model), attention_kernel(model, "sdpa"):
            print(profile_call(model, args.rows[0], args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
