#!/usr/bin/env bash
# Decode benchmark side by side on the same weights, batch 1, 2 threads:
#   Ferrotron (cargo bench: 128 greedy tokens after a fixed prompt, f32 and bf16 weights),
#   PyTorch/transformers (same prompt and tokens), and, with --llama-cpp, llama.cpp's
#   `llama-bench` tg128 (and pp512) on the same directory converted to F32 and BF16 GGUF
#   by llama.cpp's own converter (llama.cpp from the PyPI sdist, built once; see
#   scripts/lib/llama_cpp.sh).
#
#   bash scripts/bench-decode.sh [MODEL_DIR] [--llama-cpp] [--skip-torch]
#
# Needs the reference venv (bash tools/setup_venv.sh) and the converted model
# (bash scripts/quickstart.sh; default .cache/smollm2-hf).
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
model="$root/.cache/smollm2-hf" llama=0 torch=1
while [ $# -gt 0 ]; do
  case "$1" in
    --llama-cpp) llama=1 ;;
    --skip-torch) torch=0 ;;
    -h|--help) sed -n '2,12p' "$0"; exit 0 ;;
    -*) echo "bench-decode.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
    *) model="$(cd "$1" && pwd)" ;;
  esac
  shift
done
FERROTRON_BENCH_MODEL="$model" RAYON_NUM_THREADS=2 cargo bench -p ferrotron-infer --bench decode
if [ "$torch" = 1 ]; then
  "$root/tools/.venv/bin/python" "$root/tools/bench_decode_torch.py" "$model" --threads 2
fi
if [ "$llama" = 1 ]; then
  . "$root/scripts/lib/llama_cpp.sh"
  llama_cpp_build
  for type in f32 bf16; do
    llama_cpp_gguf "$model" "$type"
    "$llama_bench" -m "$gguf" -t 2 -p 512 -n 128 -r 5 -o md
  done
fi
