"""tools/preprocess_data.py on .jsonl.gz, .jsonl.zst, .parquet, directories and globs.

The reference is the plain JSONL run, itself checked against the `tokenizers` BPE the test
trains; every other format (and mix of formats, --workers, --partitions) must write the same
bytes. Bad lines and rows are checked against the file, line and row the test planted. Runs are
in-process (tool.main) so torch is imported once.
"""
import gzip
import importlib.util
import json
import os
import random

import pytest

pa = pytest.importorskip("pyarrow")  # optional packages: a machine without them skips these
pq = pytest.importorskip("pyarrow.parquet")
zstandard = pytest.importorskip("zstandard")
from tokenizers import ByteLevelBPETokenizer  # noqa: E402

from megatron.core.datasets.indexed_dataset import IndexedDataset  # noqa: E402
from megatron.training.corpus.inputs import InputError, resolve_inputs  # noqa: E402

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir, os.pardir))
PREPROCESS = os.path.join(REPO, "tools", "preprocess_data.py")
N_DOCS = 700
KEYS = ["text", "title"]
NULL = ["--tokenizer-type", "NullTokenizer", "--vocab-size", "100"]


@pytest.fixture(scope="module")
def tool():
    spec = importlib.util.spec_from_file_location("preprocess_data_inputs_tool", PREPROCESS)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def make_text(rng):
    words = ("the quick brown fox café naïve 東京 🙂 tab\there new\nline \"quoted\" "
             "back\\slash \r\n").split(" ")
    return " ".join(rng.choice(words) for _ in range(rng.randint(1, 30)))


def jsonl_bytes(docs):
    return b"".join(json.dumps(doc, ensure_ascii=i % 2 == 0).encode() + b"\n"
                    for i, doc in enumerate(docs))


