"""Reference indices from Megatron-Core's own GPT dataset code, for ferrotron-data's parity tests.

Writes fixtures/gpt_dataset/:
  * ``a.bin/.idx``, ``b.bin/.idx`` - two tiny uint16 token datasets written with Megatron's
    ``IndexedDatasetBuilder`` (one empty document in ``a``; every document ends with EOD = 1);
  * ``reference.json`` - for several GPTDataset builds (seed, sequence length, split, sample
    count, final-epoch separation, ``add_extra_token_to_sequence``,
    ``drop_last_partial_validation_sequence``): Megatron's document / sample / shuffle indices
    and a few ``__getitem__`` results (tokens, labels, loss mask, position ids and, per row of the
    attention mask, the first column a token may attend to); a two-dataset weighted blend built
    by ``BlendedMegatronDatasetBuilder`` (sub-dataset sample counts incl. the 0.5% surplus,
    ``dataset_index``, ``dataset_sample_index``); ``build_blending_indices`` /
    ``build_exhaustive_blending_indices`` on their own; ``parse_and_normalize_split`` results;
    ``numpy.random.RandomState(seed).shuffle`` permutations (full for small n, sha256 of the
    little-endian int64 bytes for large n).

Needs megatron-core 0.16.1 in the reference venv (pinned in tools/requirements.txt; its wheel
ships the compiled ``helpers_cpp``, so nothing is compiled here)::

    bash tools/setup_venv.sh
    tools/.venv/bin/python tools/make_gpt_index_fixture.py

Deterministic: re-running gives byte-identical files.
"""

import hashlib
import json
import os
import shutil
import sys
import tempfile
import warnings

warnings.filterwarnings("ignore")

import numpy  # noqa: E402
import torch  # noqa: E402

import megatron.core  # noqa: E402
from megatron.core.datasets import helpers  # noqa: E402
from megatron.core.datasets.blended_megatron_dataset_builder import (  # noqa: E402
    BlendedMegatronDatasetBuilder,
)
from megatron.core.datasets.blended_megatron_dataset_config import (  # noqa: E402
    parse_and_normalize_split,
)
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig  # noqa: E402
from megatron.core.datasets.indexed_dataset import IndexedDataset, IndexedDatasetBuilder  # noqa: E402
from megatron.core.datasets.utils import Split  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(ROOT, "fixtures", "gpt_dataset")
EOD = 1


class TinyTokenizer:
    """The tokenizer fields Megatron's GPT dataset reads (eod, vocab size, identity); no pad."""

    eod = EOD
    vocab_size = 256
    unique_identifiers = {"class": "TinyTokenizer", "vocab_size": 256}

    @property
    def pad(self):
        raise NotImplementedError


def write_dataset(prefix, seed, num_docs, max_len, empty_doc=None):
    rng = numpy.random.RandomState(seed)
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=numpy.uint16)
    for d in range(num_docs):
        n = 0 if d == empty_doc else int(rng.randint(1, max_len))
        body = rng.randint(2, 256, size=max(n - 1, 0)).tolist()
        tokens = body + [EOD] if n > 0 else []
        builder.add_item(torch.tensor(tokens, dtype=torch.int64))
        builder.end_document()
    builder.finalize(prefix + ".idx")


def attn_row_starts(mask):
    """Megatron's mask is True where attention is blocked; return, per row, the first open column
    after checking that the open columns are exactly [start, row]."""
    m = mask[0].numpy()
    starts = []
    for i in range(m.shape[0]):
        open_cols = numpy.nonzero(~m[i])[0]
        start = int(open_cols[0])
        assert open_cols.tolist() == list(range(start, i + 1)), (i, open_cols)
        starts.append(start)
    return starts


