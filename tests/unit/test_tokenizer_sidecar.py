"""The tokenizer sidecar (``<prefix>.tokenizer.json``) that tools/preprocess_data.py and
tools/merge_datasets.py write beside a .bin/.idx pair, and the start check that reads it
(megatron/training/data/corpus_tokenizer.py).

References: the fingerprint is recomputed from the vocab.json the test trained (not through our
tokenizer wrapper), the largest id and the .idx bytes from the `tokenizers` BPE's own ids laid
out by Megatron's index format, written here with struct."""
import hashlib
import json
import os
import struct
import subprocess
import sys

import numpy as np
import pytest
from tokenizers import ByteLevelBPETokenizer

from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder, IndexedDatasetError
from megatron.core.datasets.tokenizer_sidecar import read_sidecar, sidecar_path, write_sidecar
from megatron.training.data.corpus_tokenizer import corpus_verdict, data_prefixes

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir, os.pardir))
PREPROCESS = os.path.join(REPO, "tools", "preprocess_data.py")
MERGE = os.path.join(REPO, "tools", "merge_datasets.py")
EOD = "<|endoftext|>"


def texts(seed, n=60):
    rng = np.random.default_rng(seed)
    words = ["alpha", "beta", "gamma", "delta", "river", "stone", "forty", "two", "café", "東京"]
    return [" ".join(rng.choice(words, rng.integers(1, 12))) for _ in range(n)]


def train_bpe(directory, documents, vocab_size):
    os.makedirs(directory)
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(documents, vocab_size=vocab_size, special_tokens=[EOD],
                            show_progress=False)
    bpe.save_model(str(directory))
    return bpe


def gpt2_flags(directory):
    return ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", str(directory / "vocab.json"),
            "--merge-file", str(directory / "merges.txt"), "--append-eod"]


def reference_sha256(directory):
    """sha256 of the sorted (token, id) pairs of the vocab.json on disk."""
    with open(directory / "vocab.json", encoding="utf-8") as f:
        vocab = json.load(f)
    pairs = sorted((token, int(i)) for token, i in vocab.items())
    return hashlib.sha256(json.dumps(pairs, ensure_ascii=False).encode("utf-8")).hexdigest(), \
        len(vocab)


def megatron_idx(documents_ids):
    """Megatron's .idx for one single-sequence document per entry, uint16 tokens."""
    lengths = np.array([len(d) for d in documents_ids], np.int32)
    pointers = np.concatenate(([0], np.cumsum(lengths[:-1].astype(np.int64) * 2)))
    docs = np.arange(len(lengths) + 1, dtype=np.int64)
    return (struct.pack("<9sQBQQ", b"MMIDIDX\x00\x00", 1, 8, len(lengths), len(docs))
            + lengths.tobytes() + pointers.astype(np.int64).tobytes() + docs.tobytes())


