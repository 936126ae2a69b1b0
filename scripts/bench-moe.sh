#!/usr/bin/env bash
# MoE benchmarks side by side, on this machine:
#  1. a tiny-but-not-toy Mixtral (hidden 512, 8 layers, 8 experts of width 1024, top-2, vocab
#     32000; tools/make_bench_moe_models.py) trained by Ferrotron and by transformers (fwd + bwd
#     + clip + AdamW, f32 and bf16, seq 512, micro-batch 1 and 2, after bench-train.sh's 5
#     warmup steps; scripts/bench-train.sh);
#  2. the dense LLaMA of equal active parameters (one MLP of width 2048) the same way: the MoE
#     model's step time over the dense one's;
#  3. a DeepSeek-V2-Lite-shaped model (multi-latent attention, 16 routed experts of width 256
#     top-4 plus 2 shared, a dense first layer) the same way;
#  4. the experts alone (crates/ferrotron-nn/benches/moe_experts.rs): grouped GEMM vs a
#     per-expert loop, and expert parallel 2 with the time of its all-to-alls.
#
#   bash scripts/bench-moe.sh [--steps N] [--rounds N]
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
steps=5 rounds=1
while [ $# -gt 0 ]; do
  case "$1" in
    --steps) steps="$2"; shift 2 ;;
    --rounds) rounds="$2"; shift 2 ;;
    -h|--help) sed -n '2,15p' "$0"; exit 0 ;;
    *) echo "bench-moe.sh: unknown flag $1 (see --help)" >&2; exit 2 ;;
  esac
done
bash tools/setup_venv.sh >&2
models="$root/.cache/bench-moe"
[ -f "$models/deepseek/config.json" ] || tools/.venv/bin/python tools/make_bench_moe_models.py "$models"
for m in mixtral dense deepseek; do
  echo "== $m"
  bash scripts/bench-train.sh --model "$models/$m" --modes f32,bf16 --micro-batches 1,2 \
    --steps "$steps" --rounds "$rounds" --out "$root/target/bench-moe-$m.jsonl"
done
echo "== experts alone"
cargo bench --quiet -p ferrotron-nn --bench moe_experts
