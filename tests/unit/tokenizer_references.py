"""Shared by the tokenizer tests: sample texts, a corpus generator, sentencepiece training,
and the reference GPT-2 BPE (OpenAI's original algorithm, independent of the code under test)."""
import io
import json
import random

import regex
import sentencepiece

# Text that trips tokenizers: whitespace runs, newlines, digits, contractions, many scripts.
SAMPLES = [
    "Hello world",
    "The quick brown fox jumps over the lazy dog.",
    " leading space and trailing space ",
    "multiple   spaces\tand\ttabs",
    "line one\nline two\n\n\nline five\r\nwindows line",
    "digits 0 12 345 6789 3.14159 1,000,000 2024-01-01",
    "contractions: don't, I'll, we've, she's, they're, I'm, he'd, DON'T",
    "unicode: naïve café über Ærøskøbing, Москва, 東京, 한국어, مرحبا, emoji 🚀🔥👍🏽",
    "punctuation!? (brackets) [x] {y} <z> @#$%^&*_+=|\\/~`",
    "",
    " ",
    "\n",
    "a",
    "word" * 40,
]


def make_corpus(n=400, seed=0):
    rng = random.Random(seed)
    words = ("the of and to in is was for on that with as by training model token data "
             "parallel pipeline tensor gradient batch layer attention Megatron GPT LLaMA "
             "naïve café über Москва данные 東京 数据 한국어 🚀 don't I'll we've it's "
             "they're 42 3.14 1999 2,048 x86_64 e-mail (see) [1] \"quoted\"").split()
    corpus = []
    for i in range(n):
        sentence = " ".join(rng.choice(words) for _ in range(rng.randint(3, 16)))
        sentence = sentence[0].upper() + sentence[1:] + rng.choice([".", "!", "?", ";", ""])
        if i % 5 == 0:
            sentence += "\n" + str(rng.randint(0, 10 ** rng.randint(1, 7)))
        if i % 7 == 0:
            sentence = "  " + sentence.replace(" ", "   ", 2) + "\n\n"
        if i % 11 == 0:
            sentence += "\t" + sentence.upper()
        corpus.append(sentence)
    return corpus


def train_sentencepiece(path, corpus, **options):
    model = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(corpus), model_writer=model, minloglevel=2, **options)
    path.write_bytes(model.getvalue())
    return str(path)


def bytes_to_unicode():
    """GPT-2's printable stand-in for each byte (from OpenAI's encoder.py)."""
    bs = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
          + list(range(ord("®"), ord("ÿ") + 1)))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


class PythonGPT2BPE:
    """OpenAI's original GPT-2 encoder (and Megatron's gpt2_tokenization.py): the reference."""

    PATTERN = regex.compile(
        r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+""")

    def __init__(self, vocab_file, merge_file):
        with open(vocab_file, encoding="utf-8") as f:
            self.encoder = json.load(f)
        with open(merge_file, encoding="utf-8") as f:
            lines = [line for line in f.read().split("\n") if line and not line.startswith("#")]
        self.ranks = {tuple(line.split()): rank for rank, line in enumerate(lines)}
        self.byte_encoder = bytes_to_unicode()

    def bpe(self, word):
        word = list(word)
        while len(word) > 1:
            pairs = {(a, b) for a, b in zip(word, word[1:])}
            best = min(pairs, key=lambda pair: self.ranks.get(pair, float("inf")))
            if best not in self.ranks:
                break
            merged, i = [], 0
            while i < len(word):
                if i + 1 < len(word) and (word[i], word[i + 1]) == best:
                    merged.append(word[i] + word[i + 1])
                    i += 2
                else:
                    merged.append(word[i])
                    i += 1
            word = merged
        return word

    def encode(self, text):
        ids = []
        for piece in self.PATTERN.findall(text):
            chars = "".join(self.byte_encoder[b] for b in piece.encode("utf-8"))
            ids.extend(self.encoder[token] for token in self.bpe(chars))
        return ids
