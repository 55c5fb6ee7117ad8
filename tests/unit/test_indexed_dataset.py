"""The .bin/.idx dataset: round trips, byte-exact Megatron format, zero-copy reads, and one test
per corruption the reader must reject with a message naming the file."""
import os
import pickle
import struct

import numpy as np
import pytest
import torch

from megatron.core.datasets.indexed_dataset import (
    DTYPE_CODES,
    IndexedDataset,
    IndexedDatasetBuilder,
    IndexedDatasetError,
    best_fitting_dtype,
    data_file_path,
    index_file_path,
)

# Three documents: [[1,2,3]], [[4],[5,6]] (two sequences), [[7,8,9,10]].
SEQUENCES = [[1, 2, 3], [4], [5, 6], [7, 8, 9, 10]]
DOC_INDICES = [0, 1, 3, 4]


def write_raw(prefix, sequences=SEQUENCES, doc_indices=DOC_INDICES, *, magic=b"MMIDIDX\x00\x00",
              version=1, code=8, fmt="H", lengths=None, pointers=None, n_seq=None, n_doc=None,
              idx_cut=0, idx_extra=b"", bin_extra=b"", bin_cut=0):
    """Assemble a dataset byte by byte from the format description, with hooks to corrupt it."""
    itemsize = struct.calcsize(fmt)
    lengths = [len(s) for s in sequences] if lengths is None else lengths
    if pointers is None:
        pointers = [sum(lengths[:i]) * itemsize for i in range(len(lengths))]
    idx = magic + struct.pack("<Q", version) + struct.pack("<B", code)
    idx += struct.pack("<Q", len(lengths) if n_seq is None else n_seq)
    idx += struct.pack("<Q", len(doc_indices) if n_doc is None else n_doc)
    idx += b"".join(struct.pack("<i", n) for n in lengths)
    idx += b"".join(struct.pack("<q", p) for p in pointers)
    idx += b"".join(struct.pack("<q", d) for d in doc_indices)
    data = b"".join(struct.pack(f"<{len(s)}{fmt}", *s) for s in sequences)
    with open(prefix + ".idx", "wb") as f:
        f.write(idx[:len(idx) - idx_cut] + idx_extra)
    with open(prefix + ".bin", "wb") as f:
        f.write(data[:len(data) - bin_cut] + bin_extra)
    return prefix


def build(prefix, dtype=np.uint16):
    """The same three documents through our builder, using each way of adding data."""
    builder = IndexedDatasetBuilder(data_file_path(prefix), dtype=dtype)
    builder.add_item([1, 2, 3])
    builder.end_document()
    builder.add_document([[4], [5, 6]], lengths=[1, 2])
    builder.add_item(torch.tensor([7, 8, 9, 10]))
    builder.end_document()
    builder.finalize(index_file_path(prefix))
    return prefix


def read_bytes(path):
    with open(path, "rb") as f:
        return f.read()


@pytest.mark.parametrize("code", sorted(DTYPE_CODES))
def test_round_trip_every_dtype(tmp_path, code):
    dtype = DTYPE_CODES[code]
    prefix = build(str(tmp_path / "ds"), dtype=dtype)
    ds = IndexedDataset(prefix)
    assert ds.dtype == dtype and len(ds) == 4
    for got, want in zip(ds, SEQUENCES):
        assert got.dtype == dtype and got.tolist() == want
    assert ds.sequence_lengths.tolist() == [3, 1, 2, 4]
    assert ds.sequence_pointers.tolist() == [0, 3 * dtype.itemsize, 4 * dtype.itemsize,
                                             6 * dtype.itemsize]
    assert ds.document_indices.tolist() == DOC_INDICES
    assert read_bytes(index_file_path(prefix))[9 + 8] == code  # dtype code byte


