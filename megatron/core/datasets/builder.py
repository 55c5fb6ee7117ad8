"""Train/valid/test datasets from a GPTDatasetConfig: mock, split blend, or per-split blends."""
from typing import Dict, List, Optional, Sequence, Tuple

from megatron.core.datasets.blended_dataset import BlendedDataset
from megatron.core.datasets.config import (
    SPLIT_NAMES,
    GPTDatasetConfig,
    get_split_indices,
)
from megatron.core.datasets.gpt_dataset import GPTDataset
from megatron.core.datasets.helpers import over_provisioned_sizes
from megatron.core.datasets.mock_dataset import MockGPTDataset


def build_train_valid_test_datasets(config: GPTDatasetConfig,
                                    train_valid_test_num_samples: Sequence[int]) -> Tuple:
    """(train, valid, test) datasets with at least the requested numbers of samples.

    A split that gets no samples or no documents is None. With ``config.data_path`` every
    prefix's documents are cut by ``config.split``; with per-split paths each split uses all
    documents of its own prefixes. A blend of several prefixes is a BlendedDataset over
    GPTDatasets built with Megatron's 0.5% surplus; a single prefix is a plain GPTDataset.

    Collective in a distributed run: every rank calls it with the same config (rank 0 builds
    the index caches, the others load them).
    """
    if len(train_valid_test_num_samples) != 3:
        raise ValueError(f"need sample counts for train, valid and test, got "
                         f"{list(train_valid_test_num_samples)}.")
    counts = [int(n) for n in train_valid_test_num_samples]
    if any(n < 0 for n in counts):
        raise ValueError(f"sample counts must be >= 0, got {counts}.")
    if config.mock:
        return tuple(MockGPTDataset(n, config.seq_length, config.vocab_size, config.seed, name)
                     if n > 0 else None for n, name in zip(counts, SPLIT_NAMES))
    opened: Dict[str, object] = {}
    datasets: List[Optional[object]] = []
    for i, (name, n) in enumerate(zip(SPLIT_NAMES, counts)):
        blend = config.blend() if config.data_path is not None else config.blend(name)
        if blend is None or n == 0:
            datasets.append(None)
            continue
        prefixes, weights = blend
        ranges = []
        for prefix in prefixes:
            num_docs = len(_open(prefix, opened))
            if config.data_path is not None:
                bounds = get_split_indices(config.split_weights, num_docs)
                ranges.append((bounds[i], bounds[i + 1]))
            else:
                ranges.append((0, num_docs))
        if config.data_path is not None and config.split_weights[i] == 0:
            datasets.append(None)
            continue
        datasets.append(_build_blend(config, prefixes, weights, ranges, n, name, opened))
    return tuple(datasets)


def _open(prefix: str, opened: Dict[str, object]):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    if prefix not in opened:
        opened[prefix] = IndexedDataset(prefix)
    return opened[prefix]


def _build_blend(config, prefixes, weights, ranges, num_samples, split_name, opened):
    kept = [k for k, w in enumerate(weights) if w > 0]
    for k in kept:
        begin, end = ranges[k]
        if end <= begin:
            raise ValueError(
                f"{prefixes[k]} has no documents in the {split_name} split (split "
                f"{config.split!r} of its {len(_open(prefixes[k], opened))} documents); give it "
                f"more documents, change --split, or drop it from the blend.")
    if len(kept) == 1:
        k = kept[0]
        return GPTDataset(_open(prefixes[k], opened), prefixes[k], ranges[k], num_samples,
                          config, split_name)
    weights = [weights[k] for k in kept]
    sizes = over_provisioned_sizes(weights, num_samples, config.blend_surplus)
    parts = [GPTDataset(_open(prefixes[k], opened), prefixes[k], ranges[k], size, config,
                        split_name) for k, size in zip(kept, sizes)]
    return BlendedDataset(parts, weights, num_samples)
