#!/usr/bin/env python3
"""Random ggml blocks and their values as gguf-py dequantizes them (the reference transformers'
GGUF loader uses), for the exactness test of ferrotron-tensor's quant::dequantize.

    tools/.venv/bin/python tools/make_quant_fixture.py   # writes fixtures/quant/gguf_py_blocks.json

For each of Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q6_K: 512 values of random bytes (numpy seed 0)
whose f16 scale fields are replaced by finite values of a realistic size, and the f32 values
``gguf.quants.dequantize`` gives for them, as bit patterns.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

import gguf
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize

OUT = Path(__file__).resolve().parent.parent / "fixtures" / "quant" / "gguf_py_blocks.json"
VALUES = 512

# Byte offsets of the f16 scale fields within one block.
F16_FIELDS = {
    "Q8_0": [0], "Q4_0": [0], "Q4_1": [0, 2], "Q5_0": [0], "Q5_1": [0, 2],
    "Q4_K": [0, 2], "Q6_K": [208],
}


def main() -> None:
    rng = np.random.default_rng(0)
    out = {"gguf_version": gguf.__version__ if hasattr(gguf, "__version__") else "0.19.0", "types": {}}
    for name, fields in F16_FIELDS.items():
        qtype = T[name]
        block, size = gguf.GGML_QUANT_SIZES[qtype]
        n = VALUES // block
        data = rng.integers(0, 256, size=(n, size), dtype=np.uint8)
        for f in fields:
            scale = rng.uniform(1e-4, 2e-2, size=n).astype(np.float16)
            data[:, f : f + 2] = scale.view(np.uint8).reshape(n, 2)
        values = dequantize(data.reshape(-1), qtype).astype(np.float32).reshape(-1)
        out["types"][name] = {
            "bytes": data.tobytes().hex(),
            "value_bits": values.view(np.uint32).tolist(),
        }
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(out) + "\n")
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
