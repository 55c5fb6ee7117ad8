"""The classic GPT-2 byte-level BPE in pure Python, with a per-word cache: the method of
Megatron-LLaMA's (and Megatron-LM's) `gpt2_tokenization.py`, written here from the algorithm
(OpenAI's GPT-2 paper and encoder): the benchmark's first peer.

Text is cut by GPT-2's regex; each piece's UTF-8 bytes become printable stand-in characters;
the lowest-ranked adjacent pair in merges.txt is merged everywhere in the word, again and
again; the resulting symbols are looked up in vocab.json. A piece seen before is answered from
the cache.
"""
import json

import regex

PATTERN = regex.compile(
    r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+""")


def byte_characters():
    """Byte -> the printable character GPT-2 uses for it (printable Latin-1 stands for itself;
    the rest move to U+0100 and up, in byte order)."""
    keep = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    moved = [b for b in range(256) if b not in keep]
    table = {b: chr(b) for b in keep}
    table.update({b: chr(0x100 + i) for i, b in enumerate(moved)})
    return [table[b] for b in range(256)]


def merge_pair(symbols, pair):
    """Every non-overlapping occurrence of pair, left to right, joined into one symbol."""
    first, second = pair
    out, i = [], 0
    while i < len(symbols):
        if i + 1 < len(symbols) and symbols[i] == first and symbols[i + 1] == second:
            out.append(first + second)
            i += 2
        else:
            out.append(symbols[i])
            i += 1
    return out


class PythonBPE:
    def __init__(self, vocab_file, merge_file):
        with open(vocab_file, encoding="utf-8") as f:
            self.ids = json.load(f)
        with open(merge_file, encoding="utf-8") as f:
            lines = [line for line in f.read().split("\n")
                     if line and not line.startswith("#version")]
        self.rank = {tuple(line.split(" ")): i for i, line in enumerate(lines)}
        self.chars = byte_characters()
        self.cache = {}

    def word_ids(self, word):
        symbols = list(word)
        while len(symbols) > 1:
            pairs = set(zip(symbols, symbols[1:]))
            best = min(pairs, key=lambda pair: self.rank.get(pair, float("inf")))
            if best not in self.rank:
                break
            symbols = merge_pair(symbols, best)
        return [self.ids[symbol] for symbol in symbols]

    def encode(self, text):
        out = []
        for piece in PATTERN.findall(text):
            ids = self.cache.get(piece)
            if ids is None:
                ids = self.cache[piece] = self.word_ids(
                    "".join(self.chars[b] for b in piece.encode("utf-8")))
            out += ids
        return out
