#!/usr/bin/env python3
"""Trains a GPT-2 style byte-level BPE tokenizer on text files with the Hugging Face `tokenizers` package.

    tools/.venv/bin/python tools/train_tokenizer.py                       # the committed KJV tokenizer
    tools/.venv/bin/python tools/train_tokenizer.py --input my.txt --vocab_size 8192 --out data/tokenizers/my-8k

The defaults reproduce data/tokenizers/kjv-bpe-4k/ from data/kjv.txt (the cleaned King James Bible that
`build/engine tools/prepare_data.lua` writes; run that, or `make data`, first).  No network is used.

The tokenizer is GPT-2's recipe: the ByteLevel pre-tokenizer (GPT-2's split regex, no prefix space), a BPE
model over the 256 byte symbols (all of them in the vocabulary, so any byte string can be encoded), the
ByteLevel decoder, and <|endoftext|> as a special token (id 0: special tokens come first).  Training is
deterministic for a given input.  Written to --out:
  tokenizer.json          the whole tokenizer (engine.data.load_tokenizer and tokenizers.Tokenizer.from_file)
  vocab.json, merges.txt  the same BPE model in GPT-2's two-file form
The engine's Lua tokenizer (lua/engine/data/bpe.lua) reads either form and gives the same ids as this package.
"""
import argparse
import os
import sys

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def train(inputs, vocab_size, min_frequency, special_tokens):
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=min_frequency, show_progress=False,
                                  special_tokens=special_tokens,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train(inputs, trainer)
    return tok


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--input", nargs="+", default=[os.path.join(ROOT, "data", "kjv.txt")],
                    help="UTF-8 text file(s) to train on (default: data/kjv.txt)")
    ap.add_argument("--out", default=os.path.join(ROOT, "data", "tokenizers", "kjv-bpe-4k"),
                    help="output folder (default: data/tokenizers/kjv-bpe-4k)")
    ap.add_argument("--vocab_size", type=int, default=4096, help="vocabulary size, special tokens included")
    ap.add_argument("--min_frequency", type=int, default=2, help="a pair must occur this often to be merged")
    ap.add_argument("--special", nargs="*", default=["<|endoftext|>"], help="special tokens (ids 0, 1, ...)")
    a = ap.parse_args()
    for p in a.input:
        if not os.path.isfile(p):
            sys.exit(f"train_tokenizer: {p} does not exist" +
                     (" (run `build/engine tools/prepare_data.lua` or `make data` first)" if p.endswith("kjv.txt")
                      else ""))
    if a.vocab_size < 256 + len(a.special):
        sys.exit(f"train_tokenizer: --vocab_size must be at least 256 + {len(a.special)} special tokens")
    tok = train(a.input, a.vocab_size, a.min_frequency, a.special)
    os.makedirs(a.out, exist_ok=True)
    tok.save(os.path.join(a.out, "tokenizer.json"), pretty=False)
    tok.model.save(a.out)  # vocab.json + merges.txt
    size = sum(os.path.getsize(p) for p in a.input)
    print(f"train_tokenizer: {len(a.input)} file(s), {size} bytes -> {a.out}: vocab {tok.get_vocab_size()}, "
          f"special {a.special} = {[tok.token_to_id(s) for s in a.special]}")


if __name__ == "__main__":
    main()
