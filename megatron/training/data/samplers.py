"""Megatron's pretraining batch samplers and the DataLoader built on them.

A sampler yields, per micro batch, the dataset indices of this data-parallel rank. Both are
resumable: constructed with ``consumed_samples`` (the global samples already trained on, as
saved in the checkpoint), they continue exactly where an uninterrupted run would be.
"""
import atexit
import functools
import multiprocessing
import signal
from typing import Iterator, List, Optional

import numpy as np
import torch
from torch.utils.data import default_collate

# Seconds the training process waits for one batch from its loader's workers. A batch is a
# few KiB and is prefetched: a wait this long means it was lost (a stuck worker), and the rank
# stops with one error line instead of hanging until the job's time limit.
BATCH_TIMEOUT_S = 120.0


class DataLoaderStalled(RuntimeError):
    """No batch from the data loader's workers in BATCH_TIMEOUT_S (a bug, not the input)."""


def _check(total_samples: int, consumed_samples: int, micro_batch_size: int,
           data_parallel_rank: int, data_parallel_size: int, sequential: bool) -> None:
    if total_samples <= 0:
        raise ValueError(f"the dataset has no samples to consume (total_samples={total_samples}).")
    if consumed_samples < 0 or (sequential and consumed_samples >= total_samples):
        raise ValueError(
            f"consumed_samples={consumed_samples} leaves no samples of the {total_samples} in the "
            f"dataset; the run has used up its data: build the dataset with more samples "
            f"(--train-samples/--train-iters) or check the checkpoint's consumed samples.")
    if micro_batch_size <= 0:
        raise ValueError(f"micro_batch_size must be > 0, got {micro_batch_size}.")
    if data_parallel_size <= 0:
        raise ValueError(f"data_parallel_size must be > 0, got {data_parallel_size}.")
    if not 0 <= data_parallel_rank < data_parallel_size:
        raise ValueError(f"data_parallel_rank must be in [0, {data_parallel_size}), got "
                         f"{data_parallel_rank}.")


class MegatronPretrainingSampler:
    """Sequential ('single'): global batch g of micro batches is indices
    [consumed + g*mbs*dp, consumed + (g+1)*mbs*dp), and rank r takes slice
    [r*mbs, (r+1)*mbs) of it. A last incomplete batch is dropped unless ``drop_last=False``.
    """

    def __init__(self, total_samples: int, consumed_samples: int, micro_batch_size: int,
                 data_parallel_rank: int, data_parallel_size: int, drop_last: bool = True):
        _check(total_samples, consumed_samples, micro_batch_size, data_parallel_rank,
               data_parallel_size, sequential=True)
        self.total_samples = total_samples
        self.consumed_samples = consumed_samples
        self.micro_batch_size = micro_batch_size
        self.data_parallel_rank = data_parallel_rank
        self.micro_batch_times_data_parallel_size = micro_batch_size * data_parallel_size
        self.drop_last = drop_last

    def __len__(self) -> int:
        return self.total_samples

    def get_start_end_idx(self):
        start = self.data_parallel_rank * self.micro_batch_size
        return start, start + self.micro_batch_size

    def __iter__(self) -> Iterator[List[int]]:
        start, end = self.get_start_end_idx()
        step = self.micro_batch_times_data_parallel_size
        batch_start = self.consumed_samples
        while batch_start + step <= self.total_samples:
            yield list(range(batch_start + start, batch_start + end))
            batch_start += step
        # Megatron: the partial last batch, sliced the same way (may be short or empty).
        if batch_start < self.total_samples and not self.drop_last:
            last = list(range(batch_start, self.total_samples))
            yield last[start:end]


