"""GPTDataset indices: token coverage, epochs, Megatron's arrays, the cache, splits, rank 0 builds."""
import os

import numpy as np
import pytest

from megatron.core.datasets import gpt_dataset, helpers
from megatron.core.datasets.config import (
    GPTDatasetConfig,
    get_split_indices,
    parse_data_path,
    parse_split,
)
from megatron.core.datasets.gpt_dataset import GPTDataset, build_gpt_dataset_indices
from megatron.core.datasets.indexed_dataset import IndexedDataset, IndexedDatasetBuilder
from tests.distributed import run_distributed

SEQ = 16


def write_dataset(prefix, lengths, first_token=0):
    """Documents of the given lengths whose tokens are first_token, first_token + 1, ...: every
    token id says where it came from."""
    builder = IndexedDatasetBuilder(prefix + ".bin", np.int32)
    token = first_token
    for n in lengths:
        builder.add_item(np.arange(token, token + n))
        builder.end_document()
        token += n
    builder.finalize(prefix + ".idx")
    return IndexedDataset(prefix)


def doc_lengths(seed=0, n=50, total=None):
    """n random document lengths >= 1 (summing to ``total`` when given)."""
    rng = np.random.RandomState(seed)
    if total is None:
        return rng.randint(1, 40, size=n)
    return rng.multinomial(total - n, [1.0 / n] * n) + 1


def config(tmp_path, cache="cache", **kw):
    kw.setdefault("seq_length", SEQ)
    return GPTDatasetConfig(data_path="unused", data_cache_path=str(tmp_path / cache), **kw)


def megatron_sample_index(sizes, doc_idx, seq_length, num_samples):
    """Megatron's helpers.cpp build_sample_idx, line by line (the reference)."""
    out = [(0, 0)]
    doc_idx_index, doc_offset = 0, 0
    while len(out) <= num_samples:
        remaining = seq_length + 1
        while remaining != 0:
            doc_length = sizes[doc_idx[doc_idx_index]] - doc_offset
            remaining -= doc_length
            if remaining <= 0:
                doc_offset += remaining + doc_length - 1
                remaining = 0
            else:
                doc_idx_index += 1
                doc_offset = 0
        out.append((doc_idx_index, doc_offset))
    return np.array(out)


def unshuffled(ds):
    """Samples in sample-index order (undoing the shuffle)."""
    inverse = np.empty(len(ds), dtype=np.int64)
    inverse[np.asarray(ds.shuffle_index, dtype=np.int64)] = np.arange(len(ds))
    return [ds[int(j)]["text"] for j in inverse]


def test_one_epoch_covers_every_token_exactly_once(tmp_path):
    k = 40
    lengths = doc_lengths(total=k * SEQ + 1)  # exactly one epoch of k samples, no leftover
    indexed = write_dataset(str(tmp_path / "d"), lengths)
    ds = GPTDataset(indexed, str(tmp_path / "d"), (0, 50), k, config(tmp_path))
    assert len(ds) == k
    samples = [ds[i]["text"] for i in range(k)]
    assert all(s.dtype == np.int64 and s.shape == (SEQ + 1,) for s in samples)
    counts = np.bincount(np.concatenate(samples), minlength=k * SEQ + 1)
    # Each token once, but the k - 1 tokens shared by consecutive samples twice.
    assert sorted(np.bincount(counts)[1:].tolist()) == [k - 1, k * SEQ + 1 - (k - 1)]
    in_order = unshuffled(ds)
    for a, b in zip(in_order, in_order[1:]):
        assert a[-1] == b[0]
    stream = np.concatenate([in_order[0]] + [s[1:] for s in in_order[1:]])
    documents = np.split(np.arange(k * SEQ + 1), np.cumsum(lengths)[:-1])
    assert np.array_equal(stream, np.concatenate([documents[d] for d in ds.document_index]))


def test_arrays_are_megatrons(tmp_path):
    lengths = doc_lengths(seed=1, n=30)
    docs = np.arange(5, 25)
    tokens = lengths[5:25].sum()
    per_epoch = (tokens - 1) // SEQ
    num_samples = 2 * per_epoch - 1  # two epochs, the last one used >= 80%: not separated
    epochs = helpers.num_epochs_needed(tokens, SEQ, num_samples)
    assert epochs == 2 and not helpers.separate_last_epoch(tokens, SEQ, num_samples, epochs)
    doc_idx, sample_idx, shuffle_idx = build_gpt_dataset_indices(lengths, docs, num_samples,
                                                                 SEQ, 7)
    rng = np.random.RandomState(7)  # Megatron's construction, by hand
    expected_docs = np.tile(docs.astype(np.int32), epochs)
    rng.shuffle(expected_docs)
    assert doc_idx.dtype == np.int32 and np.array_equal(doc_idx, expected_docs)
    n = (epochs * tokens - 1) // SEQ
    assert np.array_equal(sample_idx, megatron_sample_index(lengths, doc_idx, SEQ, n))
    expected_shuffle = np.arange(n, dtype=np.uint32)
    rng.shuffle(expected_shuffle)
    assert shuffle_idx.dtype == np.uint32 and np.array_equal(shuffle_idx, expected_shuffle)


