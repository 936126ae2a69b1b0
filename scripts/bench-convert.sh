#!/usr/bin/env bash
# Checkpoint conversion speed and memory, side by side with a PyTorch reference: for each model
# (the real SmolLM2-135M, and a synthetic 1.1e9-parameter bf16 LLaMA made by
# tools/make_synthetic_hf.py) and tensor-parallel size, `ferrotron convert hf-to-ckpt` and
# `ckpt-to-hf` (bf16 models stay bf16) against tools/bench_convert_torch.py (load the whole state
# dict, split per rank, save: the hf2mcore approach). Prints per step the median wall time over
# --rounds runs, throughput (GB/s of tensor data written) and peak RSS (/usr/bin/time), plus the
# model's largest tensor in f32 (the streaming bound: peak RSS < 2x that + a constant).
#
#   bash scripts/bench-convert.sh                    # SmolLM2 + synthetic 1B, tp 1 and 4 (3 for SmolLM2)
#   bash scripts/bench-convert.sh --models smollm2 --rounds 5
#
# Options: --models smollm2,synthetic-1b  --rounds N (default 3)  --out DIR (target/bench-convert)
#          --no-torch (skip the PyTorch reference; it needs tools/.venv, see tools/README.md)
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
models="smollm2,synthetic-1b" rounds=3 out="$root/target/bench-convert" torch=1
while [ $# -gt 0 ]; do
  case "$1" in
    --models) models="$2"; shift ;;
    --rounds) rounds="$2"; shift ;;
    --out) out="$2"; shift ;;
    --no-torch) torch=0 ;;
    -h|--help) sed -n '2,15p' "$0"; exit 0 ;;
    *) echo "bench-convert.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
  esac
  shift
done
command -v /usr/bin/time >/dev/null || { apt-get update -qq && apt-get install -y -qq time >/dev/null; }
py="$root/tools/.venv/bin/python"
if [ "$torch" = 1 ] && [ ! -x "$py" ]; then
  echo "bench-convert.sh: no tools/.venv (bash tools/setup_venv.sh), skipping the PyTorch reference" >&2
  torch=0
fi
cargo build --release --quiet -p ferrotron
bin="$root/target/release/ferrotron"
mkdir -p "$out"

model_dir() {
  case "$1" in
    smollm2)
      if [ ! -f "$root/.cache/smollm2-hf/config.json" ]; then
        gguf="$(bash scripts/fetch-smollm2.sh)"
        "$bin" convert gguf-to-hf --input "$gguf" --output "$root/.cache/smollm2-hf" --force >/dev/null
      fi
      echo "$root/.cache/smollm2-hf" ;;
    synthetic-1b)
      if [ ! -f "$out/synthetic-1b/config.json" ]; then
        python="${py}"; [ -x "$python" ] || python=python3
        "$python" tools/make_synthetic_hf.py "$out/synthetic-1b" >&2
      fi
      echo "$out/synthetic-1b" ;;
    *) echo "bench-convert.sh: unknown model $1" >&2; exit 2 ;;
  esac
}

# Runs "$@" under /usr/bin/time; echoes "seconds max_rss_kb".
measure() {
  local log="$out/time.log"
  /usr/bin/time -v "$@" >"$out/cmd.log" 2>"$log" || { cat "$out/cmd.log" "$log" >&2; exit 1; }
  local wall rss
  wall=$(grep "Elapsed (wall clock)" "$log" | awk '{print $NF}' | awk -F: '{ if (NF==3) print $1*3600+$2*60+$3; else print $1*60+$2 }')
  rss=$(grep "Maximum resident set size" "$log" | awk '{print $NF}')
  echo "$wall $rss"
}

median() { sort -g | awk '{a[NR]=$1} END {print (NR%2) ? a[(NR+1)/2] : (a[NR/2]+a[NR/2+1])/2}'; }

report() { # name bytes times... rss...
  local name="$1" bytes="$2" times="$3" rss="$4"
  local t r
  t=$(echo "$times" | tr ' ' '\n' | median)
  r=$(echo "$rss" | tr ' ' '\n' | sort -g | tail -1)
  awk -v n="$name" -v t="$t" -v b="$bytes" -v r="$r" \
    'BEGIN { printf "%-34s %8.2f s %7.2f GB/s %9.0f MiB peak RSS\n", n, t, b/1e9/t, r/1024 }'
}

echo "bench-convert: $(nproc) cores, $rounds rounds, medians; $(date -u +%F)"
for m in ${models//,/ }; do
  dir="$(model_dir "$m")"
  dtype=f32; grep -q '"bfloat16"' "$dir/config.json" && dtype=bf16
  bytes=$(du -cb "$dir"/model*.safetensors | tail -1 | cut -f1)
  largest=$(python3 - "$dir" <<'EOF'
import json, struct, sys, glob
best = 0
for p in glob.glob(sys.argv[1] + "/model*.safetensors"):
    with open(p, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        h = json.loads(f.read(n))
    h.pop("__metadata__", None)
    for v in h.values():
        k = 1
        for d in v["shape"]:
            k *= d
        best = max(best, k)
print(best * 4)
EOF
)
  echo "== $m ($dir): $(awk -v b="$bytes" 'BEGIN{printf "%.2f GB", b/1e9}') of $dtype tensors, largest tensor $(awk -v b="$largest" 'BEGIN{printf "%.0f MiB", b/1048576}') in f32"
  tps="1 4"; [ "$m" = smollm2 ] && tps="1 3"
  for tp in $tps; do
    t_in="" r_in="" t_out="" r_out="" t_py="" r_py=""
    for _ in $(seq "$rounds"); do
      rm -rf "$out/ckpt" "$out/hf" "$out/torch"
      read -r t r < <(measure "$bin" convert hf-to-ckpt --hf "$dir" --output "$out/ckpt" \
        --tensor-model-parallel-size "$tp" --dtype "$dtype")
      t_in="$t_in $t" r_in="$r_in $r"
      read -r t r < <(measure "$bin" convert ckpt-to-hf --ckpt "$out/ckpt" --output "$out/hf" --dtype "$dtype")
      t_out="$t_out $t" r_out="$r_out $r"
      if [ "$torch" = 1 ]; then
        read -r t r < <(measure "$py" tools/bench_convert_torch.py "$dir" "$out/torch" --tp "$tp")
        t_py="$t_py $t" r_py="$r_py $r"
      fi
    done
    report "ferrotron hf-to-ckpt tp $tp" "$bytes" "$t_in" "$r_in"
    report "ferrotron ckpt-to-hf (from tp $tp)" "$bytes" "$t_out" "$r_out"
    [ "$torch" = 1 ] && report "torch hf2mcore-style tp $tp" "$bytes" "$t_py" "$r_py"
  done
  rm -rf "$out/ckpt" "$out/hf" "$out/torch"
done
