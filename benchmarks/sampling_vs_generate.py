"""Our batched sampler (rlalign.lm.sampling.sample) against ``model.generate`` on the same model and batch.

    python benchmarks/sampling_vs_generate.py --model tiny --threads 2
    python benchmarks/sampling_vs_generate.py --model smollm2-shape --device cuda --dtype bfloat16
    python benchmarks/sampling_vs_generate.py --model smollm2-shape --dtype bfloat16 --threads 1 --batch 8 16 --new-tokens 32 --packed
    python benchmarks/sampling_vs_generate.py --model smollm2-shape --group-size 8 --prompt-len 200 256 --batch 8 16
    python benchmarks/sampling_vs_generate.py --model smollm2-shape --dtype bfloat16 --threads 1 --batch 8 32 --new-tokens 32 --packed --compile --matmuls
    python benchmarks/sampling_vs_generate.py --model tiny --ours-dtype bfloat16 --packed --threads 1 --compile --batch 8 64

``--group-size G`` samples G completions of each of B / G prompts, as GRPO does: ours with
``group_size=G`` (each prompt prefilled once, its cache repeated), ``generate`` with
``num_return_sequences=G`` (it repeats the prompts before the prefill).

Both sample at temperature 1 with no EOS (every row runs ``--new-tokens`` tokens), from the same
left-padded prompts of different lengths. Throughput = B * new tokens / wall time; each
configuration is timed ``--repeats`` times, alternating which of the two runs first, and the
median is reported.

``--ours-dtype bfloat16`` on a float32 ``--model``: each side at its fastest setting where
``generate`` is fastest in float32 (the tiny model, whose float32 matmuls are small): ``generate``
on the float32 model, ours on a bfloat16 copy of it, as training samples with
``sampling.dtype: bfloat16`` (its distribution is the bfloat16 model's, not the float32 one's).

``--matmuls`` then runs each side once more under the torch profiler and sums the time of its
matrix multiplies (the linear layers and the LM head: ``aten::mm`` / ``addmm``, oneDNN's
``_linear_pointwise``). Dividing ``generate``'s median time by ours spent in matmuls alone gives
the ceiling of the speed-up with these kernels: what it would be if everything else in our step
cost nothing. Where the ceiling is below a target, no change outside the matmul kernels reaches it.

Models are built locally from a config (random weights: speed does not depend on them): ``tiny``
is the recipe's character-level Llama, ``smollm2-shape`` has SmolLM2-135M's shape (hidden 576,
30 layers, vocabulary 49152).
"""

from __future__ import annotations

import argparse
import copy
import platform
import statistics
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from rlalign.lm.models import cast_copy
from rlalign.lm.packed import can_pack_linear, pack_linear_layers
from rlalign.lm.sampling import SamplingParams, left_pad, sample
from rlalign.tasks.tiny_model import TinyModelSpec, build_char_tokenizer, build_tiny_llama

SHAPES = {
    "smollm2-shape": dict(
        vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3
    ),
}


def build_model(name: str, dtype: torch.dtype, device: str) -> LlamaForCausalLM:
    if name == "tiny":
        model = build_tiny_llama(build_char_tokenizer(), TinyModelSpec())
    else:
        torch.manual_seed(0)
        model = LlamaForCausalLM(LlamaConfig(**SHAPES[name], tie_word_embeddings=True, pad_token_id=0, bos_token_id=1, eos_token_id=2))
    model.generation_config.eos_token_id = None  # no stop token: every row runs the full length
    model.generation_config.pad_token_id = 0
    return model.to(device=device, dtype=dtype).eval()


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def time_ours(model, ids, mask, new_tokens: int, device: str, group_size: int = 1, compile: bool = False) -> float:
    sync(device)
    start = time.perf_counter()
    rollout = sample(model, (ids, mask), SamplingParams(max_new_tokens=new_tokens, temperature=1.0), pad_token_id=0, eos_token_ids=[-1], group_size=group_size, compile=compile)
    sync(device)
    assert rollout.completion_ids.shape[1] == new_tokens
    return time.perf_counter() - start


def time_generate(model, ids, mask, new_tokens: int, device: str, group_size: int = 1) -> float:
    sync(device)
    start = time.perf_counter()
    out = model.generate(
        input_ids=ids, attention_mask=mask, do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=new_tokens, num_return_sequences=group_size
    )
    sync(device)
    assert out.shape[1] == ids.shape[1] + new_tokens
    return time.perf_counter() - start


MATMUL_OPS = ("aten::mm", "aten::addmm", "mkldnn::_linear_pointwise")  # the linear layers and the LM head (attention runs SDPA or bmm)