def test_sample_index_with_empty_documents_and_boundaries():
    sizes = np.array([0, 5, 3, 0, 0, 9, 1, 0, 16, 2, 4, 0])
    doc_idx = np.arange(len(sizes), dtype=np.int32)
    for seq in (1, 2, 4, 5, 7):
        n = (sizes.sum() - 1) // seq
        got = helpers.build_sample_index(sizes, doc_idx, seq)
        assert np.array_equal(got, megatron_sample_index(sizes, doc_idx, seq, n)), seq


def test_same_seed_same_samples_other_seed_different(tmp_path):
    indexed = write_dataset(str(tmp_path / "d"), doc_lengths())
    a = GPTDataset(indexed, str(tmp_path / "d"), (0, 50), 30, config(tmp_path, "c1"))
    b = GPTDataset(indexed, str(tmp_path / "d"), (0, 50), 30, config(tmp_path, "c2"))
    c = GPTDataset(indexed, str(tmp_path / "d"), (0, 50), 30, config(tmp_path, "c3", seed=99))
    for name in ("document_index", "sample_index", "shuffle_index"):
        assert np.array_equal(getattr(a, name), getattr(b, name))
    assert all(np.array_equal(a[i]["text"], b[i]["text"]) for i in range(len(a)))
    assert not np.array_equal(a.document_index, c.document_index)
    assert not np.array_equal(a.shuffle_index, c.shuffle_index)
    assert sum(np.array_equal(a[i]["text"], c[i]["text"]) for i in range(30)) < 3


def test_cache_is_reused_not_rebuilt(tmp_path, monkeypatch):
    indexed = write_dataset(str(tmp_path / "d"), doc_lengths())
    first = GPTDataset(indexed, str(tmp_path / "d"), (0, 50), 30, config(tmp_path))
    paths = gpt_dataset.index_cache_paths(str(tmp_path / "cache"), first.description)
    assert sorted(os.listdir(tmp_path / "cache")) == sorted(os.path.basename(p)
                                                            for p in paths.values())
    stats = {p: (os.stat(p).st_ino, os.stat(p).st_mtime_ns) for p in paths.values()}
    calls = []
    monkeypatch.setattr(gpt_dataset, "build_gpt_dataset_indices",
                        lambda *a: calls.append(a) or pytest.fail("rebuilt"))
    second = GPTDataset(indexed, str(tmp_path / "d"), (0, 50), 30, config(tmp_path))
    assert calls == []
    assert stats == {p: (os.stat(p).st_ino, os.stat(p).st_mtime_ns) for p in paths.values()}
    assert isinstance(second.sample_index, np.memmap)  # loaded with mmap_mode="r"
    assert all(np.array_equal(first[i]["text"], second[i]["text"]) for i in range(30))


def test_cache_key_changes_with_every_parameter(tmp_path, monkeypatch):
    base = dict(path_prefix="/data/a", split_name="train", document_range=(0, 50),
                num_tokens=1000, num_samples=30, seq_length=SEQ, seed=1)
    changes = dict(path_prefix="/data/b", split_name="valid", document_range=(0, 49),
                   num_tokens=1001, num_samples=31, seq_length=SEQ + 1, seed=2)
    key = lambda d: gpt_dataset.index_cache_paths("c", gpt_dataset.index_cache_description(**d))
    keys = {key(base)["sample_index"]}
    for name, value in changes.items():
        keys.add(key({**base, name: value})["sample_index"])
    assert len(keys) == 1 + len(changes)
    monkeypatch.setattr(helpers, "SEPARATE_LAST_EPOCH_THRESHOLD", 0.5)
    assert key(base)["sample_index"] not in keys
    monkeypatch.undo()
    # A changed parameter builds new files next to the old ones.
    indexed = write_dataset(str(tmp_path / "d"), doc_lengths())
    GPTDataset(indexed, str(tmp_path / "d"), (0, 50), 30, config(tmp_path))
    calls = []
    real = gpt_dataset.build_gpt_dataset_indices
    monkeypatch.setattr(gpt_dataset, "build_gpt_dataset_indices",
                        lambda *a: calls.append(1) or real(*a))
    GPTDataset(indexed, str(tmp_path / "d"), (0, 50), 31, config(tmp_path))
    assert calls == [1] and len(os.listdir(tmp_path / "cache")) == 8