def gpt_case(name, prefix, cache, split, index_split, num_samples, **cfg):
    config = GPTDatasetConfig(
        random_seed=cfg.pop("seed"),
        sequence_length=cfg.pop("seq_length"),
        blend=([prefix], None),
        split=split,
        path_to_cache=cache,
        tokenizer=TinyTokenizer(),
        reset_position_ids=cfg.get("reset_position_ids", False),
        reset_attention_mask=cfg.get("reset_attention_mask", False),
        eod_mask_loss=cfg.get("eod_mask_loss", False),
        add_extra_token_to_sequence=cfg.get("add_extra_token_to_sequence", True),
        drop_last_partial_validation_sequence=cfg.get("drop_last_partial_validation_sequence", True),
    )
    sizes = [None, None, None]
    sizes[index_split.value] = num_samples
    datasets = BlendedMegatronDatasetBuilder(GPTDataset, sizes, lambda: True, config).build()
    ds = datasets[index_split.value]
    samples = {}
    for i in sorted({0, 1, len(ds) // 2, len(ds) - 1}):
        s = ds[i]
        samples[str(i)] = {
            "tokens": s["tokens"].tolist(),
            "labels": s["labels"].tolist(),
            "loss_mask": s["loss_mask"].tolist(),
            "position_ids": s["position_ids"].tolist(),
            "attention_row_start": attn_row_starts(s["attention_mask"]),
        }
    return {
        "name": name,
        "prefix": os.path.basename(prefix),
        "split": split,
        "index_split": index_split.name,
        "num_samples": num_samples,
        "seed": config.random_seed,
        "seq_length": config.sequence_length,
        "reset_position_ids": config.reset_position_ids,
        "reset_attention_mask": config.reset_attention_mask,
        "eod_mask_loss": config.eod_mask_loss,
        "add_extra_token_to_sequence": config.add_extra_token_to_sequence,
        "drop_last_partial_validation_sequence": config.drop_last_partial_validation_sequence,
        "split_indices": [int(ds.indices[0]), int(ds.indices[-1]) + 1],
        "len": len(ds),
        "document_index": numpy.asarray(ds.document_index).tolist(),
        "sample_index": numpy.asarray(ds.sample_index).tolist(),
        "shuffle_index": numpy.asarray(ds.shuffle_index).tolist(),
        "samples": samples,
    }


def blend_case(prefix_a, prefix_b, cache):
    config = GPTDatasetConfig(
        random_seed=7,
        sequence_length=8,
        blend=([prefix_a, prefix_b], [0.3, 0.7]),
        split="90,10,0",
        path_to_cache=cache,
        tokenizer=TinyTokenizer(),
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
    )
    sizes = [300, 31, 0]
    train, valid, _ = BlendedMegatronDatasetBuilder(GPTDataset, sizes, lambda: True, config).build()
    out = {"weights": [0.3, 0.7], "seed": 7, "seq_length": 8, "split": "90,10,0", "sizes": sizes}
    for name, b in (("train", train), ("valid", valid)):
        out[name] = {
            "len": len(b),
            "dataset_num_samples": [d.num_samples for d in b.datasets],
            "dataset_len": [len(d) for d in b.datasets],
            "dataset_index": numpy.asarray(b.dataset_index).tolist(),
            "dataset_sample_index": numpy.asarray(b.dataset_sample_index).tolist(),
            "shuffle_index_0": numpy.asarray(b.datasets[0].shuffle_index).tolist(),
            "sample_0_tokens": b[0]["tokens"].tolist(),
        }
    return out


def blending_helpers():
    cases = []
    for weights, size in (([0.3, 0.2, 0.5], 1000), ([0.5, 0.5], 7), ([0.01, 0.99], 500)):
        w = numpy.array(weights, dtype=numpy.float64)
        di = numpy.zeros(size, dtype=numpy.int16)
        dsi = numpy.zeros(size, dtype=numpy.int64)
        helpers.build_blending_indices(di, dsi, w, len(weights), size, False)
        cases.append({"weights": weights, "size": size, "dataset_index": di.tolist(),
                      "dataset_sample_index": dsi.tolist()})
    exhaustive = []
    for sizes in ([3, 5, 2], [10, 1]):
        s = numpy.array(sizes, dtype=numpy.int64)
        di = numpy.zeros(int(s.sum()), dtype=numpy.int16)
        dsi = numpy.zeros(int(s.sum()), dtype=numpy.int64)
        helpers.build_exhaustive_blending_indices(di, dsi, s, len(sizes))
        exhaustive.append({"sizes": sizes, "dataset_index": di.tolist(),
                           "dataset_sample_index": dsi.tolist()})
    return cases, exhaustive


def shuffles():
    out = []
    for seed in (0, 1, 1234, 2**32 - 1):
        for n in (0, 1, 2, 3, 10, 100, 70000):
            x = numpy.arange(n, dtype=numpy.int64)
            numpy.random.RandomState(seed).shuffle(x)
            entry = {"seed": seed, "n": n}
            if n <= 100:
                entry["permutation"] = x.tolist()
            else:
                entry["sha256_le_i64"] = hashlib.sha256(x.astype("<i8").tobytes()).hexdigest()
            out.append(entry)
    # Two shuffles from one state (Megatron shuffles the document index, then the shuffle index).
    rs = numpy.random.RandomState(42)
    a = numpy.arange(20, dtype=numpy.int32)
    rs.shuffle(a)
    b = numpy.arange(30, dtype=numpy.uint32)
    rs.shuffle(b)
    out.append({"seed": 42, "n": [20, 30], "permutation": [a.tolist(), b.tolist()]})
    return out


def main():
    os.makedirs(OUT, exist_ok=True)
    for f in ("a", "b"):
        for ext in (".bin", ".idx"):
            p = os.path.join(OUT, f + ext)
            if os.path.exists(p):
                os.remove(p)
    prefix_a = os.path.join(OUT, "a")
    prefix_b = os.path.join(OUT, "b")
    write_dataset(prefix_a, seed=11, num_docs=40, max_len=24, empty_doc=5)
    write_dataset(prefix_b, seed=22, num_docs=25, max_len=40)
    assert len(IndexedDataset(prefix_a)) == 40

    cache = tempfile.mkdtemp(prefix="gpt_fixture_cache_")
    # BlendedDataset asks torch.distributed for the rank when it caches: one local gloo process.
    torch.distributed.init_process_group(
        "gloo", init_method="file://" + os.path.join(cache, "pg"), rank=0, world_size=1
    )
    try:
        cases = [
            # 3 epochs, final epoch needs < 80% of one epoch: separate final-epoch shuffle.
            gpt_case("train_separate_final", prefix_a, cache, "80,15,5", Split.train, 50,
                     seed=1234, seq_length=16),
            # Final epoch needs >= 80%: one global shuffle.
            gpt_case("train_joint", prefix_a, cache, "80,15,5", Split.train, 66,
                     seed=1234, seq_length=16),
            # Fewer samples than one epoch holds: one epoch, no separation logic.
            gpt_case("train_one_epoch", prefix_a, cache, "80,15,5", Split.train, 10,
                     seed=1234, seq_length=16),
            gpt_case("train_other_seed", prefix_a, cache, "80,15,5", Split.train, 50,
                     seed=99, seq_length=16),
            gpt_case("train_masks", prefix_a, cache, "969,30,1", Split.train, 40,
                     seed=5, seq_length=12, reset_position_ids=True, reset_attention_mask=True,
                     eod_mask_loss=True),
            gpt_case("train_no_extra_token", prefix_b, cache, "1,0,0", Split.train, 30,
                     seed=3, seq_length=10, add_extra_token_to_sequence=False,
                     eod_mask_loss=True),
            gpt_case("valid_one_epoch", prefix_a, cache, "80,15,5", Split.valid, None,
                     seed=1234, seq_length=8),
            gpt_case("valid_keep_partial", prefix_b, cache, "60,40,0", Split.valid, None,
                     seed=8, seq_length=16, drop_last_partial_validation_sequence=False,
                     reset_position_ids=True),
        ]
        blend = blend_case(prefix_a, prefix_b, cache)
    finally:
        torch.distributed.destroy_process_group()
        shutil.rmtree(cache)
    blending, exhaustive = blending_helpers()
    splits = {s: parse_and_normalize_split(s) for s in ("969,30,1", "80,15,5", "1", "2,2", "0.5,0.25,0.25", "98, 2")}
    reference = {
        "megatron_core": megatron.core.__version__,
        "numpy": numpy.__version__,
        "eod": EOD,
        "gpt": cases,
        "blend": blend,
        "blending_indices": blending,
        "exhaustive_blending_indices": exhaustive,
        "parse_and_normalize_split": splits,
        "random_state_shuffle": shuffles(),
    }
    path = os.path.join(OUT, "reference.json")
    with open(path, "w") as f:
        json.dump(reference, f, separators=(",", ":"))
        f.write("\n")
    for name in sorted(os.listdir(OUT)):
        print(f"wrote {os.path.join(OUT, name)} ({os.path.getsize(os.path.join(OUT, name))} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
