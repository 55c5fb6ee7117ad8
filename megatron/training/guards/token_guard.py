"""Token ids outside the model's vocabulary [0, vocab): data tokenized with another (bigger)
tokenizer. Left alone they crash the embedding at TP=1 (an IndexError; a device-side assert
on CUDA) and at TP>1 train silently to an infinite loss (the vocab-parallel embedding masks
ids no rank owns; the labels overflow the loss).

Two checks, both of bounded cost:
- at start, ``check_datasets_at_start`` reads the first ``SAMPLE_BYTES`` of each ``.bin``
  the training datasets use (a bounded read, whatever the file's size) and names the dataset;
  a corpus whose tokenizer sidecar vouched for its largest id (data/corpus_tokenizer.py) is
  complete already and is skipped;
- during training, ``TokenGuard.sanitize`` ORs a device-side flag per micro batch (no host
  sync) and replaces bad ids by 0 so the step runs; ``TokenGuard.check`` reads the flag at the
  log interval and before a save (all ranks agree with one all-reduce) and, when set, scans
  the ``.bin`` files on host to name the culprit: that cost is paid only on the error path.
"""
import os
from typing import Iterable, List, Optional, Tuple

import numpy as np
import torch
import torch.distributed as dist

from megatron.core import device
from megatron.core.datasets.indexed_dataset import IndexedDataset, data_file_path

SAMPLE_BYTES = 4 * 2**20  # the start check reads at most this much of each .bin
_SCAN_BLOCK = 2**24  # tokens per block when a .bin is scanned on the error path

_FIX = ("retokenize the data with the model's tokenizer, or set the tokenizer "
        "(--tokenizer-type/--tokenizer-name-or-path, --vocab-size) to the one the data was "
        "made with")


class TokenIdError(ValueError):
    """A dataset holds token ids outside the model's vocabulary; the message names it."""


def indexed_datasets(datasets: Iterable) -> List[IndexedDataset]:
    """The distinct IndexedDatasets under ``datasets`` (GPTDatasets, blends of them; None and
    mock datasets hold none), in order of first appearance."""
    found, seen = [], set()

    def visit(dataset) -> None:
        if dataset is None:
            return
        if isinstance(dataset, IndexedDataset):
            if dataset.path_prefix not in seen:
                seen.add(dataset.path_prefix)
                found.append(dataset)
            return
        for child in getattr(dataset, "datasets", None) or ():  # a blend
            visit(child)
        inner = getattr(dataset, "dataset", None)  # a GPTDataset's IndexedDataset
        if inner is not None:
            visit(inner)

    for dataset in datasets:
        visit(dataset)
    return found


def _first_bad(tokens: np.ndarray, vocab_size: int) -> Optional[Tuple[int, int]]:
    """(position, id) of the first id outside [0, vocab_size) in ``tokens``, or None."""
    bad = np.flatnonzero((tokens < 0) | (tokens >= vocab_size))
    return (int(bad[0]), int(tokens[bad[0]])) if len(bad) else None


def _tokens(dataset: IndexedDataset) -> np.ndarray:
    """The whole ``.bin`` as a read-only array (memory-mapped: nothing is read yet)."""
    path = data_file_path(dataset.path_prefix)
    if os.path.getsize(path) == 0:  # np.memmap cannot map an empty file
        return np.empty(0, dataset.dtype)
    return np.memmap(path, dtype=dataset.dtype, mode="r")


def sample_bad_id(dataset: IndexedDataset, vocab_size: int,
                  sample_bytes: int = SAMPLE_BYTES) -> Optional[Tuple[int, int]]:
    """(token position, id) of the first bad id in the first ``sample_bytes`` of the .bin."""
    tokens = _tokens(dataset)
    return _first_bad(np.asarray(tokens[:sample_bytes // dataset.dtype.itemsize]), vocab_size)


def scan_bad_id(dataset: IndexedDataset, vocab_size: int) -> Optional[Tuple[int, int]]:
    """(token position, id) of the first bad id anywhere in the .bin (reads all of it)."""
    tokens = _tokens(dataset)
    for start in range(0, len(tokens), _SCAN_BLOCK):
        found = _first_bad(np.asarray(tokens[start:start + _SCAN_BLOCK]), vocab_size)
        if found is not None:
            return start + found[0], found[1]
    return None


def _where(dataset: IndexedDataset, found: Tuple[int, int], vocab_size: int) -> str:
    position, token = found
    return (f"{data_file_path(dataset.path_prefix)} holds token id {token} (at token "
            f"{position}) but the model's vocabulary is [0, {vocab_size})")


def check_datasets_at_start(datasets: Iterable, vocab_size: int,
                            sample_bytes: int = SAMPLE_BYTES, checked: Iterable[str] = ()) -> None:
    """Raise TokenIdError naming the first dataset whose sampled ids leave the vocabulary.
    ``checked``: prefixes (absolute) already known to be inside it (their sidecar), not read.
    Every rank sees the same files, so every rank raises alike (no collective needed)."""
    checked = set(checked)
    for dataset in indexed_datasets(datasets):
        if os.path.abspath(dataset.path_prefix) in checked:
            continue
        found = sample_bad_id(dataset, vocab_size, sample_bytes)
        if found is not None:
            raise TokenIdError(f"{_where(dataset, found, vocab_size)}: the data was made "
                               f"with another tokenizer; {_FIX}.")


class TokenGuard:
    """The per-micro-batch check on device; see the module docstring."""

    def __init__(self, vocab_size: int, datasets: Iterable = ()):
        self.vocab_size = vocab_size
        self.datasets = list(datasets)
        self.flag = device.zeros(1, dtype=torch.bool)
        self.checked_at = 0  # the last iteration the flag was seen clear

    def sanitize(self, text: torch.Tensor) -> torch.Tensor:
        """``text`` with ids outside the vocabulary replaced by 0; records that it saw one."""
        bad = (text < 0) | (text >= self.vocab_size)
        self.flag |= bad.any()
        return torch.where(bad, torch.zeros_like(text), text)

    def bad_on_any_rank(self) -> bool:
        """Collective: every rank calls it at the same point (one all-reduce, one sync)."""
        flag = self.flag.to(torch.int32)
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def check(self, iteration: int) -> None:
        """Collective. Raise TokenIdError (the same on every rank) if a bad id was seen."""
        if not self.bad_on_any_rank():
            self.checked_at = iteration
            return
        raise TokenIdError(self.message(iteration))

    def message(self, iteration: int) -> str:
        culprits = [_where(d, found, self.vocab_size) for d in indexed_datasets(self.datasets)
                    for found in [scan_bad_id(d, self.vocab_size)] if found is not None]
        where = "; ".join(culprits) or \
            f"the training data holds token ids outside the vocabulary [0, {self.vocab_size})"
        return (f"{where}: met during training between iterations {self.checked_at + 1} "
                f"and {iteration} (the start check reads only the first "
                f"{SAMPLE_BYTES // 2**20} MiB of each file); nothing was saved after "
                f"iteration {self.checked_at}; {_FIX}.")


_ACTIVE: Optional[TokenGuard] = None


def set_token_guard(guard: Optional[TokenGuard]) -> None:
    """The guard get_batch applies (pretrain sets it for the run; None: no check)."""
    global _ACTIVE
    _ACTIVE = guard


def get_token_guard() -> Optional[TokenGuard]:
    return _ACTIVE