class MegatronPretrainingRandomSampler:
    """Shuffled ('cyclic'): each epoch is a fresh permutation (seeded by ``seed + epoch``).

    With ``data_sharding`` (Megatron's default) the epoch's samples are cut into one bucket per
    DP rank and each rank shuffles within its own bucket; otherwise one permutation of all
    samples is dealt round-robin to the ranks. Incomplete micro batches at the end of an epoch
    are dropped. ``consumed_samples`` advances as batches are yielded, so iterating again
    starts the next epoch.
    """

    def __init__(self, dataset, total_samples: int, consumed_samples: int, micro_batch_size: int,
                 data_parallel_rank: int, data_parallel_size: int, data_sharding: bool = True,
                 seed: int = 0):
        _check(total_samples, consumed_samples, micro_batch_size, data_parallel_rank,
               data_parallel_size, sequential=False)
        self.dataset = dataset
        self.total_samples = total_samples
        self.consumed_samples = consumed_samples
        self.micro_batch_size = micro_batch_size
        self.data_parallel_rank = data_parallel_rank
        self.data_parallel_size = data_parallel_size
        self.data_sharding = data_sharding
        self.seed = seed
        self.micro_batch_times_data_parallel_size = micro_batch_size * data_parallel_size
        self.last_batch_size = total_samples % self.micro_batch_times_data_parallel_size
        if total_samples < self.micro_batch_times_data_parallel_size:
            raise ValueError(f"{total_samples} samples make no global micro batch of "
                             f"micro_batch_size {micro_batch_size} x data_parallel_size "
                             f"{data_parallel_size}.")

    def __len__(self) -> int:
        return self.total_samples

    def __iter__(self) -> Iterator[List[int]]:
        active_total_samples = self.total_samples - self.last_batch_size
        self.epoch = self.consumed_samples // active_total_samples
        current_epoch_samples = self.consumed_samples % active_total_samples
        if current_epoch_samples % self.micro_batch_times_data_parallel_size:
            raise ValueError(f"consumed_samples={self.consumed_samples} is not a whole number of "
                             f"global micro batches ({self.micro_batch_times_data_parallel_size}).")
        g = torch.Generator()
        g.manual_seed(self.seed + self.epoch)
        if self.data_sharding:
            bucket_size = (self.total_samples // self.micro_batch_times_data_parallel_size
                           * self.micro_batch_size)
            bucket_offset = current_epoch_samples // self.data_parallel_size
            start = self.data_parallel_rank * bucket_size
            order = torch.randperm(bucket_size, generator=g).tolist()
            idx_range = [start + x for x in order[bucket_offset:]]
        else:
            full_bucket_size = (self.total_samples // self.micro_batch_size
                                * self.micro_batch_size)
            order = torch.randperm(full_bucket_size, generator=g).tolist()
            idx_range = order[current_epoch_samples:][self.data_parallel_rank::
                                                      self.data_parallel_size]
        batch = []
        for idx in idx_range:
            batch.append(idx)
            if len(batch) == self.micro_batch_size:
                self.consumed_samples += self.micro_batch_times_data_parallel_size
                yield batch
                batch = []


def build_pretraining_data_loader(dataset, consumed_samples: int, dataloader_type: str = "single",
                                  micro_batch_size: int = 1, num_workers: int = 0,
                                  data_parallel_rank: int = 0, data_parallel_size: int = 1,
                                  seed: int = 0, data_sharding: bool = True,
                                  pin_memory: Optional[bool] = None
                                  ) -> Optional[torch.utils.data.DataLoader]:
    """A DataLoader over ``dataset`` for this DP rank ('single': sequential, 'cyclic':
    shuffled per epoch); None for no dataset. Batches are dicts of stacked tensors.
    """
    if dataset is None:
        return None
    if dataloader_type == "single":
        sampler = MegatronPretrainingSampler(len(dataset), consumed_samples, micro_batch_size,
                                             data_parallel_rank, data_parallel_size)
    elif dataloader_type == "cyclic":
        sampler = MegatronPretrainingRandomSampler(dataset, len(dataset), consumed_samples,
                                                   micro_batch_size, data_parallel_rank,
                                                   data_parallel_size, data_sharding, seed)
    else:
        raise ValueError(f"unknown --dataloader-type {dataloader_type!r}; use 'single' or "
                         f"'cyclic'.")
    if pin_memory is None:
        from megatron.core import device

        pin_memory = device.device_type() == "cuda"
    # Its own generator: each new iterator draws a worker seed, and drawing it from the global
    # generator would shift the dropout masks after a resume (the iterator starts later).
    generator = torch.Generator().manual_seed(seed)
    workers = num_workers > 0
    if workers:
        _kill_workers_at_exit()
    return PretrainingDataLoader(dataset, batch_sampler=sampler, num_workers=num_workers,
                                 pin_memory=pin_memory, generator=generator,
                                 persistent_workers=workers, worker_init_fn=ignore_stop_signals,
                                 collate_fn=collate_to_numpy if workers else None,
                                 timeout=BATCH_TIMEOUT_S if workers else 0)


