"""tools/make_quickstart_corpus.py: the same bytes for the same seed, structure a model can learn
(fixed facts, correct arithmetic), a tokenizer our PretrainedFromHF loads and that round-trips
the text, and one clear error for an output directory it cannot write."""
import importlib.util
import json
import math
import os
import re
import subprocess
import sys

import pytest

from megatron.training.tokenizer import build_tokenizer

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir, os.pardir))
TOOL = os.path.join(REPO, "tools", "make_quickstart_corpus.py")


def _load_tool():
    spec = importlib.util.spec_from_file_location("make_quickstart_corpus", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


corpus = _load_tool()


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    out = tmp_path_factory.mktemp("corpus")
    return out, corpus.make(str(out), num_docs=300, seed=7, vocab_size=400)


def test_same_seed_same_bytes_other_seed_other_text(made, tmp_path):
    out, stats = made
    again = corpus.make(str(tmp_path), num_docs=300, seed=7, vocab_size=400)
    for name in ("corpus.jsonl", os.path.join("tokenizer", "tokenizer.json")):
        assert (out / name).read_bytes() == (tmp_path / name).read_bytes(), name
    assert again["unigram_entropy_nats"] == stats["unigram_entropy_nats"]
    assert corpus.generate_documents(50, seed=8) != corpus.generate_documents(50, seed=7)


def test_documents_hold_learnable_structure():
    text = " ".join(corpus.generate_documents(2000, seed=1))
    for name, city in corpus.HOME.items():  # every statement of a fact agrees with it
        assert f"{name} lives in {city}" in text
        others = [c for c in corpus.CITIES if c != city]
        assert not any(f"{name} lives in {c}" in text for c in others), name
    sums = re.findall(r"(\w+) plus (\w+) is (\w+)\.", text)
    assert len(sums) > 100
    for a, b, c in sums:
        assert corpus.NUMBERS.index(a) + corpus.NUMBERS.index(b) == corpus.NUMBERS.index(c)


def test_tokenizer_loads_as_pretrained_from_hf_and_round_trips(made):
    out, stats = made
    tokenizer = build_tokenizer("PretrainedFromHF", tokenizer_name_or_path=str(out / "tokenizer"))
    assert tokenizer.vocab_size == stats["vocab_size"] == 400
    assert tokenizer.eod == tokenizer.vocab[corpus.EOD] and tokenizer.eod is not None
    with open(out / "corpus.jsonl") as f:
        documents = [json.loads(line)["text"] for line in f]
    assert len(documents) == stats["documents"] == 300
    ids = tokenizer.tokenize_batch(documents)
    assert all(tokenizer.detokenize(i) == d for i, d in zip(ids, documents))
    assert tokenizer.detokenize(tokenizer.tokenize("Zoe has 3 cats, naïve café 🙂.")) == \
        "Zoe has 3 cats, naïve café 🙂."  # byte level: any text, no unknown token
    assert sum(map(len, ids)) + len(ids) == stats["tokens"]  # + one EOD per document
    # Far from uniform, yet well above zero: frequent words, a real vocabulary.
    assert 3.0 < stats["unigram_entropy_nats"] < 0.9 * math.log(400)


def test_unigram_entropy():
    assert corpus.unigram_entropy([[1, 1, 2, 2]]) == pytest.approx(math.log(2))
    assert corpus.unigram_entropy([[5, 5], [5]]) == 0.0


@pytest.mark.parametrize("case", ["output dir is a file", "vocab too small", "no documents"])
def test_bad_input_fails_with_one_clear_message(tmp_path, case):
    blocker = tmp_path / "file"
    blocker.write_text("")
    argv = {"output dir is a file": ["--output-dir", str(blocker / "run")],
            "vocab too small": ["--output-dir", str(tmp_path / "a"), "--vocab-size", "100"],
            "no documents": ["--output-dir", str(tmp_path / "b"), "--num-docs", "0"]}[case]
    proc = subprocess.run([sys.executable, TOOL] + argv, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode != 0
    expected = {"output dir is a file": "is not a writable directory",
                "vocab too small": "--vocab-size must be at least 257",
                "no documents": "--num-docs must be at least 1"}[case]
    assert expected in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    assert not any((tmp_path / d).exists() for d in ("a", "b"))  # nothing half-written
