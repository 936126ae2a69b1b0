#!/usr/bin/env bash
# Parallel layouts side by side on the real job: `ferrotron train` continue-pretraining
# SmolLM2-135M on a Megatron .bin/.idx corpus (the KJV Bible by default) for a few iterations
# under each layout, the same global batch for all. Prints per layout: median tokens/s of the
# timed iterations (the first is warmup), the ratio to the single rank, the peak RSS of the
# whole job (all in-process ranks together; per process for mpirun), and the training losses
# (f32: every layout must track the single rank).
#
#   bash scripts/bench-parallel.sh --data /work/runs/kjv/kjv_text_document
#   bash scripts/bench-parallel.sh --data PREFIX --layouts single,dp2,tp2 --iters 4
#
# Layouts: single, dp2, dp2-overlap (overlap_grad_reduce), dp2-zero1 (distributed optimizer),
# dp2-zero1-overlap-grad (+ overlap_grad_reduce), dp2-zero1-overlap (distributed optimizer +
# overlap_grad_reduce + overlap_param_gather),
# tp3 (SmolLM2-135M's 9 heads / 3 query groups split over 3, not 2), tp3xdp2, pp2,
# pp2vp3 (interleaved 1F1B, 3 model chunks of 5 layers per stage), pp2xdp2,
# tp2 / tp2-sp / tp2xdp2 (models whose heads and groups divide by 2), cp2 / cp4 (context
# parallel, p2p ring; cp2-ag / cp2-a2a: all_gather / a2a), mpi-dp2, mpi-cpN (N
# processes of context parallelism N: the peak RSS is then per rank; mpi-cp1 is the single
# rank as a process) and mpi-dp2-zero1/2/3 (2 processes, data_parallel_sharding_strategy
# optim / optim_grads / optim_grads_params; -overlap: + overlap_grad_reduce; peak RSS per
# rank) (mpi layouts need a build
# with --features mpi and OpenMPI). "step GiB" is rank 0's process peak RSS up to its last
# log line (before the end of the run, which gathers ZeRO-3's weights whole), "state GiB"
# the model state it holds in memory after the last step (resident pages of weights and
# gradients + optimizer state). Options:
# --model DIR (default .cache/smollm2-hf), --iters N (default 6), --seq N (512), --gbs N (8),
# --mbs N (2), --recompute full|selective|none (training.recompute_granularity; full is
# uniform, one layer per group; default none), --packed (documents masked and positions
# reset per document: data.reset_attention_mask / reset_position_ids; context parallelism then
# splits each document), --out DIR (default target/bench-parallel).
#
# Long context (issue 17): bash scripts/bench-parallel.sh --data PREFIX --seq 8192 --gbs 1
#   --mbs 1 --iters 2 --recompute full --layouts mpi-cp1,mpi-cp2,mpi-cp4
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
model="$root/.cache/smollm2-hf" data="" layouts="single,dp2,dp2-overlap,dp2-zero1,tp3,pp2,pp2xdp2,mpi-dp2"
iters=6 seq=512 gbs=8 mbs=2 recompute=none packed=false out="$root/target/bench-parallel"
while [ $# -gt 0 ]; do
  case "$1" in
    --model) model="$2"; shift ;;
    --data) data="$2"; shift ;;
    --layouts) layouts="$2"; shift ;;
    --iters) iters="$2"; shift ;;
    --seq) seq="$2"; shift ;;
    --gbs) gbs="$2"; shift ;;
    --mbs) mbs="$2"; shift ;;
    --recompute) recompute="$2"; shift ;;
    --out) out="$2"; shift ;;
    --packed) packed=true ;;
    -h|--help) sed -n '2,34p' "$0"; exit 0 ;;
    *) echo "bench-parallel.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
  esac
  shift
done
[ -n "$data" ] || { echo "bench-parallel.sh: --data PREFIX (a .bin/.idx corpus) is required" >&2; exit 2; }
[ -f "$data.idx" ] || { echo "bench-parallel.sh: $data.idx not found" >&2; exit 2; }
[ -f "$model/config.json" ] || { echo "bench-parallel.sh: $model has no config.json" >&2; exit 2; }
case "$recompute" in
  full) recompute_toml=$'recompute_granularity = "full"\nrecompute_method = "uniform"\nrecompute_num_layers = 1' ;;
  selective) recompute_toml='recompute_granularity = "selective"' ;;
  none) recompute_toml="" ;;
  *) echo "bench-parallel.sh: --recompute is full, selective or none" >&2; exit 2 ;;
esac
features=""
if command -v mpirun >/dev/null; then features="--features mpi"; fi
cargo build --release --quiet -p ferrotron $features
bin="${CARGO_TARGET_DIR:-$root/target}/release/ferrotron"
mkdir -p "$out"

