"""Make the quickstart's data with nothing to download: a small English-like corpus (JSONL) and
a byte-level BPE tokenizer trained on it (a local Hugging Face tokenizer directory).

    python3 tools/make_quickstart_corpus.py --output-dir run/
    # -> run/corpus.jsonl          {"text": ...} per line, one document each
    #    run/tokenizer/            for --tokenizer-type PretrainedFromHF --tokenizer-name-or-path
    #    run/corpus_stats.json     documents, tokens, vocabulary, unigram entropy (nats)

The documents come from a small probabilistic grammar with a fixed seed, so the same flags give
the same bytes. They mix stories that repeat their characters, fixed facts (each person always
lives in the same city), arithmetic, counting and the alphabet: a tiny model's loss falls far
below the corpus's unigram token entropy (printed, in nats; the loss of a model that knows only
token frequencies) within a couple of hundred iterations.
"""
import argparse
import json
import math
import os
import random
import shutil
import sys
import tempfile
from collections import Counter
from typing import Iterable, List, Sequence

EOD = "<|endoftext|>"

NAMES = ("Alice Bob Carol Dave Emma Frank Grace Henry Iris Jack Kate Liam Mia Noah Olga Paul "
         "Rosa Sam Tina Umar Vera Will Xena Yuri Zoe").split()
CITIES = ("Paris London Rome Berlin Madrid Lisbon Vienna Prague Oslo Dublin Athens Warsaw "
          "Tokyo Cairo Lima Quito").split()
ANIMALS = "cat dog bird fish horse rabbit mouse fox owl goat duck frog".split()
COLORS = "red blue green yellow black white brown grey".split()
PLACES = "garden park forest river kitchen field house school market".split()
VERBS = "play sleep run sing read swim jump dance eat walk".split()
FOODS = "apples bread cheese soup rice cake fish carrots".split()
NUMBERS = ("zero one two three four five six seven eight nine ten eleven twelve thirteen "
           "fourteen fifteen sixteen seventeen eighteen nineteen twenty").split()
# Facts are fixed for the corpus (not drawn per document): the model can learn them.
HOME = {name: CITIES[i % len(CITIES)] for i, name in enumerate(NAMES)}
PET = {name: ANIMALS[(3 * i) % len(ANIMALS)] for i, name in enumerate(NAMES)}


def _story(rng: random.Random) -> List[str]:
    """A few sentences about one character and their pet: names recur within the document."""
    name, color, place = rng.choice(NAMES), rng.choice(COLORS), rng.choice(PLACES)
    pet = PET[name]
    sentences = [f"{name} has a {color} {pet}.",
                 f"The {color} {pet} likes to {rng.choice(VERBS)} in the {place}."]
    for _ in range(rng.randint(1, 3)):
        sentences.append(rng.choice((
            f"Every day {name} and the {pet} go to the {rng.choice(PLACES)}.",
            f"{name} gives the {pet} some {rng.choice(FOODS)}.",
            f"The {pet} does not like to {rng.choice(VERBS)}.",
            f"{name} lives in {HOME[name]}.",
        )))
    sentences.append(f"{name} loves the {color} {pet}.")
    return sentences


def _facts(rng: random.Random) -> List[str]:
    names = rng.sample(NAMES, rng.randint(2, 4))
    return [f"{name} lives in {HOME[name]} and has a {PET[name]}." for name in names]


def _arithmetic(rng: random.Random) -> List[str]:
    sentences = []
    for _ in range(rng.randint(2, 4)):
        a, b = rng.randint(0, 10), rng.randint(0, 10)
        sentences.append(f"{NUMBERS[a]} plus {NUMBERS[b]} is {NUMBERS[a + b]}.")
    return sentences


def _counting(rng: random.Random) -> List[str]:
    start = rng.randint(0, 12)
    words = NUMBERS[start:start + rng.randint(4, 8)]
    letters = "abcdefghijklmnopqrstuvwxyz"
    first = rng.randint(0, 18)
    return ["Count with me: " + ", ".join(words) + ".",
            "The letters are " + " ".join(letters[first:first + rng.randint(4, 8)]) + "."]


KINDS = (_story, _story, _facts, _arithmetic, _counting)


def generate_documents(num_docs: int, seed: int = 1234) -> List[str]:
    """``num_docs`` documents of 1-3 paragraphs from the grammar; the same seed, the same text."""
    rng = random.Random(seed)
    documents = []
    for _ in range(num_docs):
        parts = [" ".join(rng.choice(KINDS)(rng)) for _ in range(rng.randint(1, 3))]
        documents.append("\n".join(parts))
    return documents


