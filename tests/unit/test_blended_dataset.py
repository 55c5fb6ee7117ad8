"""Blending: Megatron's greedy indices exactly, proportions, sample identity; the dataset builder."""
import numpy as np
import pytest

from megatron.core.datasets import helpers
from megatron.core.datasets.blended_dataset import BlendedDataset
from megatron.core.datasets.builder import build_train_valid_test_datasets
from megatron.core.datasets.config import GPTDatasetConfig
from megatron.core.datasets.gpt_dataset import GPTDataset
from megatron.core.datasets.mock_dataset import MockGPTDataset
from tests.unit.test_gpt_dataset import doc_lengths, write_dataset


def megatron_blending_indices(weights, size):
    """Megatron's helpers.cpp build_blending_indices, line by line (the reference)."""
    current = [0] * len(weights)
    dataset_index, dataset_sample_index = [], []
    for sample_idx in range(size):
        t = max(float(sample_idx), 1.0)
        best, best_error = 0, weights[0] * t - current[0]
        for k in range(1, len(weights)):
            error = weights[k] * t - current[k]
            if error > best_error:
                best, best_error = k, error
        dataset_index.append(best)
        dataset_sample_index.append(current[best])
        current[best] += 1
    return np.array(dataset_index), np.array(dataset_sample_index)


@pytest.mark.parametrize("weights, size, lanes, warmup", [
    ([0.2, 0.3, 0.5], 10_000, 2048, 256),
    ([0.7, 0.1, 0.05, 0.15], 20_000, 64, 256),
    # Without warm-up the guessed chunk starts are often wrong: the repairs must be exact.
    ([1e-4, 0.3, 0.2999, 0.4], 20_000, 64, 1),
    (list(np.random.RandomState(0).dirichlet(np.ones(12))), 20_000, 64, 1),
    ([1.0], 1000, 64, 256),
    ([0.5, 0.5], 7, 2048, 256),
])
def test_blending_indices_equal_megatrons(monkeypatch, weights, size, lanes, warmup):
    monkeypatch.setattr(helpers, "_LANES", lanes)
    monkeypatch.setattr(helpers, "_WARMUP", warmup)
    got_index, got_sample = helpers.build_blending_indices(weights, size)
    want_index, want_sample = megatron_blending_indices(weights, size)
    assert got_index.dtype == np.int16 and got_sample.dtype == np.int64
    assert np.array_equal(got_index, want_index)
    assert np.array_equal(got_sample, want_sample)


def test_blend_proportions_follow_weights():
    datasets = [range(10_000)] * 3
    blend = BlendedDataset(datasets, [2.0, 3.0, 5.0], 10_000)  # normalised to 0.2/0.3/0.5
    assert blend.weights == pytest.approx([0.2, 0.3, 0.5])
    counts = np.bincount(blend.dataset_index, minlength=3)
    assert np.abs(counts / 10_000 - [0.2, 0.3, 0.5]).max() < 0.01
    assert np.abs(counts - [2000, 3000, 5000]).max() <= 1
    # Every prefix of the blend is within one sample of its share.
    onehot = np.eye(3)[blend.dataset_index]
    prefix = np.cumsum(onehot, axis=0)
    steps = np.arange(1, 10_001)[:, None]
    assert np.abs(prefix - steps * np.array([0.2, 0.3, 0.5])).max() <= 1.0