def write_zst(path, data, frames=2):
    """Several zstd frames, as `cat a.zst b.zst` makes: the reader must go on past the first."""
    cut = [len(data) * i // frames for i in range(frames + 1)]
    with open(path, "wb") as f:
        for a, b in zip(cut, cut[1:]):
            f.write(zstandard.ZstdCompressor().compress(data[a:b]))


def write_parquet(path, docs, row_group_size):
    table = pa.table({"id": [d["id"] for d in docs], "text": [d["text"] for d in docs],
                      "title": [d["title"] for d in docs]})
    pq.write_table(table, path, row_group_size=row_group_size)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("inputs")
    rng = random.Random(0)
    docs = [{"id": i, "text": make_text(rng), "title": make_text(rng)} for i in range(N_DOCS)]
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator([d["text"] for d in docs], vocab_size=300,
                            special_tokens=["<|endoftext|>"], show_progress=False)
    bpe.save_model(str(root))
    (root / "plain.jsonl").write_bytes(jsonl_bytes(docs))
    (root / "all.jsonl.gz").write_bytes(gzip.compress(jsonl_bytes(docs)))
    write_zst(root / "all.jsonl.zst", jsonl_bytes(docs))
    write_parquet(root / "all.parquet", docs, row_group_size=128)
    mixed = root / "mixed"
    (mixed / "02").mkdir(parents=True)
    (mixed / "00.jsonl").write_bytes(jsonl_bytes(docs[:100]))
    (mixed / "01.jsonl.gz").write_bytes(gzip.compress(jsonl_bytes(docs[100:250])))
    write_parquet(mixed / "02" / "part.parquet", docs[250:450], row_group_size=64)
    write_zst(mixed / "03.jsonl.zst", jsonl_bytes(docs[450:600]), frames=3)
    (mixed / "04.json").write_bytes(jsonl_bytes(docs[600:]))
    # Not read: other types, hidden files, Spark's markers.
    (mixed / "README.txt").write_text("not data")
    (mixed / "_SUCCESS").write_text("")
    (mixed / ".hidden.jsonl").write_text('{"text": "never read", "title": "x"}\n')
    flags = ["--json-keys", *KEYS, "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file",
             str(root / "vocab.json"), "--merge-file", str(root / "merges.txt"), "--append-eod"]
    return {"root": root, "docs": docs, "bpe": bpe, "flags": flags}


def preprocess(tool, input_path, prefix, *flags):
    return tool.main(["--input", str(input_path), "--output-prefix", str(prefix),
                      *map(str, flags)])


def output_bytes(prefix):
    return {f"{key}{ext}": open(f"{prefix}_{key}_document{ext}", "rb").read()
            for key in KEYS for ext in (".bin", ".idx")}


@pytest.fixture(scope="module")
def reference(tool, corpus):
    """The plain JSONL run: its tokens are the BPE's, document by document."""
    prefix = corpus["root"] / "reference"
    assert preprocess(tool, corpus["root"] / "plain.jsonl", prefix, *corpus["flags"]) == 0
    bpe = corpus["bpe"]
    eod = bpe.token_to_id("<|endoftext|>")
    for key in KEYS:
        ds = IndexedDataset(f"{prefix}_{key}_document")
        want = [bpe.encode(doc[key]).ids + [eod] for doc in corpus["docs"]]
        assert len(ds) == N_DOCS and [s.tolist() for s in ds] == want
    return output_bytes(prefix)


def test_the_parquet_inputs_have_several_row_groups(corpus):
    assert pq.ParquetFile(corpus["root"] / "all.parquet").num_row_groups == 6
    assert pq.ParquetFile(corpus["root"] / "mixed" / "02" / "part.parquet").num_row_groups == 4


SOURCES = {"gz": "all.jsonl.gz", "zst": "all.jsonl.zst", "parquet": "all.parquet",
           "directory": "mixed", "glob": os.path.join("mixed", "0*")}


@pytest.mark.parametrize("workers", [1, 2])
@pytest.mark.parametrize("source", list(SOURCES))
def test_every_format_writes_the_bytes_of_plain_jsonl(tool, corpus, reference, tmp_path,
                                                      source, workers):
    input_path = corpus["root"] / SOURCES[source]
    assert preprocess(tool, input_path, tmp_path / "out", *corpus["flags"],
                      "--workers", workers) == 0
    assert output_bytes(tmp_path / "out") == reference


def test_partitions_of_a_mixed_directory_equal_one(tool, corpus, reference, tmp_path, capsys):
    assert preprocess(tool, corpus["root"] / "mixed", tmp_path / "out", *corpus["flags"],
                      "--workers", 2, "--partitions", 3) == 0
    assert output_bytes(tmp_path / "out") == reference
    assert sorted(os.listdir(tmp_path)) == [f"out_{k}_document{e}" for k in KEYS
                                            for e in (".bin", ".idx", ".tokenizer.json")]
    assert f"Done: {N_DOCS} documents from 500 lines and 200 rows" in capsys.readouterr().err


# ---- bad lines and rows name the file and the line or row ---------------------------------

def numbers_jsonl(lines):
    return "".join(line + "\n" for line in lines).encode()


@pytest.fixture
def bad_dir(tmp_path):
    """Documents "1".."14" over three files, with a bad line or row in the last two."""
    d = tmp_path / "in"
    d.mkdir()
    (d / "a.jsonl").write_bytes(numbers_jsonl([json.dumps({"text": "1"}),
                                               json.dumps({"text": "2"})]))
    b = [json.dumps({"text": str(n)}) for n in range(3, 10)]
    b[2] = '{"text": "unterminated'  # line 3
    b[5] = json.dumps({"body": "x"})  # line 6
    (d / "b.jsonl.gz").write_bytes(gzip.compress(numbers_jsonl(b)))
    cells = [str(n) for n in range(10, 16)]
    cells[4] = None  # row 5: the first row of row group index 1
    pq.write_table(pa.table({"text": cells}), d / "c.parquet", row_group_size=4)
    return d


@pytest.mark.parametrize("workers", [1, 2])
def test_bad_lines_and_rows_name_file_line_and_row(tool, bad_dir, tmp_path, capsys, workers):
    assert preprocess(tool, bad_dir, tmp_path / "out", *NULL, "--workers", workers) == 0
    err = capsys.readouterr().err
    warnings = [line.split(" (")[0] for line in err.splitlines() if line.startswith("warning")]
    assert warnings == [f"warning: line 3 of {bad_dir / 'b.jsonl.gz'}: malformed JSON",
                        f"warning: line 6 of {bad_dir / 'b.jsonl.gz'}: missing key 'text'",
                        f"warning: row 5 of {bad_dir / 'c.parquet'}"]
    assert (f"warning: row 5 of {bad_dir / 'c.parquet'} (row group index 1): null 'text' "
            f"(an empty cell); skipped") in err
    assert "skipped 3 lines and rows: 1 malformed JSON, 1 missing key 'text', 1 null 'text'" \
        in err
    ds = IndexedDataset(str(tmp_path / "out_text_document"))
    assert [s.tolist() for s in ds] == [[n] for n in (1, 2, 3, 4, 6, 7, 9, 10, 11, 12, 13, 15)]


@pytest.mark.parametrize("name,where", [
    ("b.jsonl.gz", "line 3 of {}: malformed JSON"),
    ("c.parquet", "row 5 of {} (row group index 1): null 'text' (an empty cell)"),
])
def test_strict_stops_at_the_bad_line_or_row_and_leaves_nothing(tool, bad_dir, tmp_path,
                                                                capsys, name, where):
    (tmp_path / "out").mkdir()
    assert preprocess(tool, bad_dir / name, tmp_path / "out" / "x", *NULL, "--strict",
                      "--workers", 2) == 1
    errors = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert len(errors) == 1 and f"error: {where.format(bad_dir / name)}" in errors[0]
    assert errors[0].endswith("; stopping (--strict), no output written")
    assert os.listdir(tmp_path / "out") == []


def test_non_string_parquet_column_cells_are_bad_rows(tool, tmp_path, capsys):
    pq.write_table(pa.table({"text": ["1 2", "3"], "title": [7, None]}), tmp_path / "t.parquet")
    assert preprocess(tool, tmp_path / "t.parquet", tmp_path / "out", *NULL, "--json-keys",
                      "text", "title") == 1
    err = capsys.readouterr().err
    assert f"warning: row 1 of {tmp_path / 't.parquet'} (row group index 0): non-string " \
           f"'title' (a int cell); skipped" in err
    assert "all 2 rows were skipped (1 non-string 'title', 1 null 'title'); each row must " \
           "hold a string in column(s) text and title" in err
    assert os.listdir(tmp_path) == ["t.parquet"]


def test_a_missing_parquet_column_is_an_error_at_start(tool, tmp_path, capsys):
    pq.write_table(pa.table({"id": [1], "content": ["1 2"]}), tmp_path / "t.parquet")
    with pytest.raises(SystemExit) as info:
        preprocess(tool, tmp_path / "t.parquet", tmp_path / "out", *NULL)
    assert info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.endswith(f"error: --json-keys text: {tmp_path / 't.parquet'} has no column "
                        f"'text'; its columns are: id content; pass --json-keys with the "
                        f"column(s) holding the text")
    assert os.listdir(tmp_path) == ["t.parquet"]


# ---- which files --input names, in which order ----------------------------------------------

def test_directories_are_read_recursively_in_path_order(tmp_path):
    for name in ("b/z.parquet", "b-x.jsonl", "a.jsonl.zst", "b/a/y.json.gz", "_tmp/p.jsonl",
                 "b/.h.jsonl", "notes.md", "c.NDJSON", "d.jsonl.zstd"):
        os.makedirs(os.path.dirname(tmp_path / name), exist_ok=True)
        (tmp_path / name).write_text("{}\n")
    files = resolve_inputs(str(tmp_path))
    assert [os.path.relpath(f.path, tmp_path) for f in files] == [
        "a.jsonl.zst", "b/a/y.json.gz", "b/z.parquet", "b-x.jsonl", "c.NDJSON", "d.jsonl.zstd"]
    assert [f.kind for f in files] == ["jsonl.zst", "jsonl.gz", "parquet", "jsonl", "jsonl",
                                       "jsonl.zst"]
    globbed = resolve_inputs(str(tmp_path / "[a-d]*"))  # sorted matches; folder b expanded
    assert [f.path for f in globbed] == [f.path for f in files]
    with pytest.raises(InputError, match="notes.md is not a supported file type"):
        resolve_inputs(str(tmp_path / "n*"))


@pytest.mark.parametrize("spec,fragment", [
    ("nothing-*.jsonl", "the pattern matches no file; give a file, a directory or a glob of"),
    ("empty-dir", "the directory holds no supported file (it has: notes.txt)"),
    ("data.csv", "data.csv is not a supported file type (by its name); supported: JSONL"),
])
def test_inputs_that_name_nothing_to_read(tmp_path, spec, fragment):
    (tmp_path / "empty-dir").mkdir()
    (tmp_path / "empty-dir" / "notes.txt").write_text("x")
    (tmp_path / "data.csv").write_text("a,b\n")
    with pytest.raises(InputError) as info:
        resolve_inputs(str(tmp_path / spec))
    assert str(info.value).startswith(f"--input {tmp_path / spec}: ")
    assert fragment in str(info.value)


def test_a_parquet_file_is_one_task_per_row_group(corpus):
    """The main process sends row group indices, never cells: each worker reads its own."""
    from megatron.training.corpus.inputs import check_parquet
    from megatron.training.corpus.readers import RowGroupTask, TaskReader, plan_partitions

    files = resolve_inputs(str(corpus["root"] / "all.parquet"))
    check_parquet(files, KEYS)
    tasks = list(TaskReader().tasks(plan_partitions(files, 3)[0]))
    assert all(isinstance(t, RowGroupTask) for t in tasks)
    assert [(t.row_group, t.first_row) for t in tasks] == [(i, 1 + 128 * i) for i in range(6)]
