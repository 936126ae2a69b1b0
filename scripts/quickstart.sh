#!/usr/bin/env bash
# The main job, end to end on real input: fetch the SmolLM2-135M-Instruct GGUF, convert it to a
# HuggingFace directory and then to a tensor-parallel checkpoint (checked layer by layer), turn
# the KJV Bible into a Megatron .bin/.idx corpus, continue-pretraining it with tensor x data
# parallel ranks in this process (with validation and a checkpoint), convert the result back to
# HF, and print continuations of the original and the trained model side by side with their
# validation losses. Safe to re-run: downloads, the build, the converted model and checkpoint and
# the corpus are reused; the training run is redone.
#
#   bash scripts/quickstart.sh [--iters N] [--seq N] [--tp N] [--dp N] [--prompt TEXT]
#                              [--max-new-tokens N] [--out DIR]
#
#   --iters N           training iterations (default 30; 10 is a quick look, 200 a real run)
#   --seq N             sequence length (default 256)
#   --tp N, --dp N      tensor x data parallel ranks (default 3 x 2: SmolLM2 has 9 heads in 3
#                       query groups, so its tensor-parallel size is 1, 3 or 9)
#   --prompt TEXT       the continuation prompt (default "And God said unto Moses,")
#   --max-new-tokens N  tokens per continuation (default 40)
#   --out DIR           where the run goes (default runs/quickstart)
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
iters=30 seq=256 tp=3 dp=2 max_new=40 out="$root/runs/quickstart"
prompt="And God said unto Moses,"
while [ $# -gt 0 ]; do
  case "$1" in
    --iters) iters="$2"; shift 2 ;;
    --seq) seq="$2"; shift 2 ;;
    --tp) tp="$2"; shift 2 ;;
    --dp) dp="$2"; shift 2 ;;
    --prompt) prompt="$2"; shift 2 ;;
    --max-new-tokens) max_new="$2"; shift 2 ;;
    --out) out="$2"; shift 2 ;;
    -h|--help) sed -n '2,20p' "$0"; exit 0 ;;
    *) echo "quickstart.sh: unknown flag $1 (see --help)" >&2; exit 2 ;;
  esac
done
start=$(date +%s) steps=8
. "$root/scripts/lib/example.sh"
# ~350 tokens/s for SmolLM2 training on 2 cores, plus ~1 minute of conversion, evaluation and generation.
minutes=$(( (iters * seq * 8 / 350 + 60 + 59) / 60 ))
echo "Ferrotron quickstart: continue-pretraining SmolLM2-135M on the KJV Bible, tp $tp x dp $dp, $iters iterations."
echo "Expect ~$minutes minutes on 2 cores, plus ~8 the first time (release build, downloads); --iters 10 is quicker."

step 1 "system packages (bible-kjv for the corpus, time)"
missing=""
command -v bible >/dev/null || missing="$missing bible-kjv"
[ -x /usr/bin/time ] || missing="$missing time"
if [ -n "$missing" ]; then
  sudo=""; [ "$(id -u)" = 0 ] || sudo="sudo"
  $sudo apt-get update -qq && $sudo apt-get install -y -qq $missing >/dev/null
fi
echo "ok"

step 2 "release build"
release_build

step 3 "SmolLM2-135M-Instruct: GGUF -> HF"
smollm2_hf

step 4 "HF -> tensor-parallel $tp checkpoint, checked layer by layer against the HF model"
ckpt="$root/.cache/smollm2-ckpt-tp$tp"
if [ -f "$ckpt/latest_checkpointed_iteration.txt" ]; then
  echo "reusing $ckpt"
else
  "$bin" convert hf-to-ckpt --hf "$model" --output "$ckpt" --tensor-model-parallel-size "$tp" \
    --force --check | grep -E "^(wrote|check|tensor|layer +(0|1|2|27|28|29) |logits|argmax)" \
    | sed '/layer   2 /a ... (layers 3-26 likewise)' 
fi

step 5 "KJV Bible -> Megatron .bin/.idx (one document per chapter)"
kjv_corpus

step 6 "continue-pretraining: tp $tp x dp $dp ranks in this process, $iters iterations of 8 x $seq tokens"
rm -rf "$out"
mkdir -p "$out"
title="Continue-pretraining SmolLM2-135M on the KJV Bible (scripts/quickstart.sh)."
data_toml="data_path = \"$corpus/kjv_text_document\""
gbs=8 eval_iters=4 lr=1e-4 min_lr=1e-5
run_config "$ckpt" "$out/train" "[parallel]
tensor_model_parallel_size = $tp
data_parallel_size = $dp
use_distributed_optimizer = true
[checkpoint]
save = \"$out/ckpt\"" > "$out/run.toml"
"$bin" train --config "$out/run.toml"

step 7 "trained checkpoint -> HF; validation loss before and after"
"$bin" convert ckpt-to-hf --ckpt "$out/ckpt" --output "$out/trained-hf" --force
before=$(valid_loss "$model" original-eval)
after=$(valid_loss "$out/trained-hf" trained-eval)
echo "validation loss (same $(( 4 * 8 )) held-out sequences): original $before, trained $after"

step 8 "continuations of \"$prompt\" (greedy, $max_new tokens)"
echo "-- original SmolLM2-135M-Instruct (validation loss $before):"
"$bin" generate --model "$model" --prompt "$prompt" --max-new-tokens "$max_new"
echo
echo "-- after $iters iterations on the KJV Bible (validation loss $after):"
"$bin" generate --model "$out/trained-hf" --prompt "$prompt" --max-new-tokens "$max_new"
echo
echo "done in $(( $(date +%s) - start )) s. Run: $out/train (metrics.jsonl, loss.png), checkpoint: $out/ckpt, HF: $out/trained-hf"
