#!/usr/bin/env bash
# bf16 vs f32 training on real data: continue-pretrains SmolLM2-135M on the KJV Bible twice from
# the same weights, data order and seed, once in f32 and once with `precision.bf16` (bf16
# weights and bf16 x bf16 -> f32 matmuls, f32 master weights, grads and Adam state), logging
# every iteration, then compares the two loss curves iteration by iteration and draws them
# (crates/ferrotron-train/examples/compare_losses.rs). Exit code 4 when the bf16 loss strays
# more than --tolerance from the f32 loss at any iteration.
#
#   bash scripts/bf16-loss-curves.sh [--iters N] [--seq N] [--gbs N] [--lr X] [--tolerance X]
#                                    [--out DIR]
#
#   --iters N      iterations of each run (default 200)
#   --seq N        sequence length (default 128)
#   --gbs N        global batch size in sequences, micro-batch 2 (default 4)
#   --lr X         peak learning rate, cosine to lr/10 after 10% warmup (default 1e-4)
#   --tolerance X  largest allowed |relative difference| of the losses (default 0.01)
#   --out DIR      where the runs and loss-curves.png go (default runs/bf16-loss-curves)
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
iters=200 seq=128 gbs=4 lr=1e-4 tolerance=0.01 out="$root/runs/bf16-loss-curves"
while [ $# -gt 0 ]; do
  case "$1" in
    --iters) iters="$2"; shift 2 ;;
    --seq) seq="$2"; shift 2 ;;
    --gbs) gbs="$2"; shift 2 ;;
    --lr) lr="$2"; shift 2 ;;
    --tolerance) tolerance="$2"; shift 2 ;;
    --out) out="$2"; shift 2 ;;
    -h|--help) sed -n '2,17p' "$0"; exit 0 ;;
    *) echo "bf16-loss-curves.sh: unknown flag $1 (see --help)" >&2; exit 2 ;;
  esac
done
start=$(date +%s) steps=5
. "$root/scripts/lib/example.sh"

step 1 "release build, SmolLM2-135M-Instruct as HF, the KJV corpus"
command -v bible >/dev/null || { apt-get update -qq && apt-get install -y -qq bible-kjv >/dev/null; }
release_build
cargo build --release -q -p ferrotron-train --example compare_losses
smollm2_hf
kjv_corpus

mkdir -p "$out"
title="bf16 vs f32 loss curves on the KJV Bible (scripts/bf16-loss-curves.sh)."
data_toml="data_path = \"$corpus/kjv_text_document\""
eval_iters=2 min_lr=$(python3 -c "print($lr / 10)")
n=2
for precision in f32 bf16; do
  bf16=false; [ "$precision" = bf16 ] && bf16=true
  step "$n" "$precision: $iters iterations of $gbs x $seq tokens"
  rm -rf "$out/$precision"
  run_config "$model" "$out/$precision" "[precision]
bf16 = $bf16" > "$out/$precision.toml"
  "$bin" train --config "$out/$precision.toml" --set training.log_interval=1 \
    > "$out/$precision.log" 2>&1 || { tail -n 20 "$out/$precision.log" >&2; exit 1; }
  grep -E "iteration +$iters/" "$out/$precision.log" || tail -n 3 "$out/$precision.log"
  n=$((n + 1))
done

step 4 "loss curves: bf16 against f32, iteration by iteration"
rc=0
"$root/target/release/examples/compare_losses" --output "$out/loss-curves.png" \
  --tolerance "$tolerance" f32="$out/f32/metrics.jsonl" bf16="$out/bf16/metrics.jsonl" || rc=$?

step 5 "done"
echo "runs: $out/{f32,bf16} (metrics.jsonl, logs), plot: $out/loss-curves.png ($(( $(date +%s) - start )) s)"
exit "$rc"