def test_blend_sample_is_the_sub_datasets_sample(tmp_path):
    config = GPTDatasetConfig(seq_length=16, data_path="unused",
                              data_cache_path=str(tmp_path / "cache"))
    weights, size = [0.2, 0.3, 0.5], 300
    parts = []
    for k, n in enumerate(helpers.over_provisioned_sizes(weights, size)):
        prefix = str(tmp_path / f"d{k}")
        indexed = write_dataset(prefix, doc_lengths(seed=k, n=40), first_token=100_000 * k)
        parts.append(GPTDataset(indexed, prefix, (0, 40), n, config))
    blend = BlendedDataset(parts, weights, size)
    seen = [[] for _ in parts]
    for i in range(size):
        k, j = int(blend.dataset_index[i]), int(blend.dataset_sample_index[i])
        text = blend[i]["text"]
        assert np.array_equal(text, parts[k][j]["text"])
        assert (text // 100_000 == k).all()  # token ids say which dataset they came from
        seen[k].append(j)
    assert [s == list(range(len(s))) for s in seen] == [True] * 3  # each in its own order
    assert [len(s) for s in seen] == [60, 90, 150]


def test_over_provisioned_sizes_and_too_small_parts():
    assert helpers.over_provisioned_sizes([0.2, 0.3, 0.5], 10_000) == [2010, 3015, 5025]
    assert helpers.over_provisioned_sizes([0.25, 0.75], 1000) == [252, 754]
    with pytest.raises(ValueError, match="dataset 1 .* has 2999 samples but the blend"):
        BlendedDataset([range(2000), range(2999), range(5000)], [0.2, 0.3, 0.5], 10_000)
    with pytest.raises(ValueError, match="one weight per dataset"):
        BlendedDataset([range(5)], [0.5, 0.5], 3)


def _prefixes(tmp_path):
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    write_dataset(a, doc_lengths(seed=1, n=50))
    write_dataset(b, doc_lengths(seed=2, n=60), first_token=100_000)
    return a, b


def test_builder_blend_with_split(tmp_path):
    a, b = _prefixes(tmp_path)
    config = GPTDatasetConfig(seq_length=16, data_path=f"0.25 {a} 0.75 {b}", split="8,1,1",
                              data_cache_path=str(tmp_path / "cache"))
    train, valid, test = build_train_valid_test_datasets(config, [1000, 20, 0])
    assert test is None
    assert isinstance(train, BlendedDataset) and len(train) == 1000
    assert [p.document_range for p in train.datasets] == [(0, 40), (0, 48)]
    assert [p.description["num_samples"] for p in train.datasets] == [252, 754]
    assert [p.document_range for p in valid.datasets] == [(40, 45), (48, 54)]
    assert [p.description["num_samples"] for p in valid.datasets] == [6, 16]
    assert np.bincount(train.dataset_index).tolist() == [250, 750]
    # Valid samples come only from the valid documents of each prefix.
    first_valid_token_a = int(doc_lengths(seed=1, n=50)[:40].sum())
    for i in range(len(valid)):
        text = valid[i]["text"]
        assert (text >= 100_000).all() or (text >= first_valid_token_a).all()


def test_builder_per_split_paths_single_prefix_and_mock(tmp_path):
    a, b = _prefixes(tmp_path)
    config = GPTDatasetConfig(seq_length=16, train_data_path=a, valid_data_path=f"1 {a} 1 {b}",
                              data_cache_path=str(tmp_path / "cache"))
    train, valid, test = build_train_valid_test_datasets(config, [100, 40, 10])
    assert isinstance(train, GPTDataset) and train.document_range == (0, 50)
    assert train.description["num_samples"] == 100  # a single prefix: no surplus
    assert isinstance(valid, BlendedDataset) and valid.weights == [0.5, 0.5]
    assert [p.document_range for p in valid.datasets] == [(0, 50), (0, 60)]
    assert test is None
    mock = GPTDatasetConfig(seq_length=8, mock=True, vocab_size=50, seed=3)
    train, valid, test = build_train_valid_test_datasets(mock, [5, 2, 0])
    assert isinstance(train, MockGPTDataset) and (len(train), len(valid), test) == (5, 2, None)


def test_empty_split_of_a_blend_part_is_a_clear_error(tmp_path):
    a, b = _prefixes(tmp_path)
    small = str(tmp_path / "small")
    write_dataset(small, [5, 6, 7])
    config = GPTDatasetConfig(seq_length=4, data_path=f"0.5 {a} 0.5 {small}", split="90,10,0",
                              data_cache_path=str(tmp_path / "cache"))
    with pytest.raises(ValueError, match="leaves the valid split of .*small without documents: "
                                         "it has 3 document"):
        build_train_valid_test_datasets(config, [10, 10, 0])


def test_mock_dataset_is_deterministic():
    a = MockGPTDataset(20, 8, 100, seed=5)
    b = MockGPTDataset(20, 8, 100, seed=5)
    c = MockGPTDataset(20, 8, 100, seed=6)
    assert all(np.array_equal(a[i]["text"], b[i]["text"]) for i in range(20))
    assert [a[i]["text"].shape for i in (0, 19)] == [(9,), (9,)]
    assert sum(np.array_equal(a[i]["text"], c[i]["text"]) for i in range(20)) == 0
    tokens = np.concatenate([a[i]["text"] for i in range(20)])
    assert tokens.dtype == np.int64 and tokens.min() >= 0 and tokens.max() < 100
    assert len(np.unique(tokens)) > 50
    assert not np.array_equal(a[0]["text"], MockGPTDataset(20, 8, 100, 5, "valid")[0]["text"])
    with pytest.raises(IndexError):
        a[20]
