#!/usr/bin/env bash
# Mixture of experts on real input, end to end: upcycle SmolLM2-135M-Instruct into a Mixtral
# with 8 experts (top-2) per layer (Megatron's --moe-use-upcycling: every expert a copy of the
# dense MLP, the routers drawn N(0, 0.02)), check that the upcycled model computes what the
# dense one does, continue-pretraining it on the KJV Bible with expert parallel 2 x data
# parallel 2 ranks in this process (the alltoall token dispatcher; load-balancing and z-loss
# logged as Megatron does), convert the result back to HF and compare validation losses on the
# same held-out batches: the dense original, the upcycled model before training, and after.
# Safe to re-run: downloads, the build, the converted model and the corpus are reused.
#
#   bash scripts/moe-upcycle-example.sh [--iters N] [--seq N] [--experts N] [--topk N]
#                                       [--ep N] [--out DIR]
#
#   --iters N    training iterations (default 60)
#   --seq N      sequence length (default 256)
#   --experts N  experts per layer (default 8), --topk N experts per token (default 2)
#   --ep N       expert-parallel ranks; the data-parallel size is the same (default 2)
#   --out DIR    where the run goes (default runs/moe-upcycle)
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
iters=60 seq=256 experts=8 topk=2 ep=2 out="$root/runs/moe-upcycle"
while [ $# -gt 0 ]; do
  case "$1" in
    --iters) iters="$2"; shift 2 ;;
    --seq) seq="$2"; shift 2 ;;
    --experts) experts="$2"; shift 2 ;;
    --topk) topk="$2"; shift 2 ;;
    --ep) ep="$2"; shift 2 ;;
    --out) out="$2"; shift 2 ;;
    -h|--help) sed -n '2,19p' "$0"; exit 0 ;;
    *) echo "moe-upcycle-example.sh: unknown flag $1 (see --help)" >&2; exit 2 ;;
  esac
done
start=$(date +%s) steps=7
. "$root/scripts/lib/example.sh"
echo "Ferrotron MoE example: SmolLM2-135M upcycled to $experts experts (top-$topk), trained ep $ep x dp $ep, $iters iterations."

step 1 "system packages (bible-kjv for the corpus)"
command -v bible >/dev/null || {
  sudo=""; [ "$(id -u)" = 0 ] || sudo="sudo"
  $sudo apt-get update -qq && $sudo apt-get install -y -qq bible-kjv >/dev/null
}
echo "ok"

step 2 "release build"
release_build

step 3 "SmolLM2-135M-Instruct: GGUF -> HF; KJV Bible -> Megatron .bin/.idx"
smollm2_hf
kjv_corpus

step 4 "upcycle: dense SmolLM2 -> Mixtral, $experts experts top-$topk per layer"
rm -rf "$out"
mkdir -p "$out"
moe="$out/upcycled-hf"
"$bin" convert upcycle --hf "$model" --output "$moe" --num-experts "$experts" \
  --moe-router-topk "$topk" --moe-aux-loss-coeff 0.01 --force

step 5 "validation loss of the dense original and of the upcycled model (same held-out batches)"
title="Continue-pretraining an upcycled SmolLM2 MoE on the KJV Bible (scripts/moe-upcycle-example.sh)."
data_toml="data_path = \"$corpus/kjv_text_document\""
gbs=8 eval_iters=4 lr=1e-4 min_lr=1e-5
dense_loss=$(valid_loss "$model" dense-eval)
upcycled_loss=$(valid_loss "$moe" upcycled-eval)
echo "validation loss: dense $dense_loss, upcycled (before training) $upcycled_loss"

step 6 "continue-pretraining: expert parallel $ep x data parallel $ep ranks in this process"
run_config "$moe" "$out/train" "[parallel]
data_parallel_size = $ep
expert_model_parallel_size = $ep
[checkpoint]
save = \"$out/ckpt\"" > "$out/run.toml"
"$bin" train --config "$out/run.toml"

step 7 "trained checkpoint -> HF; validation loss after training"
"$bin" convert ckpt-to-hf --ckpt "$out/ckpt" --output "$out/trained-hf" --force
after=$(valid_loss "$out/trained-hf" trained-eval)
echo "validation loss (same $(( 4 * 8 )) held-out sequences): dense original $dense_loss," \
  "upcycled $upcycled_loss, after $iters iterations $after"
python3 - "$dense_loss" "$after" <<'PY'
import sys
dense, after = map(float, sys.argv[1:])
print("trained MoE below the dense original: %s (%.4f vs %.4f)" % (after < dense, after, dense))
sys.exit(0 if after < dense else 1)
PY
echo "done in $(( $(date +%s) - start )) s. Run: $out/train (metrics.jsonl, loss.png), HF: $out/trained-hf"
