#!/usr/bin/env bash
# Post-training example on SmolLM2-135M-Instruct (an instruction-tuned, i.e. SFT'd, model) with
# preference pairs built from the Chit-Chat Challenge chats (PyPI chitchat-dataset==0.9.0, MIT;
# tools/make_chitchat_preferences.py: chosen = the real next reply, rejected = a reply from
# another chat): first a reward model (a score head + LoRA, TRL's Bradley-Terry loss; held-out
# accuracy; exported as LlamaForSequenceClassification), then DPO with LoRA (TRL's sigmoid loss,
# the reference = the base with the adapters disabled; held-out reward margin and accuracy on
# pairs of chats never trained on), exporting the adapters (PEFT) and the merged model, and a
# chat with the original and the DPO'd model side by side. Safe to re-run: downloads, the
# build, the model and the pairs are reused.
#
#   bash scripts/dpo-example.sh [--rm-iters N] [--iters N] [--seq N] [--dp N] [--prompt TEXT]
#                               [--out DIR]
#
#   --rm-iters N   reward-model iterations of 8 pairs (default 40; 0 skips the reward model)
#   --iters N      DPO iterations of 8 pairs (default 60)
#   --seq N        row length in tokens (default 256; longer sides lose prompt tokens first)
#   --dp N         data-parallel ranks in this process (default 1)
#   --prompt TEXT  the chat message (default "Hi! How was your weekend?")
#   --out DIR      where the run goes (default runs/dpo-example)
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
rm_iters=40 iters=60 seq=256 dp=1 out="$root/runs/dpo-example"
prompt="Hi! How was your weekend?"
while [ $# -gt 0 ]; do
  case "$1" in
    --rm-iters) rm_iters="$2"; shift 2 ;;
    --iters) iters="$2"; shift 2 ;;
    --seq) seq="$2"; shift 2 ;;
    --dp) dp="$2"; shift 2 ;;
    --prompt) prompt="$2"; shift 2 ;;
    --out) out="$2"; shift 2 ;;
    -h|--help) sed -n '2,21p' "$0"; exit 0 ;;
    *) echo "dpo-example.sh: unknown flag $1 (see --help)" >&2; exit 2 ;;
  esac
done
for v in iters seq dp; do
  [[ "${!v}" =~ ^[1-9][0-9]*$ ]] || { echo "dpo-example.sh: --$v must be a positive number" >&2; exit 2; }
done
[[ "$rm_iters" =~ ^[0-9]+$ ]] || { echo "dpo-example.sh: --rm-iters must be a number" >&2; exit 2; }
start=$(date +%s) steps=6
. "$root/scripts/lib/example.sh"
echo "Ferrotron post-training example: on SmolLM2-135M-Instruct, a reward model ($rm_iters iterations) and DPO ($iters iterations), 8 chitchat preference pairs per iteration."
# Each DPO step: 16 rows of $seq tokens, forward + backward, and the reference's forward.
echo "Expect ~$(( ((rm_iters + iters * 4 / 3) * 16 * seq / 170 + 300 + 59) / 60 )) minutes on 2 cores, plus ~8 the first time (release build, downloads)."

step 1 "release build"
release_build

step 2 "SmolLM2-135M-Instruct: GGUF -> HF"
smollm2_hf

step 3 "chitchat chats -> preference pairs (train / held-out by chat)"
pairs="$root/.cache/chitchat-dpo"
[ -f "$pairs/all.jsonl" ] || python3 tools/make_chitchat_preferences.py --output-dir "$pairs"
n_train=$(wc -l < "$pairs/train.jsonl") n_held=$(wc -l < "$pairs/heldout.jsonl")
echo "$n_train training pairs, $n_held held-out pairs"

rm -rf "$out"
mkdir -p "$out"
# Prints the held-out (validation) lines of metrics.jsonl $1 with their pair metrics.
heldout() {
  python3 - "$1" <<'PY'
import json, sys
for r in (json.loads(l) for l in open(sys.argv[1])):
    if r["kind"] == "valid":
        d = r["dpo"]
        print(f"  iteration {r['iteration']}: loss {r['lm_loss']:.4f}, reward margin "
              f"{d['rewards_margins']:.4f}, accuracy {d['rewards_accuracies']:.3f}")
PY
}

# Prints the run.toml of a LoRA run on the pairs: dataset type $1, $2 iterations, output
# directory $3, then the sections $4 (the objective's and the exports).
pairs_toml() {
  cat <<TOML
# $1 on SmolLM2-135M-Instruct with chitchat preference pairs (scripts/dpo-example.sh).
[model]
load = "$model"
seq_length = $seq
[data]
data_path = "$pairs/all.jsonl"
dataset_type = "$1"
split = "$n_train,$n_held,0"   # all.jsonl: the training pairs, then the held-out ones
[training]
micro_batch_size = 2           # pairs (two rows each)
global_batch_size = 8
train_iters = $2
eval_interval = $(( $2 > 10 ? $2 / 2 : $2 ))
eval_iters = 16                # 16 x 8 = 128 held-out pairs
log_interval = 5
[optimizer]
lr = 5e-4
min_lr = 5e-5
lr_decay_style = "cosine"
lr_warmup_iters = $(( $2 / 10 + 1 ))
[parallel]
data_parallel_size = $dp
[lora]
enabled = true                 # a reward model's score head trains in full beside the adapters
rank = 16
alpha = 32
$4
[logging]
output_dir = "$3"
TOML
}

step 4 "reward model (score head + LoRA rank 16): $rm_iters iterations"
if [ "$rm_iters" -gt 0 ]; then
  pairs_toml reward "$rm_iters" "$out/reward" "[reward]
center_rewards_coefficient = 0.01
[checkpoint]
export_hf = \"$out/reward-hf\"   # LlamaForSequenceClassification" > "$out/rm.toml"
  "$bin" train --config "$out/rm.toml"
  echo "reward model on the 128 held-out pairs (accuracy = the real reply scored above another chat's):"
  heldout "$out/reward/metrics.jsonl"
fi

step 5 "DPO with LoRA (rank 16): $iters iterations, data parallel $dp"
pairs_toml dpo "$iters" "$out/train" "[dpo]
beta = 0.1                     # TRL's default; the reference is the base without adapters
[checkpoint]
export_peft = \"$out/adapter\"
export_hf = \"$out/merged-hf\"" > "$out/run.toml"
"$bin" train --config "$out/run.toml"
echo "DPO on the 128 held-out pairs (chats never trained on); at iteration 0 the policy is the"
echo "reference: loss ln 2 = 0.6931, margin 0, accuracy 0"
heldout "$out/train/metrics.jsonl"

step 6 "chat: \"$prompt\""
echo "-- original SmolLM2-135M-Instruct:"
"$bin" generate --model "$model" --chat --prompt "$prompt" --max-new-tokens 48
echo
echo "-- after DPO (adapters merged):"
"$bin" generate --model "$out/merged-hf" --chat --prompt "$prompt" --max-new-tokens 48
echo
echo "done in $(( $(date +%s) - start )) s. Run: $out/train (metrics.jsonl, loss.png); PEFT adapter: $out/adapter; merged HF: $out/merged-hf"