def test_multi_epoch_documents_repeat(tmp_path):
    lengths = doc_lengths(n=20, total=331)  # 3 epochs = 993 tokens = 62 samples exactly
    indexed = write_dataset(str(tmp_path / "d"), lengths)
    ds = GPTDataset(indexed, str(tmp_path / "d"), (0, 20), 57, config(tmp_path))
    assert np.array_equal(np.bincount(ds.document_index, minlength=20), [3] * 20)
    assert len(ds) == 62
    in_order = unshuffled(ds)
    stream = np.concatenate([in_order[0]] + [s[1:] for s in in_order[1:]])
    assert np.array_equal(np.bincount(stream), [3] * 331)  # every token of every doc thrice


@pytest.mark.parametrize("num_samples, separate", [(250, True), (279, True), (280, False),
                                                   (285, False), (300, False), (150, True)])
def test_separate_last_epoch_rule(num_samples, separate):
    # 1001 tokens per epoch, seq 10: 100 samples per epoch; 3 epochs needed for > 200 samples.
    lengths = np.array([100] * 10 + [1])
    docs = np.arange(11)
    epochs = helpers.num_epochs_needed(1001, 10, num_samples)
    assert helpers.separate_last_epoch(1001, 10, num_samples, epochs) is separate
    doc_idx, _, shuffle_idx = build_gpt_dataset_indices(lengths, docs, num_samples, 10, 3)
    if separate:  # the last epoch, and the samples drawn from it, shuffled on their own
        assert np.array_equal(np.sort(doc_idx[-11:]), docs)
        before = ((epochs - 1) * 1001 - 1) // 10
        assert np.array_equal(np.sort(shuffle_idx[:before]), np.arange(before))
        assert shuffle_idx[before:].min() == before
        rng = np.random.RandomState(3)
        first = np.tile(docs.astype(np.int32), epochs - 1)
        rng.shuffle(first)
        assert np.array_equal(doc_idx[:-11], first)
    else:
        rng = np.random.RandomState(3)
        whole = np.tile(docs.astype(np.int32), epochs)
        rng.shuffle(whole)
        assert np.array_equal(doc_idx, whole)


def test_split_indices_match_hand_computed():
    assert get_split_indices(parse_split("98,2,0"), 1000) == [0, 980, 1000, 1000]
    assert get_split_indices(parse_split("98/2/0"), 1000) == [0, 980, 1000, 1000]
    assert get_split_indices(parse_split("969, 30, 1"), 1000) == [0, 969, 999, 1000]
    assert get_split_indices(parse_split("969,30,1"), 10) == [0, 10, 10, 10]
    assert get_split_indices(parse_split("1,1,1"), 10) == [0, 4, 7, 10]  # train absorbs +1
    assert get_split_indices(parse_split("50,30,20"), 7) == [0, 4, 6, 7]
    assert get_split_indices(parse_split("1"), 5) == [0, 5, 5, 5]
    assert parse_split("8,1,1") == [0.8, 0.1, 0.1]
    for bad in ("a,b", "1,2,3,4", "0,0,0", "1,-1"):
        with pytest.raises(ValueError, match="split"):
            parse_split(bad)


def test_data_path_parsing():
    assert parse_data_path("0.3 A 0.7 B") == (["A", "B"], [0.3, 0.7])
    assert parse_data_path(["2", "A", "6", "B"]) == (["A", "B"], [0.25, 0.75])
    assert parse_data_path("/x/prefix_text_document") == (["/x/prefix_text_document"], [1.0])
    for bad in ("0.3 A 0.7", "A B", "0 A 0 B", "-1 A 2 B"):
        with pytest.raises(ValueError, match="data path"):
            parse_data_path(bad)


def test_bad_inputs_fail_clearly(tmp_path):
    indexed = write_dataset(str(tmp_path / "d"), [3, 4])
    with pytest.raises(ValueError, match="outside"):
        GPTDataset(indexed, str(tmp_path / "d"), (0, 3), 1, config(tmp_path))
    with pytest.raises(ValueError, match="num_samples"):
        build_gpt_dataset_indices(np.array([3, 4]), np.arange(2), 0, SEQ, 1)
    with pytest.raises(ValueError, match="exactly one data source"):
        GPTDatasetConfig(seq_length=8)