def matmul_seconds(call) -> float:
    """Seconds ``call()`` spends in :data:`MATMUL_OPS` (self CPU time under the torch profiler)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        call()
    return sum(event.self_cpu_time_total for event in prof.key_averages() if event.key in MATMUL_OPS) / 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=["tiny", *SHAPES], default="tiny")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="the model's dtype: generate's, and ours unless --ours-dtype")
    parser.add_argument("--ours-dtype", choices=["float32", "bfloat16"], default=None,
                        help="ours on a copy of the model cast to this dtype (what training's sampling.dtype does), generate on the model itself")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    parser.add_argument("--group-size", type=int, default=1, help="completions per prompt (batch / group-size prompts)")
    parser.add_argument("--compile", action="store_true", help="ours with sample(compile=True): the decode step compiled by torch.compile (first call per shape compiles)")
    parser.add_argument("--packed", action="store_true",
                        help="ours on a copy whose linear weights are packed for oneDNN (what training's sampling copy gets: sampling.pack_weights)")
    parser.add_argument("--matmuls", action="store_true", help="also profile each side once: time in matmuls, and the speed-up's ceiling with these kernels")
    parser.add_argument("--prompt-len", type=int, nargs=2, default=[4, 12], metavar=("MIN", "MAX"), help="prompt lengths drawn in [MIN, MAX]")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = torch.float32 if args.dtype == "float32" else torch.bfloat16
    model = build_model(args.model, dtype, args.device)
    ours_dtype = args.ours_dtype or args.dtype
    ours_model = model if ours_dtype == args.dtype else cast_copy(model, ours_dtype)
    if args.packed:
        if not can_pack_linear(ours_model):
            raise SystemExit("--packed: no oneDNN kernels for this device and dtype")
        ours_model = copy.deepcopy(ours_model) if ours_model is model else ours_model  # the same weights; generate keeps the plain nn.Linear ones
        pack_linear_layers(ours_model)
    vocab = model.config.vocab_size
    device_name = torch.cuda.get_device_name() if args.device.startswith("cuda") else f"{platform.processor() or 'cpu'}, {torch.get_num_threads()} threads"
    print(f"model={args.model} params={sum(p.numel() for p in model.parameters()) / 1e6:.1f}M dtype={args.dtype} ours_dtype={ours_dtype} device={device_name} "
          f"new_tokens={args.new_tokens} packed={args.packed} repeats={args.repeats} group_size={args.group_size} prompt_len={args.prompt_len} torch={torch.__version__}")
    # generate on a copy in ours' dtype too, so one run shows which dtype is generate's fastest
    generate_cast = None if ours_dtype == args.dtype else cast_copy(model, ours_dtype)
    cast_header = f" generate {ours_dtype} tokens/s |" if generate_cast is not None else ""
    print(f"| batch | ours tokens/s | generate tokens/s | speed-up |{cast_header}")
    print("|---:|---:|---:|---:|" + ("---:|" if cast_header else ""))
    gen = torch.Generator().manual_seed(0)
    for batch in args.batch:
        if batch % args.group_size:
            raise SystemExit(f"--batch {batch} is not a multiple of --group-size {args.group_size}")
        lengths = torch.randint(args.prompt_len[0], args.prompt_len[1] + 1, (batch // args.group_size,), generator=gen).tolist()
        prompts = [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in lengths]
        ids, mask = left_pad(prompts, 0, args.device)
        run = (args.new_tokens, args.device, args.group_size)
        ours_run = lambda: time_ours(ours_model, ids, mask, *run, compile=args.compile)  # noqa: E731
        sides = {"ours": ours_run, "generate": lambda: time_generate(model, ids, mask, *run)}
        if generate_cast is not None:
            sides["generate_cast"] = lambda: time_generate(generate_cast, ids, mask, *run)
        warm = ours_run()  # warm-up every side (and compile)
        if args.compile:
            print(f"batch {batch}: first call (compiling) {warm:.1f} s", flush=True)
        times = {name: [] for name in sides}
        for rep in range(args.repeats + 1):  # the first round is a warm-up, not timed
            for name in list(sides) if rep % 2 == 0 else list(sides)[::-1]:  # alternate which runs first
                seconds = sides[name]()
                if rep:
                    times[name].append(seconds)
        ours, theirs = times["ours"], times["generate"]
        tokens = batch * args.new_tokens
        ours_tps, gen_tps = tokens / statistics.median(ours), tokens / statistics.median(theirs)
        cast_cell = f" {tokens / statistics.median(times['generate_cast']):,.0f} |" if generate_cast is not None else ""
        print(f"| {batch} | {ours_tps:,.0f} | {gen_tps:,.0f} | {ours_tps / gen_tps:.2f}x |{cast_cell}", flush=True)
        if args.matmuls:
            ours_mm, gen_mm = matmul_seconds(ours_run), matmul_seconds(lambda: time_generate(model, ids, mask, *run))
            ours_s, gen_s = statistics.median(ours), statistics.median(theirs)
            print(f"  batch {batch} matmuls: ours {ours_mm:.3f} of {ours_s:.3f} s ({ours_mm / ours_s:.0%}), generate {gen_mm:.3f} of {gen_s:.3f} s "
                  f"({gen_mm / gen_s:.0%}); ceiling with these kernels {gen_s / ours_mm:.2f}x", flush=True)


if __name__ == "__main__":
    main()
