#!/usr/bin/env bash
# The test command (README): format check, clippy with warnings as errors, and the whole
# workspace test suite, including the end-to-end tests on the real SmolLM2 weights.
# Installs what it needs on a fresh machine of this kind; safe to re-run.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
# One clean build: incremental caches would about double target/ on disk (a CI machine's
# disk can be small) and speed nothing up.
export CARGO_INCREMENTAL=0

need_apt=()
command -v python3 >/dev/null || need_apt+=(python3 python3-pip)
# the OpenAI client venv of the serving tests
python3 -c 'import venv, ensurepip' 2>/dev/null || need_apt+=(python3-venv)
# MPI backend (feature `mpi`, tested with mpirun): OpenMPI, and libclang for rsmpi's bindgen.
command -v mpirun >/dev/null || need_apt+=(openmpi-bin)
command -v mpicc >/dev/null || need_apt+=(libopenmpi-dev)
command -v clang >/dev/null || need_apt+=(clang)
compgen -G "/usr/lib/llvm-*/lib/libclang*.so*" >/dev/null || need_apt+=(libclang-dev)
if [ ${#need_apt[@]} -gt 0 ]; then
  apt-get update -qq && apt-get install -y -qq "${need_apt[@]}"
fi
rustup component list --installed 2>/dev/null | grep -q '^rustfmt' || rustup component add rustfmt
rustup component list --installed 2>/dev/null | grep -q '^clippy' || rustup component add clippy

FERROTRON_SMOLLM2_GGUF="$(bash scripts/fetch-smollm2.sh)"
export FERROTRON_SMOLLM2_GGUF
# The converted HF directory (tokenizer + weights) for tests that need a real tokenizer.
FERROTRON_SMOLLM2_HF="$root/.cache/smollm2-hf"
if [ ! -f "$FERROTRON_SMOLLM2_HF/tokenizer_config.json" ]; then
  cargo run --quiet -p ferrotron -- convert gguf-to-hf --input "$FERROTRON_SMOLLM2_GGUF" \
    --output "$FERROTRON_SMOLLM2_HF" --force
fi
export FERROTRON_SMOLLM2_HF
# The official openai client, for the serving tests (tools/check_openai_client.py).
client_venv="$root/.cache/openai-venv"
if ! "$client_venv/bin/python" -c 'import openai' 2>/dev/null \
  || ! cmp -s tools/requirements-client.txt "$client_venv/requirements-client.txt"; then
  python3 -m venv "$client_venv"
  "$client_venv/bin/python" -m pip install -q -r tools/requirements-client.txt
  cp tools/requirements-client.txt "$client_venv/requirements-client.txt"
fi
FERROTRON_OPENAI_PYTHON="$client_venv/bin/python"
export FERROTRON_OPENAI_PYTHON
# Without these the tests on the real weights are reported as ignored (tests/common/weights.rs);
# under CI=true they must run, so missing weights fail here.
if [ "${CI:-}" = true ]; then
  missing=()
  [ -f "${FERROTRON_SMOLLM2_GGUF:-}" ] || missing+=("FERROTRON_SMOLLM2_GGUF (a GGUF file)")
  for f in tokenizer.json tokenizer_config.json; do
    [ -f "${FERROTRON_SMOLLM2_HF:-}/$f" ] || missing+=("FERROTRON_SMOLLM2_HF/$f")
  done
  [ -x "${FERROTRON_OPENAI_PYTHON:-}" ] || missing+=("FERROTRON_OPENAI_PYTHON (python with openai)")
  if [ ${#missing[@]} -gt 0 ]; then
    echo "error: CI=true needs the SmolLM2 weights for the tests on them; missing:" \
      "${missing[*]} (FERROTRON_SMOLLM2_GGUF='${FERROTRON_SMOLLM2_GGUF:-}'," \
      "FERROTRON_SMOLLM2_HF='${FERROTRON_SMOLLM2_HF:-}')" >&2
    exit 1
  fi
fi

echo "== cargo fmt --check"
cargo fmt --all -- --check
echo "== cargo clippy --all-targets -D warnings"
cargo clippy --workspace --all-targets --all-features -- -D warnings
echo "== cargo test --workspace --all-features (MPI tests run under mpirun)"
cargo test --workspace --all-features
