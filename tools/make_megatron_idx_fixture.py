"""Golden Megatron `.bin/.idx` files written by Megatron-Core's own IndexedDatasetBuilder.

Writes fixtures/megatron_idx/:
  uint16.{bin,idx}, int32.{bin,idx}   datasets built by replaying ops.json's operations
                                      (add_item / end_document / add_document) with
                                      megatron.core.datasets.indexed_dataset.IndexedDatasetBuilder
  extra.{bin,idx}                     a second small uint16 dataset
  merged.{bin,idx}                    uint16 + extra merged with IndexedDatasetBuilder.add_index,
                                      exactly as Megatron's tools/merge_datasets.py does
  ops.json                            the operations and token lists, plus the megatron-core version
  preprocess_input.jsonl              a small JSONL corpus (keys "text" and "title")
  preprocess_{text,title}_document.{bin,idx}
                                      that corpus preprocessed with --append-eod by the steps of
                                      Megatron-LM's tools/preprocess_data.py (Encoder.encode, which
                                      the pip package does not ship, followed line by line) using
                                      megatron.core's HuggingFaceTokenizer on the SmolLM2 tokenizer
                                      directory given by --tokenizer (default .cache/smollm2-hf)

The Rust test crates/ferrotron-data/tests/indexed_golden.rs replays ops.json with our builder and
compares bytes, and reads these files with our reader.

Usage (reference venv, see tools/requirements.txt for the pinned megatron-core):
    tools/.venv/bin/python tools/make_megatron_idx_fixture.py [--tokenizer DIR]
Only megatron.core.datasets.indexed_dataset is used; nothing is stubbed. It imports on CPU.
"""

import argparse
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


PREPROCESS_DOCS = [
    {"text": "In the beginning God created the heaven and the earth.", "title": "Genesis"},
    {"text": "The capital of France is Paris.\nIt lies on the Seine.", "title": "France"},
    {"text": "", "title": "An empty text keeps an empty document"},
    {"text": ["First sentence.", " Second sentence.", "", "Third."], "title": "Sentences"},
    {"text": "Unicode: caf\u00e9, na\u00efve, \u65e5\u672c\u8a9e, emoji \U0001F600 and tabs\tand  spaces.",
     "title": "Unicode"},
    {"text": "<|im_start|>user\nspecial tokens in text<|im_end|>", "title": "Specials"},
    {"text": "x" * 300, "title": ""},
    {"text": "Numbers 1234567890 and code: fn main() { println!(\"hi\"); }", "title": "Code"},
]


def preprocess_golden(tokenizer_dir):
    """tools/preprocess_data.py's Encoder.encode + process_json_file, json keys text and title,
    --append-eod, default tokenizer options (no special tokens added)."""
    from megatron.core.tokenizers.text.libraries.huggingface_tokenizer import (
        HuggingFaceTokenizer,
    )

    tokenizer = HuggingFaceTokenizer(tokenizer_dir)
    input_path = os.path.join(OUT, "preprocess_input.jsonl")
    with open(input_path, "w", encoding="utf-8") as f:
        for doc in PREPROCESS_DOCS:
            f.write(json.dumps(doc) + "\n")
    keys = ["text", "title"]
    builders = {
        key: mid.IndexedDatasetBuilder(
            mid.get_bin_path(os.path.join(OUT, f"preprocess_{key}_document")),
            dtype=mid.DType.optimal_dtype(tokenizer.vocab_size),
        )
        for key in keys
    }
    with open(input_path, "r", encoding="utf-8") as fin:
        for json_line in fin:
            data = json.loads(json_line)
            for key in keys:
                text = data[key]
                sentences = text if isinstance(text, list) else [text]
                doc_ids, sentence_lens = [], []
                for sentence in sentences:
                    sentence_ids = tokenizer.text_to_ids(sentence)
                    if len(sentence_ids) > 0:
                        doc_ids.extend(sentence_ids)
                        sentence_lens.append(len(sentence_ids))
                if len(doc_ids) > 0:
                    doc_ids.append(tokenizer.eod)
                    sentence_lens[-1] += 1
                builders[key].add_document(doc_ids, sentence_lens)
    for key in keys:
        builders[key].finalize(mid.get_idx_path(os.path.join(OUT, f"preprocess_{key}_document")))
    return {"eod": tokenizer.eod, "vocab_size": tokenizer.vocab_size, "keys": keys}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokenizer", default=os.path.join(OUT, "..", "..", ".cache", "smollm2-hf"))
    args = parser.parse_args()
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
    if os.path.isdir(args.tokenizer):
        doc["preprocess"] = preprocess_golden(args.tokenizer)
    else:
        print("skipped the preprocessing golden:", args.tokenizer, "is not a directory")
    with open(os.path.join(OUT, "ops.json"), "w") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")
    print("wrote", os.path.normpath(OUT), "with megatron-core", doc["megatron_core_version"])


if __name__ == "__main__":
    main()
