#!/usr/bin/env bash
# Quantized GGUF weights served directly, side by side with llama.cpp on the same files,
# 2 threads:
#   1. speed: batch-1 decode tg128 and prefill pp512, Ferrotron's decode bench on each GGUF
#      (cargo bench, quantized weights kept in their blocks) alternating with llama-bench on
#      the same file (the machine is noisy: each pair runs back to back);
#   2. accuracy: perplexity of held-out KJV text (the book of Revelation, the corpus' last 22
#      chapters) in windows of 512 (llama-perplexity's protocol): Ferrotron on the HF directory
#      in f32 and bf16 and on each GGUF (whole windows, and 16 tokens per pass = the int8 decode
#      kernels), llama-perplexity on the F32, BF16 and quantized GGUFs.
# The GGUFs come from llama.cpp's own tools: convert_hf_to_gguf.py (F32, BF16), then
# llama-quantize (llama.cpp from the PyPI sdist, built once; scripts/lib/llama_cpp.sh).
#
#   bash scripts/bench-quant.sh [MODEL_DIR] [--types "Q8_0 Q4_0 Q4_K_M"] [--chunks N]
#
# Needs the reference venv (bash tools/setup_venv.sh), the converted model and the KJV corpus
# (bash scripts/quickstart.sh; default .cache/smollm2-hf and .cache/kjv/kjv.jsonl).
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
model="$root/.cache/smollm2-hf" types="Q8_0 Q4_0 Q4_K_M" chunks=16
while [ $# -gt 0 ]; do
  case "$1" in
    --types) types="$2"; shift ;;
    --chunks) chunks="$2"; shift ;;
    -h|--help) sed -n '2,18p' "$0"; exit 0 ;;
    -*) echo "bench-quant.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
    *) model="$(cd "$1" && pwd)" ;;
  esac
  shift
done
. "$root/scripts/lib/llama_cpp.sh"
llama_cpp_build
llama_cpp_gguf "$model" f32
f32_gguf="$gguf"
llama_cpp_gguf "$model" bf16
bf16_gguf="$gguf"
files=()
for t in $types; do
  llama_cpp_quantize "$f32_gguf" "$t"
  files+=("$gguf")
done
cargo build --release -p ferrotron >/dev/null
bin="$root/target/release/ferrotron"

echo "== speed (tokens/s, batch 1, 2 threads)"
for f in "${files[@]}"; do
  echo "-- $(basename "$f")"
  FERROTRON_BENCH_MODEL="$f" RAYON_NUM_THREADS=2 cargo bench -q -p ferrotron-infer --bench decode \
    2>/dev/null | grep -E "tg128|pp512"
  "$llama_bench" -m "$f" -t 2 -p 512 -n 128 -r 5 -o md 2>/dev/null | grep -E "pp512|tg128"
done

echo "== perplexity of KJV Revelation, windows of 512, first $chunks windows"
text="$root/.cache/kjv/revelation.txt"
tail -n 22 "$root/.cache/kjv/kjv.jsonl" \
  | python3 -c 'import json, sys; print("\n".join(json.loads(l)["text"] for l in sys.stdin))' >"$text"
ours() { RAYON_NUM_THREADS=2 "$bin" perplexity --file "$text" --chunks "$chunks" "$@" 2>/dev/null | tail -1; }
theirs() { "$llama_perplexity" -m "$1" -f "$text" -c 512 --chunks "$chunks" -t 2 2>&1 | grep "Final estimate"; }
echo "ferrotron f32 (HF dir):  $(ours --model "$model")"
echo "ferrotron bf16 (HF dir): $(ours --model "$model" --dtype bf16)"
echo "llama.cpp F32:           $(theirs "$f32_gguf")"
echo "llama.cpp BF16:          $(theirs "$bf16_gguf")"
for f in "${files[@]}"; do
  echo "-- $(basename "$f")"
  echo "ferrotron (windows):     $(ours --model "$f")"
  echo "ferrotron (16 per pass): $(ours --model "$f" --ubatch-size 16)"
  echo "llama.cpp:               $(theirs "$f")"
done
