"""tools/preprocess_data.py and tools/merge_datasets.py end to end, run as subprocesses.

The tokens are checked against the `tokenizers` BPE the test trains (not our wrapper of it), the
bad-line reports against the line numbers the test planted. The preprocessing runs share one
module fixture and run concurrently: each process pays ~3 s importing torch.
"""
import importlib.util
import json
import os
import random
import re
import subprocess
import sys

import numpy as np
import pytest
from tokenizers import ByteLevelBPETokenizer

from megatron.core.datasets.indexed_dataset import IndexedDataset, IndexedDatasetBuilder

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir, os.pardir))
PREPROCESS = os.path.join(REPO, "tools", "preprocess_data.py")
MERGE = os.path.join(REPO, "tools", "merge_datasets.py")

N_LINES = 2600  # over two 1024-line batches, so bad lines land in different batches/partitions
# Planted bad lines (1-based) -> what the tool must call them.
BAD = {3: "malformed JSON", 5: "missing key 'text'", 6: "empty 'text'", 1500: "malformed JSON",
       2599: "empty 'text'"}
BLANK = {800}


def make_text(rng):
    words = ("the quick brown fox jumps over a lazy dog café naïve 東京 🙂 tab\there "
             "new\nline \"quoted\" back\\slash").split(" ")
    return " ".join(rng.choice(words) for _ in range(rng.randint(1, 40)))


def bad_line(kind, rng):
    if kind == "malformed JSON":
        return '{"text": "unterminated'
    if kind == "missing key 'text'":
        return json.dumps({"title": make_text(rng)})
    return json.dumps({"text": ""})


def write_corpus(path, n_lines, bad, blank=(), seed=0):
    """JSONL with bad lines planted; returns the good documents' texts in order."""
    rng = random.Random(seed)
    good = []
    with open(path, "w", encoding="utf-8") as f:
        for lineno in range(1, n_lines + 1):
            if lineno in bad:
                f.write(bad_line(bad[lineno], rng) + "\n")
            elif lineno in blank:
                f.write("\n")
            else:
                text = make_text(rng)
                good.append(text)
                f.write(json.dumps({"text": text, "id": lineno}, ensure_ascii=lineno % 2 == 0)
                        + "\n")
    return good


