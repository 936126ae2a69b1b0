#!/usr/bin/env bash
# Serving load test side by side on the same model, 2 threads each, loopback:
#   `ferrotron serve` (continuous batching, paged KV, prefix caching) and, with --llama-cpp,
#   llama.cpp's `llama-server --parallel 8 --cont-batching` on the same directory converted to
#   GGUF by llama.cpp's own converter (llama.cpp from the PyPI sdist, built once; see
#   scripts/lib/llama_cpp.sh). tools/load_test.py sends the same token-id prompts (KJV) to
#   both: request and token throughput, TTFT / TPOT / ITL / end-to-end p50 and p99, and a
#   repeated 2k-token prompt's cold and warm TTFT. Results append to runs/bench-serve.jsonl.
#   With --quant TYPE (Q8_0, Q4_0, Q4_K_M, ...) both serve the same GGUF, made from the model
#   by llama.cpp's converter and llama-quantize (ours keeps its weights in their blocks).
#   With --lora N ours also runs with N random PEFT adapters (rank 16, every projection;
#   tools/make_random_adapters.py), request i naming adapter i mod N. --max-num-batched-tokens
#   N sets ours' tokens per step (prompt chunks beside the decodes; the server's default
#   otherwise): fewer bound the steps that prefill, so the inter-token latency's tail.
#
#   bash scripts/bench-serve.sh [MODEL_DIR] [--dtype bf16|f32] [--quant TYPE] [--llama-cpp]
#       [--lora N] [--concurrency "8 32"] [--num-prompts 64] [--input-len 128]
#       [--output-len 64] [--max-num-batched-tokens N]
#
# Needs the reference venv (bash tools/setup_venv.sh: transformers' tokenizers, openai) and
# the converted model (bash scripts/quickstart.sh; default .cache/smollm2-hf).
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
model="$root/.cache/smollm2-hf" dtype=bf16 quant="" llama=0 lora=0 conc="8 32" prompts=64 in=128 out=64
step_args=()
while [ $# -gt 0 ]; do
  case "$1" in
    --dtype) dtype="$2"; shift ;;
    --quant) quant="$2"; shift ;;
    --llama-cpp) llama=1 ;;
    --lora) lora="$2"; shift ;;
    --concurrency) conc="$2"; shift ;;
    --num-prompts) prompts="$2"; shift ;;
    --input-len) in="$2"; shift ;;
    --output-len) out="$2"; shift ;;
    --max-num-batched-tokens) step_args=(--max-num-batched-tokens "$2"); label_step=" $2 tokens per step"; shift ;;
    -h|--help) sed -n '2,23p' "$0"; exit 0 ;;
    -*) echo "bench-serve.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
    *) model="$(cd "$1" && pwd)" ;;
  esac
  shift
done
py="$root/tools/.venv/bin/python"
results="$root/runs/bench-serve.jsonl"
mkdir -p "$root/runs"
cd "$root"
cargo build --release -q -p ferrotron

# Servers still running when the script ends (a failure included) are stopped.
pids=()
trap 'for p in "${pids[@]}"; do kill -TERM "$p" 2>/dev/null || true; done' EXIT

# load LABEL URL [MODELS]: every concurrency level (the first with the repeated long prompt)
# against MODELS (default smollm2; comma-separated: request i to the (i mod n)-th); a level
# with failed requests is recorded (failed_requests, first_error), not fatal.
load() {
  local c first=1
  for c in $conc; do
    local repeat=()
    [ "$first" = 1 ] && repeat=(--repeat-prompt-len 2048) && first=0
    "$py" tools/load_test.py --base-url "$2" --model "${3:-smollm2}" --tokenizer "$model" \
      --concurrency "$c" --num-prompts "$prompts" --input-len "$in" --output-len "$out" \
      "${repeat[@]}" --label "$1" --json "$results" || echo "bench-serve.sh: $1: failures" >&2
  done
}

# port_free PORT: fails when something already answers there (a server left running).
port_free() {
  if curl -s -o /dev/null "http://127.0.0.1:$1/"; then
    echo "bench-serve.sh: port $1 is in use; stop what runs there first" >&2
    exit 1
  fi
}

# wait_for URL PID: until URL answers 200, or the server died.
wait_for() {
  until curl -sf "$1" >/dev/null; do
    kill -0 "$2" 2>/dev/null || { echo "bench-serve.sh: the server exited" >&2; exit 1; }
    sleep 1
  done
}

# What both serve: the model directory (ours) and its GGUF in $dtype (llama.cpp's), or one
# quantized GGUF.
served="$model" label="$dtype"
if [ "$llama" = 1 ] || [ -n "$quant" ]; then
  . "$root/scripts/lib/llama_cpp.sh"
  llama_cpp_build
  if [ -n "$quant" ]; then
    llama_cpp_gguf "$model" f32
    llama_cpp_quantize "$gguf" "$quant"
    served="$gguf" label="$quant"
  else
    llama_cpp_gguf "$model" "$dtype"
  fi
fi

log="$root/runs/bench-serve-ferrotron.log"
port_free 8931
RAYON_NUM_THREADS=2 target/release/ferrotron serve --model "$served" --dtype "$dtype" \
  --port 8931 --served-model-name smollm2 --max-num-seqs 32 --log-stats-interval 0 \
  "${step_args[@]}" 2>"$log" &
pid=$!
pids+=("$pid")
wait_for http://127.0.0.1:8931/health "$pid"
load "ferrotron serve $label${label_step:-}" http://127.0.0.1:8931/v1
kill -TERM "$pid"; wait "$pid"

if [ "$lora" -gt 0 ]; then
  adapters="$root/runs/bench-serve-adapters"
  "$py" tools/make_random_adapters.py --model "$model" --count "$lora" --rank 16 \
    --out "$adapters"
  lora_args=() names=()
  for i in $(seq 0 $((lora - 1))); do
    lora_args+=(--lora "adapter$i=$adapters/adapter$i") names+=("adapter$i")
  done
  RAYON_NUM_THREADS=2 target/release/ferrotron serve --model "$served" --dtype "$dtype" \
    --port 8931 --served-model-name smollm2 --max-num-seqs 32 --log-stats-interval 0 \
    "${step_args[@]}" "${lora_args[@]}" 2>>"$log" &
  pid=$!
  pids+=("$pid")
  wait_for http://127.0.0.1:8931/health "$pid"
  load "ferrotron serve $label + $lora LoRA adapters" http://127.0.0.1:8931/v1 \
    "$(IFS=,; echo "${names[*]}")"
  kill -TERM "$pid"; wait "$pid"
fi

if [ "$llama" = 1 ]; then
  port_free 8932
  # 8 slots of 4096 tokens each (the 2k-token repeated prompt fits one slot).
  "$llama_server" -m "$gguf" -t 2 --parallel 8 --cont-batching -c 32768 --port 8932 \
    -a smollm2 --metrics >"$root/runs/bench-serve-llama.log" 2>&1 &
  pid=$!
  pids+=("$pid")
  wait_for http://127.0.0.1:8932/health "$pid"
  load "llama-server --parallel 8 $label" http://127.0.0.1:8932/v1
  kill -TERM "$pid"; wait "$pid" || true
fi
echo "results appended to $results"
