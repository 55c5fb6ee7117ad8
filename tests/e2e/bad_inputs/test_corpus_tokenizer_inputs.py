"""Bad inputs of corpus vs tokenizer (the tokenizer sidecar beside each .bin/.idx that
preprocess_data.py and merge_datasets.py write): a corpus made with another tokenizer, ids past
the vocabulary, an unreadable sidecar, a corpus without one (one warning), merging two
tokenizers' corpora. Each case: the exit code, one ``error:`` line saying what is wrong and
the fix, no traceback, no training iteration, and no output left behind."""
import json

import pytest

from megatron.core.datasets.tokenizer_sidecar import read_sidecar, sidecar_path, write_sidecar
from tests.e2e.bad_inputs.harness import assert_clean_error, listing, run, run_torchrun
from tests.e2e.bad_inputs.test_data_inputs import (
    NULL,
    PREPROCESS,
    PRETRAIN,
    TRAIN,
    VOCAB,
    hf_flags,
    write_dataset,
)
from tests.e2e.conftest import load_tool
from tests.e2e.runner import TINY, without


@pytest.fixture(scope="module")
def two_tokenizers(tmp_path_factory):
    """Byte-level BPE tokenizers A (300 tokens) and B (320), trained on different text, and a
    corpus preprocessed with A: its ids are all inside B's vocabulary."""
    make = load_tool("make_quickstart_corpus")
    root = tmp_path_factory.mktemp("two_tokenizers")
    documents = make.generate_documents(200, 1)
    for name, seed, size in (("A", 1, 300), ("B", 2, 320)):
        (root / name).mkdir()
        make.train_tokenizer(make.generate_documents(200, seed), str(root / name), size)
    with open(root / "corpus.jsonl", "w") as f:
        f.writelines(json.dumps({"text": t}) + "\n" for t in documents)
    proc = run(PREPROCESS, ["--input", root / "corpus.jsonl", "--output-prefix", root / "a",
                            *hf_flags(root / "A"), "--append-eod"])
    assert proc.returncode == 0, proc.stderr
    return root, str(root / "a_text_document")


def sidecar_warnings(stderr):
    return [line for line in stderr.splitlines()
            if line.startswith("warning:") and "tokenizer sidecar" in line]


def test_corpus_made_with_another_tokenizer(two_tokenizers):
    root, corpus = two_tokenizers
    assert read_sidecar(corpus)["max_token_id"] < 300  # in B's range: only the sidecar tells
    before = listing(root)
    proc = run(PRETRAIN, TRAIN + hf_flags(root / "B") + ["--data-path", corpus,
                                                        "--split", "90,10,0"])
    assert_clean_error(proc, 2, f"the corpus {corpus} was tokenized with HuggingFaceTokenizer "
                       f"{root / 'A'} (300 tokens", f"this run uses HuggingFaceTokenizer "
                       f"{root / 'B'} (320 tokens", "re-tokenize the corpus with this run's "
                       "tokenizer", "or train with the tokenizer it was made with")
    assert listing(root) == before  # found before any index was built
    # With the tokenizer it was made with it trains, without a warning.
    proc = run(PRETRAIN, TRAIN + hf_flags(root / "A") + ["--data-path", corpus,
                                                        "--split", "90,10,0"])
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert sidecar_warnings(proc.stderr) == []


def test_corpus_made_with_another_tokenizer_under_torchrun(two_tokenizers):
    """Rank 0 reads the sidecars and shares its verdict: one line, not one per rank."""
    root, corpus = two_tokenizers
    proc = run_torchrun(PRETRAIN, TRAIN + hf_flags(root / "B") + [
        "--data-path", corpus, "--split", "90,10,0", "--tensor-model-parallel-size", "2"])
    assert_clean_error(proc, 1, f"the corpus {corpus} was tokenized with", torchrun=True)
    assert "exitcode  : 2" in proc.stderr  # the worker's own code: the input was wrong


def test_sidecar_largest_id_outside_the_vocabulary(tmp_path):
    # The ids of the .bin are in range (the 4 MiB scan would pass): the sidecar is read.
    prefix = write_dataset(tmp_path / "data", 30)
    write_sidecar(prefix, {"type": "NullTokenizer", "source": None, "vocab_size": 1001,
                           "sha256": "0" * 64}, 1000)
    before = listing(tmp_path)
    proc = run(PRETRAIN, TRAIN + NULL + ["--data-path", "0.5", prefix, "0.5", prefix,
                                         "--split", "90,10,0"])
    assert_clean_error(proc, 2, f"the corpus {prefix} holds token ids up to 1000 (says "
                       f"{sidecar_path(prefix)})", f"vocabulary is [0, {VOCAB + 1})",
                       "re-tokenize the corpus")
    assert listing(tmp_path) == before


def test_unreadable_sidecar(tmp_path):
    prefix = write_dataset(tmp_path / "data", 30)
    with open(sidecar_path(prefix), "w") as f:
        f.write('{"format": "megatron-tokenizer-sidecar", "tokeni')
    proc = run(PRETRAIN, TRAIN + NULL + ["--train-data-path", prefix, "--valid-data-path",
                                         prefix])
    assert_clean_error(proc, 2, f"{sidecar_path(prefix)}: not a readable tokenizer sidecar",
                       "re-run tools/preprocess_data.py")


def test_corpus_without_sidecar_trains_after_one_warning(tmp_path):
    made_by_megatron = [write_dataset(tmp_path / f"data{i}", 30 + i) for i in range(2)]
    proc = run(PRETRAIN, TRAIN + NULL + ["--data-path", "0.5", made_by_megatron[0], "0.5",
                                         made_by_megatron[1], "--split", "90,10,0"])
    assert proc.returncode == 0, proc.stderr[-2000:]
    warnings = sidecar_warnings(proc.stderr)
    assert len(warnings) == 1 and warnings[0].startswith(
        "warning: 2 of the 2 data prefixes"), proc.stderr[-2000:]
    proc = run(PRETRAIN, without(TINY, "--train-iters") + ["--train-iters", "1"])  # mock data
    assert proc.returncode == 0 and sidecar_warnings(proc.stderr) == [], proc.stderr[-2000:]


def test_merge_of_two_tokenizers_corpora(two_tokenizers, tmp_path):
    root, corpus = two_tokenizers
    (tmp_path / "in.jsonl").write_text('{"text": "the river"}\n')
    proc = run(PREPROCESS, ["--input", tmp_path / "in.jsonl", "--output-prefix",
                            tmp_path / "b", *hf_flags(root / "B")])
    assert proc.returncode == 0, proc.stderr
    other = str(tmp_path / "b_text_document")
    (tmp_path / "out").mkdir()
    proc = run("tools/merge_datasets.py", ["--input", corpus, other, "--output-prefix",
                                           tmp_path / "out" / "all"])
    assert_clean_error(proc, 1, "refusing to merge corpora made with different tokenizers",
                       f"{corpus} was tokenized with", f"{other} with",
                       "re-tokenize one of them")
    assert listing(tmp_path / "out") == {}