layout_sets() {
  case "$1" in
    single) echo "" ;;
    dp2) echo "--set parallel.data_parallel_size=2" ;;
    dp2-overlap) echo "--set parallel.data_parallel_size=2 --set parallel.overlap_grad_reduce=true" ;;
    dp2-zero1) echo "--set parallel.data_parallel_size=2 --set parallel.use_distributed_optimizer=true" ;;
    dp2-zero1-overlap-grad) echo "--set parallel.data_parallel_size=2 --set parallel.use_distributed_optimizer=true --set parallel.overlap_grad_reduce=true" ;;
    dp2-zero1-overlap) echo "--set parallel.data_parallel_size=2 --set parallel.use_distributed_optimizer=true --set parallel.overlap_grad_reduce=true --set parallel.overlap_param_gather=true" ;;
    tp2) echo "--set parallel.tensor_model_parallel_size=2" ;;
    tp3) echo "--set parallel.tensor_model_parallel_size=3" ;;
    tp3xdp2) echo "--set parallel.tensor_model_parallel_size=3 --set parallel.data_parallel_size=2" ;;
    pp2) echo "--set parallel.pipeline_model_parallel_size=2" ;;
    pp2vp3) echo "--set parallel.pipeline_model_parallel_size=2 --set parallel.virtual_pipeline_model_parallel_size=3" ;;
    pp2xdp2) echo "--set parallel.pipeline_model_parallel_size=2 --set parallel.data_parallel_size=2" ;;
    tp2-sp) echo "--set parallel.tensor_model_parallel_size=2 --set parallel.sequence_parallel=true" ;;
    tp2xdp2) echo "--set parallel.tensor_model_parallel_size=2 --set parallel.data_parallel_size=2" ;;
    cp2) echo "--set parallel.context_parallel_size=2" ;;
    cp2-ag) echo "--set parallel.context_parallel_size=2 --set parallel.cp_comm_type=all_gather" ;;
    cp2-a2a) echo "--set parallel.context_parallel_size=2 --set parallel.cp_comm_type=a2a" ;;
    cp4) echo "--set parallel.context_parallel_size=4" ;;
    mpi-dp2) echo "" ;;
    mpi-dp2-zero1) echo "--set parallel.data_parallel_sharding_strategy=optim" ;;
    mpi-dp2-zero2) echo "--set parallel.data_parallel_sharding_strategy=optim_grads" ;;
    mpi-dp2-zero3) echo "--set parallel.data_parallel_sharding_strategy=optim_grads_params" ;;
    mpi-dp2-zero2-overlap) echo "--set parallel.data_parallel_sharding_strategy=optim_grads --set parallel.overlap_grad_reduce=true" ;;
    mpi-dp2-zero3-overlap) echo "--set parallel.data_parallel_sharding_strategy=optim_grads_params --set parallel.overlap_grad_reduce=true" ;;
    mpi-cp*) echo "--set parallel.context_parallel_size=${1#mpi-cp}" ;;
    *) echo "bench-parallel.sh: unknown layout $1" >&2; exit 2 ;;
  esac
}

printf '%-18s %9s %6s %9s %9s %9s %9s  %s\n' layout "tok/s" ratio "peak GiB" "step GiB" "state GiB" "wait ms" "losses"
base=""
IFS=',' read -r -a list <<< "$layouts"
for l in "${list[@]}"; do
  dir="$out/$l"; rm -rf "$dir"; mkdir -p "$dir"
  cat > "$dir/run.toml" <<TOML
[model]
load = "$model"
seq_length = $seq
[data]
data_path = "$data"
split = "969,30,1"
reset_attention_mask = $packed
reset_position_ids = $packed
[training]
micro_batch_size = $mbs
global_batch_size = $gbs
train_iters = $iters
log_interval = 1
eval_iters = 0
$recompute_toml
[optimizer]
lr = 1e-4
min_lr = 1e-5
lr_warmup_iters = 1
[logging]
output_dir = "$dir"
tensorboard = false
TOML
  # shellcheck disable=SC2046
  if [ "$l" = mpi-dp2 ]; then
    /usr/bin/time -v mpirun --oversubscribe --allow-run-as-root -np 2 "$bin" train \
      --dist-backend mpi --config "$dir/run.toml" > "$dir/stdout" 2> "$dir/stderr"
  elif [[ "$l" == mpi-cp* || "$l" == mpi-dp2-* ]]; then
    # GNU time around each process: one peak RSS per rank (the largest is printed). No core
    # binding: OpenMPI binds each of up to 2 processes to one core, which would leave a
    # single rank's second thread on the first's core.
    np=2; [[ "$l" == mpi-cp* ]] && np="${l#mpi-cp}"
    mpirun --oversubscribe --allow-run-as-root --bind-to none -np "$np" /usr/bin/time -v "$bin" train \
      --dist-backend mpi --config "$dir/run.toml" $(layout_sets "$l") > "$dir/stdout" 2> "$dir/stderr"
  else
    /usr/bin/time -v "$bin" train --config "$dir/run.toml" $(layout_sets "$l") \
      > "$dir/stdout" 2> "$dir/stderr"
  fi
  python3 - "$dir" "$l" "${base:-}" <<'PY' | tee -a "$out/results.txt"
import json, re, statistics, sys
d, layout, base = sys.argv[1], sys.argv[2], sys.argv[3]
rows = [json.loads(l) for l in open(f"{d}/metrics.jsonl") if '"train"' in l]
tps = [r["tokens_per_second"] for r in rows[1:]] or [rows[0]["tokens_per_second"]]
med = statistics.median(tps)
rss = max(int(m) for m in re.findall(r"Maximum resident set size \(kbytes\): (\d+)", open(f"{d}/stderr").read())) / 2**20
ratio = f"{med / float(base):.2f}" if base else "1.00"
wait = statistics.median([r.get("comm_wait_ms", 0.0) for r in rows[1:]] or [0.0])
state = rows[-1].get("model_state_bytes", 0) / 2**30
step = rows[-1].get("peak_rss_bytes", 0) / 2**30
print(f"{layout:<18} {med:9.1f} {ratio:>6} {rss:9.2f} {step:9.2f} {state:9.2f} {wait:9.1f}  " + " ".join(f"{r['lm_loss']:.5f}" for r in rows))
PY
  if [ -z "$base" ]; then
    base=$(python3 -c "import json,statistics;r=[json.loads(l) for l in open('$dir/metrics.jsonl') if '\"train\"' in l];t=[x['tokens_per_second'] for x in r[1:]] or [r[0]['tokens_per_second']];print(statistics.median(t))")
  fi
done
