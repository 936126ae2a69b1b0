#!/usr/bin/env bash
# Training-speed benchmark side by side: Ferrotron (crates/ferrotron-train/examples/bench_train.rs)
# vs PyTorch (tools/bench_train_torch.py) on the same HF SmolLM2-135M directory, same tokens,
# seq 512, fwd + bwd + clip + AdamW, 2 threads; f32 and bf16 (torch autocast), micro-batch 1/2/4.
# Every configuration runs in a fresh process per side (peak RSS is that configuration's), the two
# sides back to back and alternating which goes first, so background load hits both.
# Prints the machine's measured f32 FMA and bf16 dot peaks and a table: config, tokens/s of each
# side, ratio (ours / torch), model GFLOP/s of each side (Megatron's FLOPs count) with the MFU
# against each peak, peak RSS of each side, and the step-1 loss of each side (same tokens and
# weights, so f32 losses should agree).
#
#   bash scripts/bench-train.sh                  # all configs: warmup 5, 5 timed steps
#   bash scripts/bench-train.sh --quick          # micro-batch 1 only, warmup 1, 2 timed steps
#   bash scripts/bench-train.sh --micro-batches 1,2 --modes f32 --steps 3 --rounds 2
#   bash scripts/bench-train.sh --lora-rank 16   # LoRA on the frozen model (ours vs PEFT)
#
# Why 5 warmup steps: PyTorch reaches its steady step time only after 3-5 steps (glibc raises
# its mmap threshold as large blocks are freed, so later steps reuse heap memory instead of
# faulting in fresh pages); on the bench Mixtral torch f32 took 3.7, 2.4, 2.0, 1.1 s for steps
# 1-4, then ~1.03 s. Fewer warmup steps time torch's warm-up and flatter the ratio.
#
# Options: --model DIR (default .cache/smollm2-hf, converted from the GGUF when missing),
# --warmup N, --steps N, --micro-batches LIST, --modes LIST (f32,bf16), --seq N, --threads N,
# --rounds N (repeat everything; the table keeps the median tok/s and the highest peak RSS),
# --tokens FILE (a Megatron .bin token file instead of random tokens), --out FILE (JSON lines),
# --lora-rank R (train LoRA adapters of rank R, alpha R: ours on linear_qkv/proj/fc1/fc2, PEFT on
# q/k/v/o/gate/up/down; model FLOPs then leave out the frozen base's weight gradients).
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"

model="$root/.cache/smollm2-hf"
warmup=5 steps=5 mbs="1,2,4" modes="f32,bf16" seq=512 threads=2 rounds=1 tokens="" out="" lora=""
while [ $# -gt 0 ]; do
  case "$1" in
    --quick) warmup=1 steps=2 mbs=1 ;;
    --model) model="$2"; shift ;;
    --warmup) warmup="$2"; shift ;;
    --steps) steps="$2"; shift ;;
    --micro-batches) mbs="$2"; shift ;;
    --modes) modes="$2"; shift ;;
    --seq) seq="$2"; shift ;;
    --threads) threads="$2"; shift ;;
    --rounds) rounds="$2"; shift ;;
    --tokens) tokens="$2"; shift ;;
    --out) out="$2"; shift ;;
    --lora-rank) lora="$2"; shift ;;
    -h|--help) sed -n '2,21p' "$0"; exit 0 ;;
    *) echo "bench-train.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
  esac
  shift
done
for v in warmup steps seq threads rounds; do
  [[ "${!v}" =~ ^[0-9]+$ ]] || { echo "bench-train.sh: --$v must be a number, got '${!v}'" >&2; exit 2; }
done
[[ -z "$lora" || "$lora" =~ ^[1-9][0-9]*$ ]] || { echo "bench-train.sh: --lora-rank must be >= 1, got '$lora'" >&2; exit 2; }
IFS=',' read -r -a mb_list <<< "$mbs"
IFS=',' read -r -a mode_list <<< "$modes"
for m in "${mode_list[@]}"; do
  [[ "$m" == f32 || "$m" == bf16 ]] || { echo "bench-train.sh: --modes: '$m' is not f32 or bf16" >&2; exit 2; }
done

if [ ! -f "$model/config.json" ]; then
  if [ "$model" != "$root/.cache/smollm2-hf" ]; then
    echo "bench-train.sh: $model has no config.json (an HF model directory is needed)" >&2; exit 2
  fi
  gguf="$(bash scripts/fetch-smollm2.sh)"
  cargo run --release --quiet -p ferrotron -- convert gguf-to-hf --input "$gguf" --output "$model" --force
fi
cargo build --release --quiet -p ferrotron-train --example bench_train
ours="${CARGO_TARGET_DIR:-$root/target}/release/examples/bench_train"
bash tools/setup_venv.sh >&2
py="$root/tools/.venv/bin/python"

