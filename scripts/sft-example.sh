#!/usr/bin/env bash
# Supervised fine-tuning example: SmolLM2-135M-Instruct on the Chit-Chat Challenge chats (PyPI
# chitchat-dataset==0.9.0, MIT), answer-only loss on packed rows (Pai's --eod-mask-loss
# --calculate-per-token-loss), then chat with the original and the fine-tuned model side by
# side. Safe to re-run: downloads, the build, the model and the dataset are reused.
#
#   bash scripts/sft-example.sh [--iters N] [--seq N] [--dp N] [--prompt TEXT] [--out DIR]
#
#   --iters N      training iterations (default 40; the issue-4 run used 200)
#   --seq N        packed row length (default 512)
#   --dp N         data-parallel ranks in this process (default 1)
#   --prompt TEXT  the chat message (default "Hi! How was your weekend?")
#   --out DIR      where the run goes (default runs/sft-example)
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
iters=40 seq=512 dp=1 out="$root/runs/sft-example"
prompt="Hi! How was your weekend?"
while [ $# -gt 0 ]; do
  case "$1" in
    --iters) iters="$2"; shift 2 ;;
    --seq) seq="$2"; shift 2 ;;
    --dp) dp="$2"; shift 2 ;;
    --prompt) prompt="$2"; shift 2 ;;
    --out) out="$2"; shift 2 ;;
    -h|--help) sed -n '2,14p' "$0"; exit 0 ;;
    *) echo "sft-example.sh: unknown flag $1 (see --help)" >&2; exit 2 ;;
  esac
done
start=$(date +%s) steps=5
. "$root/scripts/lib/example.sh"
echo "Ferrotron SFT example: SmolLM2-135M-Instruct on chitchat chats, $iters iterations of 4 x $seq tokens."
# ~290 tokens/s for SmolLM2 training on one rank of 2 cores, plus ~1 minute for the rest.
echo "Expect ~$(( (iters * seq * 4 / 290 + 60 + 59) / 60 )) minutes on 2 cores, plus ~8 the first time (release build, downloads)."

step 1 "release build"
release_build

step 2 "SmolLM2-135M-Instruct: GGUF -> HF"
smollm2_hf

step 3 "chitchat chats -> answer-only packed SFT dataset"
data="$root/.cache/chitchat"
if [ -f "$data/chitchat_text_document.idx" ]; then
  echo "reusing $data/chitchat_text_document"
else
  mkdir -p "$data"
  python3 tools/make_chitchat_jsonl.py --output "$data/chitchat.jsonl"
  "$bin" preprocess-sft --input "$data/chitchat.jsonl" --tokenizer "$model" \
    --output-prefix "$data/chitchat" --max-padding-length "$seq" --pack
fi

step 4 "SFT: $iters iterations, data parallel $dp"
rm -rf "$out"
mkdir -p "$out"
title="SFT of SmolLM2-135M-Instruct on the chitchat chats (scripts/sft-example.sh)."
data_toml="data_path = \"$data/chitchat_text_document\"
dataset_type = \"sft_mmap\""
gbs=4 eval_iters=8 lr=5e-5 min_lr=5e-6
run_config "$model" "$out/train" "[parallel]
data_parallel_size = $dp
[checkpoint]
save = \"$out/ckpt\"
export_hf = \"$out/trained-hf\"" > "$out/run.toml"
"$bin" train --config "$out/run.toml"
echo "answer-only validation loss (same $(( 8 * 4 )) held-out rows): original $(valid_loss "$model" original-eval), after SFT $(valid_loss "$out/trained-hf" trained-eval)"

step 5 "chat: \"$prompt\""
echo "-- original SmolLM2-135M-Instruct:"
"$bin" generate --model "$model" --chat --prompt "$prompt" --max-new-tokens 48
echo
echo "-- after SFT on chitchat:"
"$bin" generate --model "$out/trained-hf" --chat --prompt "$prompt" --max-new-tokens 48
echo
echo "done in $(( $(date +%s) - start )) s. Run: $out/train (metrics.jsonl, loss.png), HF: $out/trained-hf"