def test_empty_split_is_found_before_any_index_is_built(tmp_path):
    from megatron.core.datasets.builder import EmptySplitError, build_train_valid_test_datasets
    from megatron.core.datasets.indexed_dataset import IndexedDatasetError

    prefix = str(tmp_path / "d")
    write_dataset(prefix, [20] * 20)
    data = GPTDatasetConfig(seq_length=SEQ, data_path=prefix, split="969, 30, 1",
                            data_cache_path=str(tmp_path / "cache"))
    with pytest.raises(EmptySplitError) as info:
        build_train_valid_test_datasets(data, [8, 8, 8])
    assert str(info.value) == (
        f"--split 969,30,1 leaves the test split of {prefix} without documents: it has 20 "
        f"document(s), split as train 19, valid 1, test 0; pass --split 18,2,0 for this "
        f"corpus, or give it at least 501 documents.")
    assert isinstance(info.value, IndexedDatasetError)  # entry points catch it with those
    assert not (tmp_path / "cache").exists()  # checked before the train split was built
    # No test samples asked: the empty test split is no problem, and the suggested split works.
    assert build_train_valid_test_datasets(data, [8, 8, 0])[2] is None
    suggested = GPTDatasetConfig(seq_length=SEQ, data_path=prefix, split="18,2,0",
                                 data_cache_path=str(tmp_path / "cache"))
    train, valid, test = build_train_valid_test_datasets(suggested, [8, 8, 8])
    assert (train.document_range, valid.document_range, test) == ((0, 18), (18, 20), None)


@pytest.mark.parametrize("split", ["969,30,1", "98,2,0", "1,1,1", "90,9,1", "99999,1,0"])
def test_documents_needed_is_the_fewest(split):
    from megatron.core.datasets.builder import _documents_needed

    weights = parse_split(split)
    for i, weight in enumerate(weights):
        if weight == 0:
            continue
        n = _documents_needed(weights, i)
        bounds = get_split_indices(weights, n)
        assert bounds[i + 1] > bounds[i]  # enough
        fewer = get_split_indices(weights, n - 1) if n > 1 else [0, 0, 0, 0]
        assert fewer[i + 1] == fewer[i]  # and one fewer is not


def _build_on_every_rank(prefix, cache_dir):
    import torch.distributed as dist

    calls = []
    real = gpt_dataset.build_gpt_dataset_indices
    gpt_dataset.build_gpt_dataset_indices = lambda *a: calls.append(1) or real(*a)
    try:
        cfg = GPTDatasetConfig(seq_length=SEQ, data_path=prefix, data_cache_path=cache_dir)
        ds = GPTDataset(IndexedDataset(prefix), prefix, (0, 50), 30, cfg)
    finally:
        gpt_dataset.build_gpt_dataset_indices = real
    return dist.get_rank(), len(calls), [ds[i]["text"].tolist() for i in range(len(ds))]


def _build_into_unwritable_cache(prefix, cache_dir):
    cfg = GPTDatasetConfig(seq_length=SEQ, data_path=prefix, data_cache_path=cache_dir)
    try:
        GPTDataset(IndexedDataset(prefix), prefix, (0, 50), 30, cfg)
    except Exception as exc:  # noqa: BLE001
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def test_rank_zero_builds_then_others_load(tmp_path):
    prefix = str(tmp_path / "d")
    write_dataset(prefix, doc_lengths())
    (r0, calls0, samples0), (r1, calls1, samples1) = run_distributed(
        _build_on_every_rank, world_size=2, prefix=prefix, cache_dir=str(tmp_path / "cache"))
    assert (r0, calls0, r1, calls1) == (0, 1, 1, 0)
    assert samples0 == samples1 and len(samples0) >= 30
    # A second run finds the cache: nobody builds.
    (_, calls0, again), (_, calls1, _) = run_distributed(
        _build_on_every_rank, world_size=2, prefix=prefix, cache_dir=str(tmp_path / "cache"))
    assert (calls0, calls1) == (0, 0) and again == samples0
    # Rank 0 failing to build fails rank 1 too, instead of leaving it waiting.
    (tmp_path / "file").write_text("not a directory")
    got0, got1 = run_distributed(_build_into_unwritable_cache, world_size=2, prefix=prefix,
                                 cache_dir=str(tmp_path / "file" / "cache"))
    assert got0.startswith(("FileExistsError", "NotADirectoryError"))
    assert "rank 0 failed to build the GPT dataset indices" in got1
