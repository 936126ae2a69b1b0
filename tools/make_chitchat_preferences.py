#!/usr/bin/env python3
"""Preference pairs from the Chit-Chat Challenge chats (PyPI ``chitchat-dataset==0.9.0``, MIT)
for DPO and reward models (a relevance preference: no preference dataset ships in the package
registries).

    python3 tools/make_chitchat_preferences.py --output-dir .cache/chitchat-dpo

For every assistant turn of every chat (chats as ``tools/make_chitchat_jsonl.py`` converts
them): ``prompt`` = the conversation before it (its last ``--context`` messages, starting with a
user message), ``chosen`` = the real reply, ``rejected`` = an assistant reply drawn from
*another* chat (seeded, so the file is deterministic). Replies longer than ``--max-chars`` are
skipped. Chats are split by a hash of their id: ``--heldout-percent`` of them (default 5) go to
the held-out file, the rest to training; so no conversation is in both.

Writes, in ``--output-dir``:

* ``train.jsonl`` and ``heldout.jsonl``: ``{"id", "prompt": [messages], "chosen": text,
  "rejected": text}`` per line (TRL's conversational preference form);
* ``all.jsonl``: the training pairs, then the held-out pairs, for a run that splits one file
  with ``data.split`` = the printed weights (the held-out pairs are exactly its validation part).

Plain Python 3 (reuses ``make_chitchat_jsonl.py``'s download and conversion).
"""

import argparse
import hashlib
import json
import pathlib
import random
import sys
import zipfile

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import make_chitchat_jsonl as chitchat  # noqa: E402


def heldout(chat_id: str, percent: int) -> bool:
    return int(hashlib.sha256(chat_id.encode()).hexdigest(), 16) % 100 < percent


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--output-dir", required=True, type=pathlib.Path)
    ap.add_argument("--context", type=int, default=3, help="messages of conversation before the reply")
    ap.add_argument("--max-chars", type=int, default=300, help="skip replies longer than this")
    ap.add_argument("--heldout-percent", type=int, default=5)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--cache", type=pathlib.Path, default=chitchat.ROOT / "tools" / ".cache" / "chitchat")
    args = ap.parse_args()
    with zipfile.ZipFile(chitchat.fetch_wheel(args.cache)) as z:
        data = json.loads(z.read(chitchat.MEMBER).decode("utf-8"))
    chats = [(cid, m) for cid, c in data.items() if (m := chitchat.convert(c, False)) is not None]
    replies = [(cid, m["content"]) for cid, ms in chats for m in ms
               if m["role"] == "assistant" and len(m["content"]) <= args.max_chars]
    rng = random.Random(args.seed)
    splits = {"train": [], "heldout": []}
    for cid, messages in chats:
        for k, m in enumerate(messages):
            if m["role"] != "assistant" or len(m["content"]) > args.max_chars:
                continue
            start = max(0, k - args.context)
            if messages[start]["role"] != "user":
                start += 1
            while True:
                other_id, rejected = replies[rng.randrange(len(replies))]
                if other_id != cid:
                    break
            pair = {"id": f"{cid}/{k}", "prompt": messages[start:k], "chosen": m["content"],
                    "rejected": rejected}
            splits["heldout" if heldout(cid, args.heldout_percent) else "train"].append(pair)
    args.output_dir.mkdir(parents=True, exist_ok=True)
    for name in ["train", "heldout"]:
        with open(args.output_dir / f"{name}.jsonl", "w", encoding="utf-8", newline="\n") as f:
            for p in splits[name]:
                f.write(json.dumps(p, ensure_ascii=False) + "\n")
    with open(args.output_dir / "all.jsonl", "w", encoding="utf-8", newline="\n") as f:
        for p in splits["train"] + splits["heldout"]:
            f.write(json.dumps(p, ensure_ascii=False) + "\n")
    n_train, n_held = len(splits["train"]), len(splits["heldout"])
    print(f"{args.output_dir}: {n_train} training pairs, {n_held} held-out pairs from {len(chats)} chats; "
          f"all.jsonl splits with data.split = \"{n_train},{n_held},0\"", file=sys.stderr)


if __name__ == "__main__":
    main()