def train_tokenizer(documents: Sequence[str], output_dir: str, vocab_size: int) -> None:
    """Byte-level BPE with EOD as its end-of-sequence token, saved with save_pretrained()."""
    from tokenizers import ByteLevelBPETokenizer
    from transformers import PreTrainedTokenizerFast

    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(documents, vocab_size=vocab_size, special_tokens=[EOD],
                            show_progress=False)
    # eos is what our HuggingFaceTokenizer (and preprocess_data.py --append-eod) use as EOD.
    wrapped = PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer, eos_token=EOD,
                                      clean_up_tokenization_spaces=False)
    wrapped.save_pretrained(output_dir)


def unigram_entropy(token_lists: Iterable[Sequence[int]]) -> float:
    """Entropy (nats) of the token frequency distribution over all documents."""
    counts = Counter()
    for ids in token_lists:
        counts.update(ids)
    total = sum(counts.values())
    return -sum(c / total * math.log(c / total) for c in counts.values())


def _writable_dir(path: str) -> str:
    try:
        os.makedirs(path, exist_ok=True)
        probe = tempfile.NamedTemporaryFile(dir=path, prefix=".probe-")
        probe.close()
    except OSError as exc:
        raise SystemExit(f"error: --output-dir {path} is not a writable directory "
                         f"({exc.strerror or exc}); choose another with --output-dir.")
    return path


def _default_mode(path: str, mode: int) -> None:
    """The permissions a plain open()/mkdir() would give (tempfile's are owner-only)."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path, mode & ~umask)


def make(output_dir: str, num_docs: int, seed: int, vocab_size: int) -> dict:
    """Write corpus.jsonl, tokenizer/ and corpus_stats.json; each appears complete or not at
    all (written under a temporary name, then renamed)."""
    documents = generate_documents(num_docs, seed)
    corpus = os.path.join(output_dir, "corpus.jsonl")
    with tempfile.NamedTemporaryFile("w", dir=output_dir, suffix=".tmp", delete=False,
                                     encoding="utf-8") as f:
        f.writelines(json.dumps({"text": doc}) + "\n" for doc in documents)
    _default_mode(f.name, 0o666)
    os.replace(f.name, corpus)

    tokenizer_dir = os.path.join(output_dir, "tokenizer")
    staging = tempfile.mkdtemp(dir=output_dir, prefix=".tokenizer-")
    train_tokenizer(documents, staging, vocab_size)
    _default_mode(staging, 0o777)
    shutil.rmtree(tokenizer_dir, ignore_errors=True)
    os.replace(staging, tokenizer_dir)

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir, local_files_only=True)
    ids = [doc + [tokenizer.eos_token_id] for doc in tokenizer(documents)["input_ids"]]
    stats = dict(documents=len(documents), tokens=sum(map(len, ids)),
                 vocab_size=len(tokenizer), unigram_entropy_nats=round(unigram_entropy(ids), 4),
                 seed=seed, corpus=corpus, tokenizer=tokenizer_dir)
    with open(os.path.join(output_dir, "corpus_stats.json"), "w") as f:
        json.dump(stats, f, indent=1)
    return stats


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--output-dir", required=True)
    parser.add_argument("--num-docs", type=int, default=6000)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--vocab-size", type=int, default=512,
                        help="BPE vocabulary (>= 257: 256 bytes and the EOD token)")
    args = parser.parse_args(argv)
    if args.num_docs < 1:
        parser.error(f"--num-docs must be at least 1, not {args.num_docs}")
    if args.vocab_size < 257:
        parser.error(f"--vocab-size must be at least 257 (256 bytes + {EOD}), "
                     f"not {args.vocab_size}")
    stats = make(_writable_dir(args.output_dir), args.num_docs, args.seed, args.vocab_size)
    print(f"wrote {stats['documents']} documents ({stats['tokens']} tokens) to "
          f"{stats['corpus']}\nwrote a {stats['vocab_size']}-token byte-level BPE tokenizer to "
          f"{stats['tokenizer']}\nunigram token entropy: {stats['unigram_entropy_nats']:.4f} "
          f"nats (the loss of a model that knows only token frequencies)", flush=True)


if __name__ == "__main__":
    sys.exit(main())
