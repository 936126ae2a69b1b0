#!/usr/bin/env bash
# Optimizer offload on real input (issue 17): continue-pretraining a model with
# SmolLM2-1.7B's architecture (24 layers, hidden 2048, 32 heads, FFN 8192, vocabulary 49152;
# random init, f32) on the KJV Bible with its Adam state (13.7 GB) in chunks on disk. In RAM
# the run would need 27.4 GB of model state (16 bytes per parameter), more than this 24 GiB
# machine has; offloaded it needs the 8 bytes of parameters and gradients. Then a model that
# fits (the same shape, 8 layers) with its state in RAM and on disk, for the speed ratio.
# Prints per run: seconds per iteration (median of the timed ones), optimizer bytes moved
# per iteration, peak RSS, losses.
#
#   bash scripts/offload-example.sh [--iters N] [--seq N] [--out DIR] [--offload-dir DIR]
#
#   --iters N        iterations per run, the first untimed (default 3)
#   --seq N          sequence length (default 256)
#   --out DIR        where the runs go (default target/offload-example)
#   --offload-dir D  the slow tier's directory (default .cache/offload)
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
iters=3 seq=256 out="$root/target/offload-example" offload="$root/.cache/offload"
while [ $# -gt 0 ]; do
  case "$1" in
    --iters) iters="$2"; shift 2 ;;
    --seq) seq="$2"; shift 2 ;;
    --out) out="$2"; shift 2 ;;
    --offload-dir) offload="$2"; shift 2 ;;
    -h|--help) sed -n '2,17p' "$0"; exit 0 ;;
    *) echo "offload-example.sh: unknown flag $1 (see --help)" >&2; exit 2 ;;
  esac
done
start=$(date +%s) steps=3
. "$root/scripts/lib/example.sh"

step 1 "release build"
release_build

step 2 "KJV Bible -> Megatron .bin/.idx (SmolLM2's tokenizer)"
command -v bible >/dev/null || {
  sudo=""; [ "$(id -u)" = 0 ] || sudo="sudo"
  $sudo apt-get update -qq && $sudo apt-get install -y -qq bible-kjv >/dev/null
}
smollm2_hf
kjv_corpus

step 3 "training runs"
mkdir -p "$out" "$offload"
# run NAME LAYERS POLICY
run() {
  local dir="$out/$1"; rm -rf "$dir"; mkdir -p "$dir"
  cat > "$dir/run.toml" <<TOML
[model]
family = "llama"
num_layers = $2
hidden_size = 2048
ffn_hidden_size = 8192
num_attention_heads = 32
num_query_groups = 32
vocab_size = 49152
seq_length = $seq
max_position_embeddings = 8192
rotary_base = 130000
[data]
data_path = "$corpus/kjv_text_document"
tokenizer_model = "$model"
[training]
micro_batch_size = 1
global_batch_size = 1
train_iters = $iters
log_interval = 1
eval_iters = 0
[optimizer]
lr = 3e-4
min_lr = 3e-5
lr_warmup_iters = 1
optimizer_offload_policy = "$3"
offload_path = "$offload"
[logging]
output_dir = "$dir"
tensorboard = false
TOML
  /usr/bin/time -v "$bin" train --config "$dir/run.toml" > "$dir/stdout" 2> "$dir/stderr" \
    || { tail -20 "$dir/stderr" >&2; exit 1; }
  python3 - "$dir" "$1" <<'PY'
import json, re, statistics, sys
d, name = sys.argv[1], sys.argv[2]
rows = [json.loads(l) for l in open(f"{d}/metrics.jsonl") if '"train"' in l]
timed = rows[1:] or rows
sec = statistics.median(r["elapsed_ms_per_iteration"] for r in timed) / 1e3
moved = statistics.median((r.get("offload") or {}).get("moved_bytes", 0) for r in timed) / 2**30
off = (rows[-1].get("offload") or {}).get("offloaded_bytes", 0) / 2**30
rss = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", open(f"{d}/stderr").read())[1]) / 2**20
losses = " ".join(f"{r['lm_loss']:.4f}" for r in rows)
print(f"{name:<22} {sec:9.1f} {off:10.2f} {moved:10.2f} {rss:9.2f}  {losses}")
PY
}
printf '%-22s %9s %10s %10s %9s  %s\n' run "s/iter" "offl. GiB" "moved GiB" "peak GiB" losses
run "1.7B-offloaded" 24 static | tee "$out/results.txt"
run "0.6B-in-RAM" 8 none | tee -a "$out/results.txt"
run "0.6B-offloaded" 8 static | tee -a "$out/results.txt"
echo "done in $(( $(date +%s) - start )) s (results: $out/results.txt)"