def test_hand_assembled_bytes_read_and_builder_writes_the_same(tmp_path):
    raw = write_raw(str(tmp_path / "raw"))
    ds = IndexedDataset(raw)
    assert [s.tolist() for s in ds] == SEQUENCES
    assert ds.document_indices.tolist() == DOC_INDICES
    ours = build(str(tmp_path / "ours"))
    assert read_bytes(ours + ".bin") == read_bytes(raw + ".bin")
    assert read_bytes(ours + ".idx") == read_bytes(raw + ".idx")


def test_int32_bytes_match_too(tmp_path):
    raw = write_raw(str(tmp_path / "raw"), code=4, fmt="i")
    ours = build(str(tmp_path / "ours"), dtype=np.int32)
    assert read_bytes(ours + ".idx") == read_bytes(raw + ".idx")
    assert read_bytes(ours + ".bin") == read_bytes(raw + ".bin")


def test_add_documents_equals_item_by_item(tmp_path):
    docs = [[3, 1], [4, 1, 5], [], [9]]
    one = IndexedDatasetBuilder(str(tmp_path / "one.bin"), dtype=np.int32)
    for doc in docs:
        one.add_item(doc)
        one.end_document()
    one.finalize(str(tmp_path / "one.idx"))
    bulk = IndexedDatasetBuilder(str(tmp_path / "bulk.bin"), dtype=np.int32)
    bulk.add_documents(np.array([3, 1, 4, 1, 5, 9]), [2, 3, 0, 1])
    bulk.finalize(str(tmp_path / "bulk.idx"))
    for ext in (".bin", ".idx"):
        assert read_bytes(str(tmp_path / f"bulk{ext}")) == read_bytes(str(tmp_path / f"one{ext}"))


def test_access_slices_negative_and_get(tmp_path):
    ds = IndexedDataset(build(str(tmp_path / "ds")))
    assert [s.tolist() for s in ds[1:3]] == [[4], [5, 6]]
    assert [s.tolist() for s in ds[::2]] == [[1, 2, 3], [5, 6]]
    assert ds[-1].tolist() == [7, 8, 9, 10]
    assert ds.get(3, offset=1).tolist() == [8, 9, 10]
    assert ds.get(3, offset=1, length=2).tolist() == [8, 9]
    with pytest.raises(IndexError, match="sequence 4 out of range"):
        ds[4]
    with pytest.raises(IndexError, match=r"tokens \[2, 5\) out of range for sequence 3"):
        ds.get(3, offset=2, length=3)


def test_reads_are_zero_copy_views_of_the_file(tmp_path):
    prefix = build(str(tmp_path / "ds"))
    ds = IndexedDataset(prefix)
    seq = ds[3]
    assert not seq.flags.owndata and not seq.flags.writeable
    assert not ds.sequence_lengths.flags.owndata
    # Rewrite token 8 in the file: the view we already hold sees it, so it is the page itself.
    with open(prefix + ".bin", "r+b") as f:
        f.seek(int(ds.sequence_pointers[3]) + 2)
        f.write(struct.pack("<H", 500))
    assert seq.tolist() == [7, 500, 9, 10]


def test_pickles_by_reopening(tmp_path):
    ds = IndexedDataset(build(str(tmp_path / "ds")))
    again = pickle.loads(pickle.dumps(ds))
    assert [s.tolist() for s in again] == SEQUENCES


def test_add_index_equals_building_at_once(tmp_path):
    a = build(str(tmp_path / "a"))
    b = write_raw(str(tmp_path / "b"), [[11, 12], [13]], [0, 2])
    merged = IndexedDatasetBuilder(str(tmp_path / "m.bin"), dtype=np.uint16)
    merged.add_index(a)
    merged.add_index(b)
    merged.finalize(str(tmp_path / "m.idx"))
    whole = write_raw(str(tmp_path / "whole"), SEQUENCES + [[11, 12], [13]], DOC_INDICES + [6])
    for ext in (".bin", ".idx"):
        assert read_bytes(str(tmp_path / f"m{ext}")) == read_bytes(whole + ext)


