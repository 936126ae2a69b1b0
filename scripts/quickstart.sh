#!/usr/bin/env bash
# The main job (README), today: fetch the real SmolLM2-135M-Instruct GGUF, convert it to a
# HuggingFace directory, then generate (plain and chat) and score with it.
# Safe to re-run: reuses the download, the build and the converted model.
#
#   bash scripts/quickstart.sh [--prompt TEXT] [--max-new-tokens N] [--dtype f32|bf16]
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
prompt="The capital of France is"
max_new=48
dtype=bf16
while [ $# -gt 0 ]; do
  case "$1" in
    --prompt) prompt="$2"; shift 2 ;;
    --max-new-tokens) max_new="$2"; shift 2 ;;
    --dtype) dtype="$2"; shift 2 ;;
    -h|--help) sed -n '2,7p' "$0"; exit 0 ;;
    *) echo "unknown flag $1 (see --help)" >&2; exit 2 ;;
  esac
done
echo "Ferrotron quickstart: expect ~3-5 minutes on 2 cores the first time (mostly the release build), seconds after."
echo "== [1/4] release build"
cargo build --release -p ferrotron
bin="$root/target/release/ferrotron"
echo "== [2/4] SmolLM2-135M-Instruct GGUF"
gguf="$(bash scripts/fetch-smollm2.sh)"
model="$root/.cache/smollm2-hf"
if [ ! -f "$model/model.safetensors" ]; then
  echo "== [3/4] convert gguf-to-hf -> $model"
  "$bin" convert gguf-to-hf --input "$gguf" --output "$model"
else
  echo "== [3/4] reusing $model"
fi
echo "== [4/4] generate and score"
echo "-- greedy:"
"$bin" generate --model "$model" --prompt "$prompt" --max-new-tokens "$max_new" --dtype "$dtype"
echo "-- chat:"
"$bin" generate --model "$model" --chat --prompt "What is the capital of France? Answer in one sentence." \
  --max-new-tokens "$max_new" --dtype "$dtype"
echo "-- sampled (temperature 0.8, top-p 0.9, seed 1):"
"$bin" generate --model "$model" --prompt "Once upon a time" --temperature 0.8 --top-p 0.9 --seed 1 \
  --max-new-tokens "$max_new" --dtype "$dtype"
echo "-- score:"
"$bin" score --model "$model" --text "In the beginning God created the heaven and the earth." | tail -n 1
