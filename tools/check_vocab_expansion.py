#!/usr/bin/env python3
"""Checks `ferrotron convert expand-vocab` against transformers (pinned in requirements.txt).

    tools/.venv/bin/python tools/check_vocab_expansion.py OLD_HF NEW_HF TOKENS_FILE [added|merged]

* tokenizer, added mode: the expanded directory's tokenizer encodes sample texts (each new
  token in context, plus plain text) exactly as
  ``AutoTokenizer.from_pretrained(OLD).add_tokens(tokens)`` does, and its length is the same;
* tokenizer, merged mode: the old BPE merges are the first merges, in order (no old rank
  moves); every token encodes to one id; sample texts decode back to themselves; plain text
  without the new strings encodes as the old tokenizer encodes it;
* weights: every new vocabulary entry's embedding row (and untied lm_head row) is the mean
  of the old rows of the ids the old tokenizer's model splits its string into, every old row
  is unchanged;
* logits: on text of old tokens, the expanded model's logits over the old vocabulary equal the
  old model's (max |diff| printed, must be 0 up to float noise).

Prints one JSON line; exits 1 when a check fails.
"""

import json
import os
import sys

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

PLAIN = "In the beginning God created the heaven and the earth. And the earth was without form."


def merges(model_dir: str) -> list:
    doc = json.load(open(os.path.join(model_dir, "tokenizer.json"), encoding="utf-8"))
    return [m if isinstance(m, str) else " ".join(m) for m in doc["model"]["merges"]]


def tokenizer_ok(old_dir: str, new_dir: str, tokens: list, mode: str) -> bool:
    old_tok = AutoTokenizer.from_pretrained(old_dir)
    new = AutoTokenizer.from_pretrained(new_dir)
    texts = [f"Today {t} is here, {t}{t} again." for t in tokens] + [PLAIN]
    if mode == "added":
        ref = AutoTokenizer.from_pretrained(old_dir)
        ref.add_tokens(tokens)
        return len(new) == len(ref) and all(new.encode(t) == ref.encode(t) for t in texts)
    old_merges = merges(old_dir)
    ok = merges(new_dir)[: len(old_merges)] == old_merges
    ok &= all(len(new.encode(t, add_special_tokens=False)) == 1 for t in tokens)
    ok &= all(new.decode(new.encode(t, add_special_tokens=False)) == t for t in texts)
    return ok and new.encode(PLAIN) == old_tok.encode(PLAIN)


def main() -> None:
    old_dir, new_dir, tokens_file = sys.argv[1:4]
    mode = sys.argv[4] if len(sys.argv) > 4 else "added"
    tokens = [l for l in open(tokens_file, encoding="utf-8").read().split("\n") if l]
    old_tok = AutoTokenizer.from_pretrained(old_dir)
    new = AutoTokenizer.from_pretrained(new_dir)
    tok_ok = tokenizer_ok(old_dir, new_dir, tokens, mode)
    old_m = AutoModelForCausalLM.from_pretrained(old_dir, dtype=torch.float32)
    new_m = AutoModelForCausalLM.from_pretrained(new_dir, dtype=torch.float32)
    v_old = old_m.config.vocab_size
    # Each new entry and the old ids its row averages.
    if mode == "added":
        entries = [(new.convert_tokens_to_ids(t), old_tok.encode(t, add_special_tokens=False))
                   for t in tokens if old_tok.convert_tokens_to_ids(t) in (None, old_tok.unk_token_id)]
    else:
        model = old_tok.backend_tokenizer.model
        entries = [(i, [p.id for p in model.tokenize(new.convert_ids_to_tokens(i))])
                   for i in range(len(old_tok), len(new))]
    rows_ok = True
    tables = [(old_m.get_input_embeddings().weight, new_m.get_input_embeddings().weight)]
    if not old_m.config.tie_word_embeddings:
        tables.append((old_m.get_output_embeddings().weight, new_m.get_output_embeddings().weight))
    for old_w, new_w in tables:
        rows_ok &= torch.equal(old_w, new_w[:v_old])
        for i, pieces in entries:
            want = old_w[pieces].double().mean(0).float()
            rows_ok &= torch.allclose(new_w[i], want, atol=1e-7)
    ids = old_tok(PLAIN, return_tensors="pt").input_ids
    with torch.no_grad():
        diff = (old_m(ids).logits - new_m(ids).logits[..., :v_old]).abs().max().item()
    result = {"mode": mode, "tokenizer_ok": tok_ok, "rows_are_piece_means": bool(rows_ok),
              "new_entries": len(entries), "old_logits_max_abs_diff": diff,
              "vocab_size": [v_old, new_m.config.vocab_size], "tokenizer_len": [len(old_tok), len(new)]}
    print(json.dumps(result))
    sys.exit(0 if tok_ok and rows_ok and diff < 1e-5 else 1)


if __name__ == "__main__":
    main()