def test_add_index_rejects_a_dtype_mismatch(tmp_path):
    a = build(str(tmp_path / "a"), dtype=np.int32)
    builder = IndexedDatasetBuilder(str(tmp_path / "m.bin"), dtype=np.uint16)
    with pytest.raises(IndexedDatasetError, match=r"a\.idx: dtype int32 differs .* uint16"):
        builder.add_index(a)
    builder.abort()


def test_nothing_looks_complete_before_finalize_and_abort_cleans_up(tmp_path):
    prefix = str(tmp_path / "ds")
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
    builder.add_item([1, 2])
    assert not os.path.exists(prefix + ".bin") and not IndexedDataset.exists(prefix)
    builder.abort()
    assert os.listdir(tmp_path) == []


def test_builder_refuses_ids_the_dtype_would_wrap(tmp_path):
    builder = IndexedDatasetBuilder(str(tmp_path / "ds.bin"), dtype=np.uint16)
    with pytest.raises(ValueError, match=r"token ids in \[0, 70000\] do not fit uint16"):
        builder.add_item(np.array([0, 70000]))
    builder.abort()


def test_failed_finalize_leaves_no_files(tmp_path, monkeypatch):
    # A full disk while the index is written: neither temporary stays, nothing looks complete.
    import errno

    builder = IndexedDatasetBuilder(str(tmp_path / "ds.bin"), dtype=np.uint16)
    builder.add_item(np.arange(10))
    builder.end_document()

    def full_disk(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", full_disk)
    with pytest.raises(OSError, match="No space left"):
        builder.finalize(str(tmp_path / "ds.idx"))
    assert sorted(os.listdir(tmp_path)) == ["ds.bin.tmp"]  # the index's temporary is gone
    builder.abort()
    assert os.listdir(tmp_path) == []


def test_best_fitting_dtype():
    assert best_fitting_dtype(50257) == np.uint16
    assert best_fitting_dtype(65500) == np.int32
    assert best_fitting_dtype(None) == np.int32


# ---- one test per corruption --------------------------------------------------------------


def expect_error(prefix, file_ext, match, **kwargs):
    with pytest.raises(IndexedDatasetError, match=match) as info:
        IndexedDataset(prefix, **kwargs)
    assert str(info.value).startswith(prefix + file_ext)


def test_missing_index_file(tmp_path):
    prefix = write_raw(str(tmp_path / "ds"))
    os.remove(prefix + ".idx")
    expect_error(prefix, ".idx", "file not found")


def test_missing_data_file(tmp_path):
    prefix = write_raw(str(tmp_path / "ds"))
    os.remove(prefix + ".bin")
    expect_error(prefix, ".bin", "file not found")


def test_wrong_magic(tmp_path):
    prefix = write_raw(str(tmp_path / "ds"), magic=b"TNTIDX\x00\x00\x00")
    expect_error(prefix, ".idx", "not a Megatron indexed dataset index")


def test_wrong_version(tmp_path):
    expect_error(write_raw(str(tmp_path / "ds"), version=2), ".idx", "unsupported index version 2")


def test_unknown_dtype_code(tmp_path):
    expect_error(write_raw(str(tmp_path / "ds"), code=9), ".idx", "unknown dtype code 9")


def test_index_shorter_than_header(tmp_path):
    prefix = write_raw(str(tmp_path / "ds"))
    with open(prefix + ".idx", "r+b") as f:
        f.truncate(20)
    expect_error(prefix, ".idx", "index file truncated or damaged: 20 bytes, shorter than the "
                 "34-byte header; re-run tools/preprocess_data.py")


def test_index_truncated(tmp_path):
    # 4 sequences and 4 document indices need 34 + 12*4 + 8*4 = 114 bytes.
    prefix = write_raw(str(tmp_path / "ds"), idx_cut=8)
    expect_error(prefix, ".idx", "index file truncated or damaged: 106 bytes, but its header's "
                 "4 sequences and 4 document indices need 114; re-run "
                 "tools/preprocess_data.py to rewrite the .bin/.idx pair")


def test_index_count_larger_than_data(tmp_path):
    prefix = write_raw(str(tmp_path / "ds"), n_seq=1000)
    expect_error(prefix, ".idx", "index file truncated or damaged: .* 1000 sequences")


def test_index_with_extra_bytes(tmp_path):
    prefix = write_raw(str(tmp_path / "ds"), idx_extra=b"\x00" * 3)
    expect_error(prefix, ".idx", "index file damaged: 3 unexpected bytes after the "
                 "document indices.*re-run tools/preprocess_data.py")


def test_data_file_truncated(tmp_path):
    prefix = write_raw(str(tmp_path / "ds"), bin_cut=2)
    expect_error(prefix, ".bin", "data file truncated: 18 bytes, but .* describes 20 .*; re-run "
                 r"tools/preprocess_data.py to rewrite the .bin/.idx pair$")


def test_data_file_of_another_dtype_than_its_index(tmp_path):
    # The .idx says uint16 (code 8) but the .bin holds the same 10 tokens as int32: the pair
    # comes from two runs. Named as such, not as a mere truncation.
    prefix = write_raw(str(tmp_path / "ds"), code=8, fmt="H")
    tokens = np.fromfile(prefix + ".bin", dtype=np.uint16)
    tokens.astype(np.int32).tofile(prefix + ".bin")
    expect_error(prefix, ".bin", r"holds 40 bytes, exactly 10 tokens of int32, but .*ds\.idx says "
                 r"its tokens are uint16 \(20 bytes\): the .bin and .idx come from different runs; "
                 r"re-run tools/preprocess_data.py")


def test_data_file_longer_than_index(tmp_path):
    prefix = write_raw(str(tmp_path / "ds"), bin_extra=b"\x00\x00")
    expect_error(prefix, ".bin", "data file longer than its index: 22 bytes, but .* describes 20")


def test_pointer_inconsistent_with_lengths(tmp_path):
    prefix = write_raw(str(tmp_path / "ds"), pointers=[0, 6, 10, 12])  # 3rd should be 8
    expect_error(prefix, ".idx", "sequence 2 starts at byte 10, but the lengths before it put "
                 "it at byte 8; the index is corrupt: re-run tools/preprocess_data.py")


def test_pointer_past_the_end(tmp_path):
    prefix = write_raw(str(tmp_path / "ds"), pointers=[0, 6, 8, 4000])
    expect_error(prefix, ".idx", r"sequence 3 starts at byte 4000, .* past the end of .*ds\.bin "
                 r"\(20 bytes\)")


def test_negative_length(tmp_path):
    prefix = write_raw(str(tmp_path / "ds"), lengths=[3, 1, -2, 4])
    expect_error(prefix, ".idx", "sequence 2 has negative length -2")


def test_document_indices_decreasing(tmp_path):
    prefix = write_raw(str(tmp_path / "ds"), doc_indices=[0, 3, 1, 4])
    expect_error(prefix, ".idx", "must be non-decreasing, but entry 2 is 1 after 3")


def test_document_indices_past_sequence_count(tmp_path):
    prefix = write_raw(str(tmp_path / "ds"), doc_indices=[0, 1, 3, 5])
    expect_error(prefix, ".idx", "document index entry 3 is 5, past the sequence count 4")


def test_document_indices_not_starting_at_zero(tmp_path):
    prefix = write_raw(str(tmp_path / "ds"), doc_indices=[1, 3, 4])
    expect_error(prefix, ".idx", "document indices must start at 0, found 1")


def test_token_id_at_or_above_vocab_size(tmp_path):
    prefix = write_raw(str(tmp_path / "ds"))
    IndexedDataset(prefix, vocab_size=11)  # ids go up to 10: fits
    expect_error(prefix, ".bin", r"token id 10 at sequence 3, position 3 is outside the "
                 r"vocabulary \[0, 10\)", vocab_size=10)


def test_negative_token_id(tmp_path):
    prefix = write_raw(str(tmp_path / "ds"), [[1, 2], [3, -7, 4]], [0, 2], code=4, fmt="i")
    expect_error(prefix, ".bin", r"token id -7 at sequence 1, position 1 is outside",
                 vocab_size=100)