def preprocess_cmd(input_path, prefix, *flags):
    return [sys.executable, PREPROCESS, "--input", str(input_path), "--output-prefix",
            str(prefix), *map(str, flags)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Train a small byte-level BPE, write the corpora, run every preprocessing job at once."""
    root = tmp_path_factory.mktemp("preprocess")
    good = write_corpus(root / "corpus.jsonl", N_LINES, BAD, BLANK)
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(good, vocab_size=400, special_tokens=["<|endoftext|>"],
                            show_progress=False)
    bpe.save_model(str(root))
    gpt2 = ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", root / "vocab.json",
            "--merge-file", root / "merges.txt", "--append-eod"]
    # Strict: the first bad line is 1500, in the second partition, after partition 1 is done.
    write_corpus(root / "strict.jsonl", N_LINES, {1500: "missing key 'text'",
                                                  2000: "malformed JSON"})
    with open(root / "keys.jsonl", "w") as f:
        f.write('{"text": "1 2 3", "title": "69999"}\n{"text": "4"}\n'
                '{"text": "5 6", "title": "7 8"}\n')
    jobs = {
        "w1": (root / "corpus.jsonl", *gpt2, "--log-interval", 1000),
        "w2": (root / "corpus.jsonl", *gpt2, "--workers", 2),
        "p3": (root / "corpus.jsonl", *gpt2, "--partitions", 3, "--keep-newlines"),
        "strict": (root / "strict.jsonl", *gpt2, "--strict", "--workers", 2, "--partitions", 2),
        "keys": (root / "keys.jsonl", "--tokenizer-type", "NullTokenizer", "--vocab-size", 70000,
                 "--json-keys", "text", "title"),
    }
    procs = {}
    for name, (input_path, *flags) in jobs.items():
        (root / name).mkdir()
        procs[name] = subprocess.Popen(preprocess_cmd(input_path, root / name / "out", *flags),
                                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    results = {}
    for name, proc in procs.items():
        out, err = proc.communicate(timeout=120)
        results[name] = (proc.returncode, err, root / name)
    return {"root": root, "good": good, "bpe": bpe, "results": results}


def read_bytes(path):
    with open(path, "rb") as f:
        return f.read()


def same_output(dir_a, dir_b):
    return all(read_bytes(dir_a / f"out_text_document{ext}")
               == read_bytes(dir_b / f"out_text_document{ext}") for ext in (".bin", ".idx"))


def warnings(stderr):
    return [line for line in stderr.splitlines() if line.startswith("warning: line")]


def test_tokens_equal_the_tokenizer_per_good_document(runs):
    rc, err, out = runs["results"]["w1"]
    assert rc == 0, err
    assert sorted(os.listdir(out)) == ["out_text_document.bin", "out_text_document.idx",
                                      "out_text_document.tokenizer.json"]
    ds = IndexedDataset(str(out / "out_text_document"))
    bpe = runs["bpe"]
    eod = bpe.token_to_id("<|endoftext|>")
    want = [bpe.encode(text).ids + [eod] for text in runs["good"]]
    assert len(ds) == len(want) == N_LINES - len(BAD) - len(BLANK)
    assert all(got.tolist() == w for got, w in zip(ds, want))
    assert ds.dtype == np.uint16  # vocab of ~400 fits
    assert ds.document_indices.tolist() == list(range(len(want) + 1))  # one sequence per doc


def test_bad_lines_reported_with_exact_line_numbers_and_counted(runs):
    rc, err, _ = runs["results"]["w1"]
    assert [line.split(" (")[0] for line in warnings(err)] == [
        f"warning: line {n}: {kind}" for n, kind in sorted(BAD.items())]
    assert "skipped 5 lines: 2 malformed JSON, 1 missing key 'text', 2 empty 'text'" in err
    assert "ignored 1 blank lines" in err
    assert f"Done: {N_LINES - 6} documents from {N_LINES} lines" in err
    # Progress per 1024-line batch once past each multiple of --log-interval 1000.
    progress = [line for line in err.splitlines() if line.startswith("Processed")]
    assert [line.split(" (")[0] for line in progress] == ["Processed 1020 documents",
                                                           "Processed 2043 documents"]
    assert re.fullmatch(r"Processed 1020 documents \([\d.]+ docs/s, [\d.]+ MB/s\)", progress[0])


def test_two_workers_write_identical_bytes(runs):
    _, _, w1 = runs["results"]["w1"]
    rc, err, w2 = runs["results"]["w2"]
    assert rc == 0, err
    assert same_output(w2, w1)
    assert warnings(err) == warnings(runs["results"]["w1"][1])


def test_three_partitions_equal_one(runs):
    _, _, w1 = runs["results"]["w1"]
    rc, err, p3 = runs["results"]["p3"]
    assert rc == 0, err
    assert sorted(os.listdir(p3)) == ["out_text_document.bin", "out_text_document.idx",
                                     "out_text_document.tokenizer.json"]
    assert same_output(p3, w1)
    assert warnings(err) == warnings(runs["results"]["w1"][1])  # line numbers continue


def test_strict_stops_at_the_first_bad_line_and_leaves_nothing(runs):
    rc, err, out = runs["results"]["strict"]
    assert rc == 1
    assert "error: line 1500: missing key 'text'" in err and "line 2000" not in err
    assert os.listdir(out) == []  # no outputs, no temporaries, no partition directory


def test_multiple_json_keys_stay_aligned(runs):
    rc, err, out = runs["results"]["keys"]
    assert rc == 0, err
    text = IndexedDataset(str(out / "out_text_document"))
    title = IndexedDataset(str(out / "out_title_document"))
    # Line 2 has no title: it is skipped for both keys, so document i is line i in both.
    assert [s.tolist() for s in text] == [[1, 2, 3], [5, 6]]
    assert [s.tolist() for s in title] == [[69999], [7, 8]]
    assert text.dtype == title.dtype == np.int32  # 70001 ids do not fit uint16
    assert "warning: line 2: missing key 'title'" in err


# ---- flag errors: in-process, since they stop before any work -------------------------------


@pytest.fixture(scope="module")
def tool():
    spec = importlib.util.spec_from_file_location("preprocess_data_tool", PREPROCESS)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def flag_error(tool, capsys, argv):
    with pytest.raises(SystemExit) as info:
        tool.main(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1  # one clear line, no usage dump
    return err


def test_missing_input_file(tool, capsys, tmp_path):
    err = flag_error(tool, capsys, ["--input", str(tmp_path / "nope.jsonl"), "--output-prefix",
                                    str(tmp_path / "out"), "--tokenizer-type", "NullTokenizer",
                                    "--vocab-size", "10"])
    assert err.endswith(f"error: --input {tmp_path / 'nope.jsonl'}: no such file")
    assert os.listdir(tmp_path) == []


def test_missing_output_directory(tool, capsys, tmp_path):
    (tmp_path / "in.jsonl").write_text('{"text": "1"}\n')
    err = flag_error(tool, capsys, ["--input", str(tmp_path / "in.jsonl"), "--output-prefix",
                                    str(tmp_path / "no" / "out"), "--tokenizer-type",
                                    "NullTokenizer", "--vocab-size", "10"])
    assert f"directory {tmp_path / 'no'} does not exist" in err
    assert os.listdir(tmp_path) == ["in.jsonl"]


def test_tokenizer_that_cannot_be_built(tool, capsys, tmp_path):
    (tmp_path / "in.jsonl").write_text('{"text": "1"}\n')
    err = flag_error(tool, capsys, ["--input", str(tmp_path / "in.jsonl"), "--output-prefix",
                                    str(tmp_path / "out"), "--tokenizer-type", "GPT2BPETokenizer",
                                    "--vocab-file", str(tmp_path / "vocab.json"),
                                    "--merge-file", str(tmp_path / "merges.txt")])
    assert "cannot build the tokenizer (GPT2BPETokenizer)" in err and "vocab.json" in err
    assert os.listdir(tmp_path) == ["in.jsonl"]


@pytest.mark.parametrize("lines,keys,fragment", [
    (['{"body": "1 2", "id": 3}'] * 2, ["text"],
     "all 2 lines were skipped (2 missing key 'text'); --json-keys is text but the lines have "
     "keys: body id; pass --json-keys with the key(s) holding the text"),
    (['{"body": "1 2"}', "oops"], ["text"],
     "all 2 lines were skipped (1 missing key 'text', 1 malformed JSON); --json-keys is text "
     "but the lines have keys: body; pass --json-keys body"),
    (['{"text": 5}'], ["text"],
     "all 1 lines were skipped (1 non-string 'text'); each line must be a JSON object with a "
     "string under 'text' (see the warnings above)"),
], ids=["other-keys", "one-other-key", "non-string"])
def test_zero_documents_is_an_error_naming_the_keys_seen(tool, capsys, tmp_path, lines, keys,
                                                         fragment):
    (tmp_path / "in.jsonl").write_text("\n".join(lines) + "\n")
    assert tool.main(["--input", str(tmp_path / "in.jsonl"), "--output-prefix",
                      str(tmp_path / "out"), "--tokenizer-type", "NullTokenizer",
                      "--vocab-size", "10", "--json-keys", *keys]) == 1
    errors = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert len(errors) == 1 and errors[0].endswith(f"error: no documents in --input "
                                                   f"{tmp_path / 'in.jsonl'}: {fragment}; "
                                                   f"no output written")
    assert os.listdir(tmp_path) == ["in.jsonl"]


def test_disk_full_at_the_second_key_removes_the_first_keys_output(tool, capsys, tmp_path,
                                                                   monkeypatch):
    import errno

    (tmp_path / "in.jsonl").write_text('{"text": "1 2", "title": "3"}\n' * 5)
    finalize = tool.IndexedDatasetBuilder.finalize
    calls = []

    def fill_the_disk_second(builder, idx_path):
        calls.append(idx_path)
        if len(calls) == 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        finalize(builder, idx_path)

    monkeypatch.setattr(tool.IndexedDatasetBuilder, "finalize", fill_the_disk_second)
    assert tool.main(["--input", str(tmp_path / "in.jsonl"), "--output-prefix",
                      str(tmp_path / "out"), "--tokenizer-type", "NullTokenizer",
                      "--vocab-size", "10", "--json-keys", "text", "title"]) == 1
    assert calls == [str(tmp_path / "out_text_document.idx"),
                     str(tmp_path / "out_title_document.idx")]
    err = capsys.readouterr().err
    assert f"error: no space left on device: writing {tmp_path / 'out'}_*.bin/.idx" in err
    assert os.listdir(tmp_path) == ["in.jsonl"]  # the finished text dataset was removed too


def test_zero_workers(tool, capsys, tmp_path):
    (tmp_path / "in.jsonl").write_text('{"text": "1"}\n')
    err = flag_error(tool, capsys, ["--input", str(tmp_path / "in.jsonl"), "--output-prefix",
                                    str(tmp_path / "out"), "--tokenizer-type", "NullTokenizer",
                                    "--vocab-size", "10", "--workers", "0"])
    assert err.endswith("--workers must be at least 1")


def test_crlf_and_no_final_newline(tool, capsys, tmp_path):
    (tmp_path / "in.jsonl").write_bytes(b'{"text": "1 2"}\r\n\r\n{"text": "3"}')
    assert tool.main(["--input", str(tmp_path / "in.jsonl"), "--output-prefix",
                      str(tmp_path / "out"), "--tokenizer-type", "NullTokenizer",
                      "--vocab-size", "10", "--append-eod"]) == 0
    assert "ignored 1 blank lines" in capsys.readouterr().err
    assert [s.tolist() for s in IndexedDataset(str(tmp_path / "out_text_document"))] == [
        [1, 2, 10], [3, 10]]


def test_partition_bounds_start_at_line_starts(tool, tmp_path):
    lines = [b"a" * n + b"\n" for n in (5, 0, 30, 2, 2, 9)]
    (tmp_path / "in.jsonl").write_bytes(b"".join(lines))
    starts = {sum(map(len, lines[:i])) for i in range(len(lines) + 1)}
    for partitions in range(1, 9):
        bounds = tool.partition_bounds(str(tmp_path / "in.jsonl"), partitions)
        assert len(bounds) == partitions + 1 and bounds == sorted(bounds)
        assert bounds[0] == 0 and bounds[-1] == 54 and set(bounds) <= starts


# ---- merge_datasets ------------------------------------------------------------------------


def build(prefix, docs, dtype=np.uint16):
    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=dtype)
    for doc in docs:
        for sequence in doc:
            builder.add_item(sequence)
        builder.end_document()
    builder.finalize(f"{prefix}.idx")
    return str(prefix)


DOCS = [[[1, 2]], [[3], [4, 5, 6]], [[7]], [[8, 9], [10]], [[11, 12, 13]]]


def run_merge(*args):
    return subprocess.run([sys.executable, MERGE, *map(str, args)], capture_output=True,
                          text=True, timeout=60)


def test_merge_equals_building_at_once(tmp_path):
    parts = tmp_path / "parts"
    parts.mkdir()
    build(parts / "a", DOCS[:2])
    build(parts / "b", [])
    build(parts / "c", DOCS[2:])
    whole = build(tmp_path / "whole", DOCS)
    proc = run_merge("--input", parts, "--output-prefix", tmp_path / "dir_merged")
    assert proc.returncode == 0, proc.stderr
    proc = run_merge("--input", parts / "a", parts / "c", "--output-prefix", tmp_path / "listed")
    assert proc.returncode == 0, proc.stderr
    for merged in ("dir_merged", "listed"):
        for ext in (".bin", ".idx"):
            assert read_bytes(tmp_path / f"{merged}{ext}") == read_bytes(f"{whole}{ext}")


def test_merge_rejects_dtype_mismatch(tmp_path):
    a = build(tmp_path / "a", DOCS[:2])
    b = build(tmp_path / "b", DOCS[2:], dtype=np.int32)
    proc = run_merge("--input", a, b, "--output-prefix", tmp_path / "m")
    assert proc.returncode == 1
    assert f"{b}.idx: dtype int32 differs from this builder's uint16" in proc.stderr
    assert not (tmp_path / "m.bin").exists() and not (tmp_path / "m.bin.tmp").exists()


def test_merge_reports_a_missing_file(tmp_path):
    a = build(tmp_path / "a", DOCS)
    proc = run_merge("--input", a, tmp_path / "b", "--output-prefix", tmp_path / "m")
    assert proc.returncode == 1 and f"{tmp_path / 'b'}.idx: file not found" in proc.stderr


def test_merge_reports_an_unpaired_file_in_the_directory(tmp_path):
    build(tmp_path / "a", DOCS)
    build(tmp_path / "b", DOCS)
    os.remove(tmp_path / "b.bin")
    (tmp_path / "out").mkdir()
    proc = run_merge("--input", tmp_path, "--output-prefix", tmp_path / "out" / "m")
    assert proc.returncode == 1 and f"{tmp_path / 'b'}.bin: file not found" in proc.stderr
    assert os.listdir(tmp_path / "out") == []