[ -n "$out" ] || out="${CARGO_TARGET_DIR:-$root/target}/bench-train-$(date +%Y%m%d-%H%M%S).jsonl"
mkdir -p "$(dirname "$out")"
: > "$out"
common=(--seq "$seq" --warmup "$warmup" --steps "$steps" --threads "$threads")
[ -z "$tokens" ] || common+=(--tokens "$tokens")
[ -z "$lora" ] || common+=(--lora-rank "$lora")
load_before="$(cut -d' ' -f1-3 /proc/loadavg)"

# run_one IMPL MODE MB: one fresh process; its JSON line (or an error line) goes to $out.
run_one() {
  local impl="$1" mode="$2" mb="$3" stdout rc=0
  stdout="$(mktemp)"
  if [ "$impl" = ferrotron ]; then
    "$ours" "$model" --precision "$mode" --micro-batch "$mb" "${common[@]}" > "$stdout" || rc=$?
  else
    "$py" "$root/tools/bench_train_torch.py" "$model" --mode "$mode" --micro-batch "$mb" \
      "${common[@]}" > "$stdout" || rc=$?
  fi
  if [ "$rc" -eq 0 ] && grep -q '^{' "$stdout"; then
    grep '^{' "$stdout" | tail -n 1 >> "$out"
  else
    echo "bench-train.sh: $impl $mode b=$mb failed (exit $rc)" >&2
    printf '{"impl": "%s", "mode": "%s", "micro_batch": %s, "error": "exit %s"}\n' \
      "$impl" "$mode" "$mb" "$rc" >> "$out"
  fi
  rm -f "$stdout"
}

i=0
for ((r = 0; r < rounds; r++)); do
  for mode in "${mode_list[@]}"; do
    for mb in "${mb_list[@]}"; do
      if (( (i + r) % 2 == 0 )); then order=(ferrotron torch); else order=(torch ferrotron); fi
      for impl in "${order[@]}"; do run_one "$impl" "$mode" "$mb"; done
      i=$((i + 1))
    done
  done
done

echo
echo "$(basename "$model") training step (fwd+bwd+clip+AdamW${lora:+, LoRA rank $lora}), seq $seq, $threads threads, warmup $warmup," \
  "$steps timed steps (median), $rounds round(s); $model"
echo "load average before: $load_before, after: $(cut -d' ' -f1-3 /proc/loadavg); results: $out"
"$py" - "$out" <<'EOF'
import json, statistics, sys

rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
configs = list(dict.fromkeys((r["mode"], r["micro_batch"]) for r in rows))

def side(impl, cfg):
    rs = [r for r in rows if r["impl"] == impl and (r["mode"], r["micro_batch"]) == cfg]
    ok = [r for r in rs if "tokens_per_s" in r]
    if not ok:
        why = "not supported yet" if any(r.get("supported") is False for r in rs) else "failed"
        return None, why, "-", "-"
    tps = statistics.median(r["tokens_per_s"] for r in ok)
    rss = max(r["peak_rss_mib"] or 0 for r in ok) / 1024
    return tps, f"{tps:.1f}", f"{rss:.2f} GiB", f"{ok[0]['loss_first']:.4f}"

# Model FLOPs (Megatron's count) and the machine's measured peaks come from our rows; the same
# count per token applies to torch (same model, same tokens).
ours_ok = [r for r in rows if r["impl"] == "ferrotron" and r.get("model_flops_per_step")]
flops_per_token = (ours_ok[0]["model_flops_per_step"] / (ours_ok[0]["micro_batch"] * ours_ok[0]["seq"])
                   if ours_ok else None)
peak = lambda key: max((r[key] for r in ours_ok if r.get(key)), default=None)
p32, p16 = peak("peak_f32_gflops"), peak("peak_bf16_gflops")

def mfu(tps):
    if tps is None or flops_per_token is None:
        return "-"
    gf = tps * flops_per_token / 1e9
    f = lambda p: f"{100 * gf / p:.0f}%" if p else "-"
    return f"{gf:.0f} ({f(p32)} / {f(p16)})"

head = ["config", "ours tok/s", "torch tok/s", "ratio", "ours GF/s (MFU f32 / bf16 peak)",
        "torch GF/s (MFU)", "ours peak RSS", "torch peak RSS", "step-1 loss ours / torch"]
table = []
for cfg in configs:
    o, t = side("ferrotron", cfg), side("torch", cfg)
    ratio = f"{o[0] / t[0]:.2f}x" if o[0] and t[0] else "-"
    table.append([f"{cfg[0]} b={cfg[1]}", o[1], t[1], ratio, mfu(o[0]), mfu(t[0]), o[2], t[2],
                  f"{o[3]} / {t[3]}"])
if ours_ok:
    kernel = ours_ok[0]["bf16_kernel"]
    print(f"measured peaks on these threads: f32 FMA {p32} GF/s, bf16 dot ({kernel}) {p16} GF/s;"
          " MFU = model FLOPs (Megatron's count) per second / peak")
w = [max(len(r[i]) for r in [head] + table) for i in range(len(head))]
for r in [head, ["-" * n for n in w]] + table:
    print("| " + " | ".join(c.ljust(n) for c, n in zip(r, w)) + " |")
EOF
