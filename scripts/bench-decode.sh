#!/usr/bin/env bash
# Decode benchmark side by side: Ferrotron (cargo bench) then PyTorch/transformers on the same
# converted SmolLM2 directory, same prompt, 128 greedy tokens, 2 threads. Needs the reference venv
# (bash tools/setup_venv.sh) and the converted model (bash scripts/quickstart.sh).
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
model="${1:-$root/.cache/smollm2-hf}"
FERROTRON_BENCH_MODEL="$model" RAYON_NUM_THREADS=2 cargo bench -p ferrotron-infer --bench decode
"$root/tools/.venv/bin/python" "$root/tools/bench_decode_torch.py" "$model" --threads 2
