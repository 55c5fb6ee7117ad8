"""Train/valid/test datasets from a GPTDatasetConfig: mock, split blend, or per-split blends."""
from typing import Dict, Sequence, Tuple

from megatron.core.datasets.blended_dataset import BlendedDataset
from megatron.core.datasets.config import (
    SPLIT_NAMES,
    GPTDatasetConfig,
    get_split_indices,
)
from megatron.core.datasets.gpt_dataset import GPTDataset
from megatron.core.datasets.helpers import over_provisioned_sizes
from megatron.core.datasets.indexed_dataset import IndexedDataset, IndexedDatasetError
from megatron.core.datasets.mock_dataset import MockGPTDataset


class EmptySplitError(IndexedDatasetError):
    """--split leaves a split that samples are asked of without documents (a small corpus):
    a dataset error, found before any index is built."""


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
    opened: Dict[str, IndexedDataset] = {}
    plans = [_plan_split(config, i, n, opened) for i, n in enumerate(counts)]
    used = [i for i, plan in enumerate(plans) if plan is not None]
    for i in used:  # every split checked before any index is built
        _check_not_empty(config, i, *plans[i], opened, used)
    return tuple(None if plan is None else
                 _build_blend(config, *plan, counts[i], SPLIT_NAMES[i], opened)
                 for i, plan in enumerate(plans))


def _plan_split(config, i: int, num_samples: int, opened):
    """(prefixes, weights, document ranges) of split i, or None when it gets no dataset."""
    name = SPLIT_NAMES[i]
    blend = config.blend() if config.data_path is not None else config.blend(name)
    if blend is None or num_samples == 0:
        return None
    if config.data_path is not None and config.split_weights[i] == 0:
        return None
    prefixes, weights = blend
    ranges = []
    for prefix in prefixes:
        num_docs = len(_open(prefix, opened))
        if config.data_path is not None:
            bounds = get_split_indices(config.split_weights, num_docs)
            ranges.append((bounds[i], bounds[i + 1]))
        else:
            ranges.append((0, num_docs))
    return prefixes, weights, ranges


def _open(prefix: str, opened: Dict[str, IndexedDataset]) -> IndexedDataset:
    if prefix not in opened:
        dataset = IndexedDataset(prefix)
        if dataset.dtype.kind not in "iu":  # the format also holds floats: not token ids
            raise IndexedDatasetError(
                f"{prefix}.idx: its values are {dataset.dtype}, not integer token ids; a GPT "
                f"dataset comes from tools/preprocess_data.py: re-run it on the text")
        opened[prefix] = dataset
    return opened[prefix]


def _check_not_empty(config, i, prefixes, weights, ranges, opened, used) -> None:
    split_name = SPLIT_NAMES[i]
    for k, (begin, end) in enumerate(ranges):
        if weights[k] > 0 and end <= begin:
            num_docs = len(_open(prefixes[k], opened))
            if config.data_path is None:
                raise EmptySplitError(
                    f"--{split_name}-data-path: {prefixes[k]} has no documents; give it data "
                    f"(re-run tools/preprocess_data.py) or drop it from the blend.")
            raise EmptySplitError(empty_split_message(config.split, config.split_weights, i,
                                                      prefixes[k], num_docs, used))


def empty_split_message(split: str, split_weights, i: int, prefix: str, num_docs: int,
                        used=(0, 1, 2)) -> str:
    """Split i is empty: how the documents fell, and two fixes: a --split that works for
    this many documents, or the number of documents the given --split needs for the splits
    in ``used`` (those samples are asked of)."""
    bounds = get_split_indices(split_weights, num_docs)
    shares = ", ".join(f"{name} {bounds[j + 1] - bounds[j]}"
                       for j, name in enumerate(SPLIT_NAMES))
    needed = max(_documents_needed(split_weights, j) for j in used if split_weights[j] > 0)
    return (f"--split {split.replace(' ', '')} leaves the {SPLIT_NAMES[i]} split of {prefix} "
            f"without documents: it has {num_docs} document(s), split as {shares}; pass "
            f"--split {_split_for(num_docs)} for this corpus, or give it at least {needed} "
            f"documents.")


def _split_for(num_docs: int) -> str:
    """A --split that gives this many documents a train and (with 2 or more) a valid part
    and no test part (pretraining evaluates on valid only)."""
    if num_docs < 2:
        return "1,0,0"
    valid = max(1, round(num_docs / 10))
    return f"{num_docs - valid},{valid},0"


def _documents_needed(split_weights, i: int) -> int:
    """The fewest documents for which split i (weight > 0) gets at least one."""
    n = max(1, int(0.5 / split_weights[i]))  # round(w * n) >= 1 needs w * n > 0.5
    while get_split_indices(split_weights, n)[i + 1] <= get_split_indices(split_weights, n)[i]:
        n += 1
    return n


def _build_blend(config, prefixes, weights, ranges, num_samples, split_name, opened):
    kept = [k for k, w in enumerate(weights) if w > 0]
    if len(kept) == 1:
        k = kept[0]
        return GPTDataset(_open(prefixes[k], opened), prefixes[k], ranges[k], num_samples,
                          config, split_name)
    weights = [weights[k] for k in kept]
    sizes = over_provisioned_sizes(weights, num_samples, config.blend_surplus)
    parts = [GPTDataset(_open(prefixes[k], opened), prefixes[k], ranges[k], size, config,
                        split_name) for k, size in zip(kept, sizes)]
    return BlendedDataset(parts, weights, num_samples)