def run_tool(tool, *argv):
    return subprocess.Popen([sys.executable, tool, *map(str, argv)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


@pytest.fixture(scope="module")
def corpora(tmp_path_factory):
    """Tokenizers A and B (different vocabularies), and preprocess runs, all at once: corpus 1
    with A, corpus 2 with A in two partitions, corpus 1 with B."""
    root = tmp_path_factory.mktemp("sidecar")
    docs = {1: texts(1), 2: texts(2)}
    bpe = {"A": train_bpe(root / "A", docs[1] + docs[2], 300),
           "B": train_bpe(root / "B", texts(3) + docs[1], 320)}
    for i, documents in docs.items():
        with open(root / f"c{i}.jsonl", "w") as f:
            f.writelines(json.dumps({"text": t}) + "\n" for t in documents)
    jobs = {"A1": (1, "A", []), "A2": (2, "A", ["--partitions", "2"]), "B1": (1, "B", [])}
    procs = {name: run_tool(PREPROCESS, "--input", root / f"c{i}.jsonl", "--output-prefix",
                            root / name, *gpt2_flags(root / tok), *extra)
             for name, (i, tok, extra) in jobs.items()}
    for name, proc in procs.items():
        _, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err
    ids = {name: [bpe[tok].encode(t).ids + [bpe[tok].token_to_id(EOD)] for t in docs[i]]
           for name, (i, tok, _) in jobs.items()}
    return root, ids


def prefix(root, name):
    return str(root / f"{name}_text_document")


@pytest.mark.parametrize("name", ["A1", "A2", "B1"])
def test_preprocess_writes_the_tokenizer_and_largest_id(corpora, name):
    root, ids = corpora
    sidecar = read_sidecar(prefix(root, name))
    sha, size = reference_sha256(root / name[0])
    assert sidecar["tokenizer"]["sha256"] == sha
    assert sidecar["tokenizer"]["vocab_size"] == size
    assert sidecar["tokenizer"]["type"] == "GPT2BPETokenizer"
    assert sidecar["max_token_id"] == max(max(d) for d in ids[name])
    assert not [f for f in os.listdir(root) if ".tmp" in f]  # written atomically


@pytest.mark.parametrize("name", ["A1", "A2"])
def test_idx_stays_megatrons_format_byte_for_byte(corpora, name):
    root, ids = corpora
    with open(prefix(root, name) + ".idx", "rb") as f:
        assert f.read() == megatron_idx(ids[name])
    tokens = np.fromfile(prefix(root, name) + ".bin", np.uint16)
    assert tokens.tolist() == [t for d in ids[name] for t in d]


def test_merge_records_the_largest_of_the_largest_ids(corpora, tmp_path):
    root, ids = corpora
    proc = run_tool(MERGE, "--input", prefix(root, "A1"), prefix(root, "A2"),
                    "--output-prefix", tmp_path / "m")
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    merged = read_sidecar(str(tmp_path / "m"))
    assert merged["tokenizer"] == read_sidecar(prefix(root, "A1"))["tokenizer"]
    assert merged["max_token_id"] == max(max(d) for d in ids["A1"] + ids["A2"])
    assert "note:" not in err


def test_merge_refuses_two_tokenizers_and_writes_nothing(corpora, tmp_path):
    root, _ = corpora
    proc = run_tool(MERGE, "--input", prefix(root, "A1"), prefix(root, "B1"),
                    "--output-prefix", tmp_path / "m")
    _, err = proc.communicate(timeout=60)
    lines = [line for line in err.splitlines() if "error:" in line]
    assert proc.returncode == 1 and len(lines) == 1, err
    assert "refusing to merge corpora made with different tokenizers" in lines[0]
    assert prefix(root, "A1") in lines[0] and prefix(root, "B1") in lines[0]
    assert os.listdir(tmp_path) == []


def test_merge_without_sidecars_writes_none_and_says_so_once(tmp_path):
    parts = []
    for i in range(2):
        builder = IndexedDatasetBuilder(str(tmp_path / f"p{i}.bin"), dtype=np.uint16)
        builder.add_documents(np.arange(5 + i), [5 + i])
        builder.finalize(str(tmp_path / f"p{i}.idx"))
        parts.append(str(tmp_path / f"p{i}"))
    write_sidecar(str(tmp_path / "m"), {"sha256": "stale"}, 3)  # a previous output's
    proc = run_tool(MERGE, "--input", *parts, "--output-prefix", tmp_path / "m")
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert not os.path.exists(sidecar_path(str(tmp_path / "m")))
    notes = [line for line in err.splitlines() if line.startswith("note:")]
    assert len(notes) == 1 and "2 of the 2 inputs have no tokenizer sidecar" in notes[0], err


# ---- the start check -----------------------------------------------------------------------

FP_A = {"type": "GPT2BPETokenizer", "source": "a/vocab.json", "vocab_size": 300, "sha256": "a" * 64}
FP_B = {"type": "GPT2BPETokenizer", "source": "b/vocab.json", "vocab_size": 320, "sha256": "b" * 64}


def corpus(tmp_path, name, fp=None, largest=10):
    path = str(tmp_path / name)
    if fp is not None:
        write_sidecar(path, fp, largest)
    return path


def test_verdict_same_tokenizer_in_range_vouches_for_the_corpus(tmp_path):
    verdict = corpus_verdict([corpus(tmp_path, "a", FP_A, 299)], FP_A, 300)
    assert verdict.problem is None and verdict.warning is None
    assert verdict.checked == [str(tmp_path / "a")]


def test_verdict_other_tokenizer_names_both_and_the_fix(tmp_path):
    verdict = corpus_verdict([corpus(tmp_path, "a", FP_A)], FP_B, 320)
    assert f"the corpus {tmp_path / 'a'} was tokenized with GPT2BPETokenizer a/vocab.json " \
           "(300 tokens, vocabulary sha256 aaaaaaaaaaaa)" in verdict.problem
    assert "this run uses GPT2BPETokenizer b/vocab.json (320 tokens" in verdict.problem
    assert "re-tokenize the corpus with this run's tokenizer" in verdict.problem


def test_verdict_largest_id_outside_the_vocabulary(tmp_path):
    verdict = corpus_verdict([corpus(tmp_path, "a", FP_A, 300)], FP_A, 300)
    assert "holds token ids up to 300" in verdict.problem and "[0, 300)" in verdict.problem


def test_verdict_null_tokenizer_checks_only_the_range(tmp_path):
    null = {"type": "NullTokenizer", "source": None, "vocab_size": 65, "sha256": "c" * 64}
    assert corpus_verdict([corpus(tmp_path, "a", FP_A, 64)], null, 65).problem is None
    assert "up to 65" in corpus_verdict([corpus(tmp_path, "b", FP_A, 65)], null, 65).problem


def test_verdict_counts_prefixes_without_sidecar_in_one_warning(tmp_path):
    prefixes = [corpus(tmp_path, "a", FP_A), corpus(tmp_path, "b"), corpus(tmp_path, "c")]
    verdict = corpus_verdict(prefixes, FP_A, 300)
    assert verdict.problem is None and verdict.checked == [str(tmp_path / "a")]
    assert verdict.warning.startswith("warning: 2 of the 3 data prefixes")
    assert "\n" not in verdict.warning


def test_unreadable_sidecar_names_the_file(tmp_path):
    with open(sidecar_path(str(tmp_path / "a")), "w") as f:
        f.write("{not json")
    with pytest.raises(IndexedDatasetError, match="a.tokenizer.json: not a readable"):
        corpus_verdict([str(tmp_path / "a")], FP_A, 300)


def test_data_prefixes_of_every_data_flag(tmp_path):
    class Args:
        mock_data = False
        data_path = ["0.3", "x", "0.7", "y"]
        train_data_path, valid_data_path, test_data_path = ["t"], ["v"], ["x"]

    assert data_prefixes(Args) == ["x", "y", "t", "v"]
    Args.mock_data = True
    assert data_prefixes(Args) == []
