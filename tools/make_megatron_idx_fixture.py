"""Golden Megatron `.bin/.idx` files written by Megatron-Core's own IndexedDatasetBuilder.

Writes fixtures/megatron_idx/:
  uint16.{bin,idx}, int32.{bin,idx}   datasets built by replaying ops.json's operations
                                      (add_item / end_document / add_document) with
                                      megatron.core.datasets.indexed_dataset.IndexedDatasetBuilder
  extra.{bin,idx}                     a second small uint16 dataset
  merged.{bin,idx}                    uint16 + extra merged with IndexedDatasetBuilder.add_index,
                                      exactly as Megatron's tools/merge_datasets.py does
  ops.json                            the operations and token lists, plus the megatron-core version

The Rust test crates/ferrotron-data/tests/indexed_golden.rs replays ops.json with our builder and
compares bytes, and reads these files with our reader.

Usage (reference venv, see tools/requirements.txt for the pinned megatron-core):
    tools/.venv/bin/python tools/make_megatron_idx_fixture.py
Only megatron.core.datasets.indexed_dataset is used; nothing is stubbed. It imports on CPU.
"""

import json
import os
import random
import warnings

warnings.filterwarnings("ignore")

import numpy  # noqa: E402
import torch  # noqa: E402
from importlib.metadata import version  # noqa: E402

from megatron.core.datasets import indexed_dataset as mid  # noqa: E402

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "fixtures", "megatron_idx")


def ops_for(max_token, seed):
    """A few documents: multi-sequence ones via add_item/end_document, whole ones via
    add_document, an empty sequence, an empty document, and the dtype's extreme values."""
    rng = random.Random(seed)

    def seq(n):
        return [rng.randrange(0, max_token + 1) for _ in range(n)]

    return [
        {"op": "add_item", "tokens": [0, 1, 2, max_token]},
        {"op": "end_document"},
        {"op": "add_item", "tokens": seq(7)},
        {"op": "add_item", "tokens": seq(3)},
        {"op": "add_item", "tokens": []},
        {"op": "add_item", "tokens": seq(11)},
        {"op": "end_document"},
        {"op": "end_document"},  # a document with no sequences
        {"op": "add_document", "tokens": seq(9), "lengths": [9]},
        {"op": "add_document", "tokens": seq(12), "lengths": [5, 0, 7]},
        {"op": "add_item", "tokens": seq(1)},
        {"op": "end_document"},
        {"op": "add_document", "tokens": seq(40), "lengths": [40]},
    ]


def build(prefix, dtype, ops):
    builder = mid.IndexedDatasetBuilder(mid.get_bin_path(prefix), dtype=dtype)
    for op in ops:
        if op["op"] == "add_item":
            builder.add_item(torch.tensor(op["tokens"], dtype=torch.int64))
        elif op["op"] == "end_document":
            builder.end_document()
        else:
            builder.add_document(op["tokens"], op["lengths"])
    builder.finalize(mid.get_idx_path(prefix))


def check(prefix, ops):
    """Reads the files back with Megatron's IndexedDataset: the sequences are the ops' tokens."""
    ds = mid.IndexedDataset(prefix)
    expected = []
    for op in ops:
        if op["op"] == "add_item":
            expected.append(op["tokens"])
        elif op["op"] == "add_document":
            start = 0
            for n in op["lengths"]:
                expected.append(op["tokens"][start : start + n])
                start += n
    assert len(ds) == len(expected), (len(ds), len(expected))
    for i, want in enumerate(expected):
        assert ds[i].tolist() == want, i


def main():
    os.makedirs(OUT, exist_ok=True)
    sets = {
        "uint16": (numpy.uint16, ops_for(65535, 1)),
        "int32": (numpy.int32, ops_for(2**31 - 1, 2)),
        "extra": (numpy.uint16, ops_for(49151, 3)[:7]),
    }
    for name, (dtype, ops) in sets.items():
        prefix = os.path.join(OUT, name)
        build(prefix, dtype, ops)
        check(prefix, ops)

    merged = os.path.join(OUT, "merged")
    builder = mid.IndexedDatasetBuilder(mid.get_bin_path(merged), dtype=numpy.uint16)
    for name in ["uint16", "extra"]:
        builder.add_index(os.path.join(OUT, name))
    builder.finalize(mid.get_idx_path(merged))

    doc = {
        "megatron_core_version": version("megatron-core"),
        "datasets": {
            name: {"dtype": numpy.dtype(dtype).name, "ops": ops}
            for name, (dtype, ops) in sets.items()
        },
        "merged": {"inputs": ["uint16", "extra"]},
    }
    with open(os.path.join(OUT, "ops.json"), "w") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")
    print("wrote", os.path.normpath(OUT), "with megatron-core", doc["megatron_core_version"])


if __name__ == "__main__":
    main()