def collate_to_numpy(samples) -> dict:
    """In a worker: the batch as numpy arrays, pickled whole into the result pipe. Tensors
    would travel as shared-memory file descriptors that the training process fetches, while
    unpickling, over a socket from a thread of the worker, with no timeout: a worker thread
    that never answers (e.g. one stuck on a lock its process inherited held at fork) left the
    rank waiting forever with every worker looking idle."""
    return {key: value.numpy() for key, value in default_collate(samples).items()}


class PretrainingDataLoader(torch.utils.data.DataLoader):
    """A DataLoader whose batches are dicts of tensors; with workers, they arrive as numpy
    (``collate_to_numpy``) and become tensors here (pinned when ``pin_memory``), and a batch
    that does not come in BATCH_TIMEOUT_S raises DataLoaderStalled."""

    def __iter__(self):
        batches = super().__iter__()  # persistent workers: the same iterator, reset
        return batches if self.num_workers == 0 else self._tensors(batches)

    def _tensors(self, batches):
        while True:
            try:
                batch = next(batches)
            except StopIteration:
                return
            except RuntimeError as exc:  # torch's message is the only sign of its timeout
                if "DataLoader timed out" not in str(exc):
                    raise
                raise DataLoaderStalled(
                    f"no batch from the data loader's workers in {self.timeout:g} s: a worker "
                    f"is stuck (a bug, not the data); rerun, or use --num-workers 0") from exc
            yield {key: self._tensor(value) for key, value in batch.items()}

    def _tensor(self, value):
        if not isinstance(value, np.ndarray):
            return value
        tensor = torch.from_numpy(value)
        return tensor.pin_memory() if self.pin_memory else tensor


def ignore_stop_signals(worker_id: int = 0) -> None:
    """In a loader worker: SIGTERM and SIGINT are for the training process to handle. Sent to
    the whole process group (torchrun's shutdown, Slurm, a terminal's Ctrl-C) they would kill
    the worker (torch's worker SIGTERM handler exits), and the rank would fail on its next
    batch instead of finishing the iteration and saving (--exit-signal-handler). A worker
    still ends with its loader, or when the training process is gone."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)


@functools.lru_cache(maxsize=None)  # once per process
def _kill_workers_at_exit() -> None:
    """At interpreter exit, multiprocessing ends daemonic children (loader workers) with
    SIGTERM and then joins them, and our workers ignore SIGTERM (ignore_stop_signals): an
    exception that escapes the training loop, whose traceback keeps the loader alive past its
    own shutdown, would hang the exit forever. Registered after multiprocessing's own exit
    function, this runs first and ends them with SIGKILL (they hold nothing to save)."""
    def kill_daemonic_children():
        # torch's SIGCHLD handler raises when a worker of a live loader dies: at the first
        # kill it would end this loop, leaving the other workers for multiprocessing to join.
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        for child in multiprocessing.active_children():
            if child.daemon:
                child.kill()
    atexit.register(kill_daemonic_children)


def cyclic_iter(iterable):
    """Iterate forever, re-entering ``iterable`` (e.g. a cyclic DataLoader: next epoch)."""
    while True:
        yield from iterable
