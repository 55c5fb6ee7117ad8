"""GPTDataset: fixed-length samples cut from the documents of an IndexedDataset.

The documents of a range (a train/valid/test split) are laid end to end in a shuffled order,
repeated for as many epochs as the requested number of samples needs, and cut every
``seq_length`` tokens; each sample holds ``seq_length + 1`` tokens (inputs and the shifted
labels), so consecutive samples share their boundary token. Samples are served in a shuffled
order. The three index arrays (see helpers.py) are Megatron-LM's, element for element.

They are cached as .npy files keyed by a hash of everything that determines them, built once
(by global rank 0 in a distributed run) and memory-mapped afterwards.
"""
import hashlib
import json
import logging
import os
import time
from typing import Dict, Optional, Tuple

import numpy as np
import torch

from megatron.core.datasets import helpers
from megatron.core.datasets.config import GPTDatasetConfig

logger = logging.getLogger(__name__)

_INDEX_NAMES = ("document_index", "sample_index", "shuffle_index")
_CACHE_FORMAT = 1  # bump when the arrays a description maps to change


def build_gpt_dataset_indices(sequence_lengths: np.ndarray, documents: np.ndarray,
                              num_samples: Optional[int], seq_length: int,
                              seed: int) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(document_index, sample_index, shuffle_index) for ``num_samples`` samples.

    ``sequence_lengths`` are the token counts of all documents of the dataset; ``documents``
    the ids to draw from (e.g. a split's range). ``num_samples=None`` means one epoch. At least
    ``num_samples`` samples are indexed: whole epochs' worth, with the last epoch shuffled on
    its own when it is used for less than 80% (Megatron's separate_last_epoch rule).
    """
    if seq_length < 1:
        raise ValueError(f"seq_length must be >= 1, got {seq_length}.")
    documents = np.asarray(documents, dtype=np.int64)
    tokens_per_epoch = int(np.asarray(sequence_lengths)[documents].sum(dtype=np.int64))
    if tokens_per_epoch == 0:
        raise ValueError(f"the {len(documents)} documents hold no tokens; cannot make samples.")
    if num_samples is None:
        num_epochs, separate = 1, False
    else:
        if num_samples < 1:
            raise ValueError(f"num_samples must be >= 1 (or None for one epoch), got "
                             f"{num_samples}.")
        num_epochs = helpers.num_epochs_needed(tokens_per_epoch, seq_length, num_samples)
        separate = helpers.separate_last_epoch(tokens_per_epoch, seq_length, num_samples,
                                               num_epochs)
    rng = np.random.RandomState(seed)
    document_index = helpers.build_document_index(documents, num_epochs, rng, separate)
    sample_index = helpers.build_sample_index(sequence_lengths, document_index, seq_length)
    total = sample_index.shape[0] - 1
    first = total
    if separate:
        first = ((num_epochs - 1) * tokens_per_epoch - helpers.ADD_EXTRA_TOKEN) // seq_length
    shuffle_index = helpers.build_shuffle_index(first, total, rng)
    return document_index, sample_index, shuffle_index


def index_cache_description(path_prefix: str, split_name: str, document_range: Tuple[int, int],
                            num_tokens: int, num_samples: Optional[int], seq_length: int,
                            seed: int) -> Dict:
    """What the index arrays depend on; its hash names the cache files."""
    return {
        "class": "GPTDataset",
        "format": _CACHE_FORMAT,
        "dataset_path": path_prefix,  # as given: every rank must compute the same key
        "split": split_name,
        "document_range": [int(document_range[0]), int(document_range[1])],
        "num_tokens": int(num_tokens),  # so a rewritten dataset does not hit a stale cache
        "num_samples": None if num_samples is None else int(num_samples),
        "seq_length": int(seq_length),
        "seed": int(seed),
        "separate_last_epoch_threshold": helpers.SEPARATE_LAST_EPOCH_THRESHOLD,
        "add_extra_token": helpers.ADD_EXTRA_TOKEN,
    }


def index_cache_paths(cache_dir: str, description: Dict) -> Dict[str, str]:
    """The four cache files (three .npy arrays and the JSON description) for a description."""
    key = hashlib.md5(json.dumps(description, sort_keys=True).encode()).hexdigest()
    stem = os.path.join(cache_dir, f"{key}-GPTDataset-{description['split']}")
    paths = {name: f"{stem}-{name}.npy" for name in _INDEX_NAMES}
    paths["description"] = f"{stem}-description.json"
    return paths


def load_or_build_indices(sequence_lengths: np.ndarray, description: Dict,
                          cache_dir: Optional[str]) -> Tuple[np.ndarray, ...]:
    """The index arrays from the cache, building and caching them first if needed.

    Collective when torch.distributed is initialized: every rank calls it with the same
    arguments; global rank 0 builds (writing temporary files, then renaming them), every rank
    waits for it, then the others load. Returns arrays memory-mapped read-only.
    """
    begin, end = description["document_range"]
    args = (sequence_lengths, np.arange(begin, end), description["num_samples"],
            description["seq_length"], description["seed"])
    if cache_dir is None:  # no cache: every rank builds in memory
        return build_gpt_dataset_indices(*args)
    paths = index_cache_paths(cache_dir, description)
    distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
    rank = torch.distributed.get_rank() if distributed else 0
    failure = None
    if rank == 0 and not _all_exist(paths):
        try:
            _build_and_save(args, description, paths)
        except Exception as exc:  # noqa: BLE001 - re-raised below, after telling the others
            failure = exc
    if distributed:
        _tell_others(failure is not None)
    if failure is not None:
        raise failure
    if not _all_exist(paths):
        raise RuntimeError(
            f"rank {rank}: the GPT dataset index cache {paths['description']} is missing after "
            f"rank 0 built it. All ranks must see the same cache directory: set "
            f"--data-cache-path to a filesystem shared by every node.")
    return tuple(np.load(paths[name], mmap_mode="r", allow_pickle=False)
                 for name in _INDEX_NAMES)


def _all_exist(paths: Dict[str, str]) -> bool:
    return all(os.path.isfile(p) for p in paths.values())


def _build_and_save(args, description: Dict, paths: Dict[str, str]) -> None:
    start = time.perf_counter()
    arrays = build_gpt_dataset_indices(*args)
    os.makedirs(os.path.dirname(paths["description"]), exist_ok=True)
    # Arrays first, the description last: its presence means the rest is complete.
    for name, array in zip(_INDEX_NAMES, arrays):
        _atomic_write(paths[name], lambda f, a=array: np.save(f, a, allow_pickle=False))
    text = json.dumps(description, indent=2, sort_keys=True).encode()
    _atomic_write(paths["description"], lambda f: f.write(text))
    logger.info("built GPT dataset indices for %s (%s, %d samples) in %.2f s",
                description["dataset_path"], description["split"], len(arrays[1]) - 1,
                time.perf_counter() - start)


def _atomic_write(path: str, write) -> None:
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            write(f)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def _tell_others(failed: bool) -> None:
    """Rank 0's build status to every rank; also the barrier the loaders wait on. The others
    wait in this broadcast on the world group for at most its timeout, which is
    --distributed-timeout-minutes (nccl's watchdog uses the same): raise it for index builds
    that take longer."""
    from megatron.core import device

    status = device.tensor([1 if failed else 0], dtype=torch.int32)
    torch.distributed.broadcast(status, 0)
    if status.item() and torch.distributed.get_rank() != 0:
        raise RuntimeError("rank 0 failed to build the GPT dataset indices (see its error).")


class GPTDataset(torch.utils.data.Dataset):
    """Samples of ``config.seq_length + 1`` tokens from documents ``document_range`` of
    ``indexed_dataset`` (one document = one sequence of the IndexedDataset).

    ``dataset[i]`` is ``{"text": int64 array of seq_length + 1 tokens}``. ``len`` is at least
    ``num_samples`` (whole epochs are indexed). Construction is collective in a distributed
    run (see load_or_build_indices).
    """

    def __init__(self, indexed_dataset, path_prefix: str, document_range: Tuple[int, int],
                 num_samples: Optional[int], config: GPTDatasetConfig, split_name: str = "train"):
        begin, end = (int(x) for x in document_range)
        num_documents = len(indexed_dataset)
        if not 0 <= begin < end <= num_documents:
            raise ValueError(f"{path_prefix}: document range [{begin}, {end}) is empty or outside "
                             f"the dataset's {num_documents} documents.")
        self.dataset = indexed_dataset
        self.path_prefix = path_prefix
        self.document_range = (begin, end)
        self.split_name = split_name
        self.seq_length = config.seq_length
        lengths = indexed_dataset.sequence_lengths
        num_tokens = int(np.asarray(lengths[begin:end]).sum(dtype=np.int64))
        self.num_tokens = num_tokens  # of its documents: one epoch
        self.description = index_cache_description(path_prefix, split_name, (begin, end),
                                                   num_tokens, num_samples, config.seq_length,
                                                   config.seed)
        cache_dir = config.data_cache_path
        if cache_dir is None:
            cache_dir = os.path.join(path_prefix, "cache", "GPTDataset_indices")
        self.cache_dir = cache_dir
        self.document_index, self.sample_index, self.shuffle_index = load_or_build_indices(
            lengths, self.description, cache_dir)

    def __len__(self) -> int:
        return self.sample_index.shape[0] - 1

    def __getitem__(self, idx: int) -> Dict[str, np.ndarray]:
        n = len(self)
        if not -n <= idx < n:
            raise IndexError(f"sample {idx} out of range for a GPTDataset of {n} samples.")
        i = int(self.shuffle_index[idx])
        first, first_offset = (int(x) for x in self.sample_index[i])
        last, last_offset = (int(x) for x in self.sample_index[i + 1])
        docs = self.document_index
        end = last_offset + helpers.ADD_EXTRA_TOKEN  # the boundary token, shared with i + 1
        if first == last:
            parts = [self.dataset.get(int(docs[first]), first_offset, end - first_offset)]
        else:
            parts = [self.dataset.get(int(docs[first]), first_offset)]
            parts += [self.dataset.get(int(docs[j])) for j in range(first + 1, last)]
            parts.append(self.dataset.get(int(docs[last]), 0, end))
        return {"text": np.concatenate(parts).astype(np.int64)}

