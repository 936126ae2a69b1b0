#!/usr/bin/env bash
# Create (or update) the reference venv at tools/.venv from tools/requirements.txt.
# Idempotent: re-running only installs what is missing or differs from the pins.
# The torch wheel pulls its CUDA dependencies (~5.6 GB); they are unused (CPU only) but harmless.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
VENV="$HERE/.venv"
PY="${PYTHON:-python3}"
if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
STAMP="$VENV/.requirements.sha256"
WANT="$(sha256sum "$HERE/requirements.txt" | cut -d' ' -f1)"
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$WANT" ] && "$VENV/bin/python" -c "import torch, transformers, safetensors, numpy, gguf, accelerate" 2>/dev/null; then
  echo "venv up to date: $VENV"
  exit 0
fi
"$VENV/bin/python" -m pip install --upgrade pip
"$VENV/bin/python" -m pip install -r "$HERE/requirements.txt"
echo "$WANT" > "$STAMP"
"$VENV/bin/python" -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
