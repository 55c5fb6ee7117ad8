"""Pretraining samplers: DP slicing, exact resumption, per-epoch shuffling; the DataLoader."""
import multiprocessing.reduction
import os
import signal
import subprocess
import sys

import numpy as np
import pytest
import torch
from torch.utils.data._utils import signal_handling

from megatron.core.datasets.mock_dataset import MockGPTDataset
from megatron.training.data import samplers as data_samplers
from megatron.training.data.samplers import (
    DataLoaderStalled,
    MegatronPretrainingRandomSampler,
    MegatronPretrainingSampler,
    build_pretraining_data_loader,
)


def sequential(consumed=0, rank=0, total=50, drop_last=True):
    return list(MegatronPretrainingSampler(total, consumed, 3, rank, 2, drop_last))


def test_sequential_ranks_slice_each_global_batch():
    rank0, rank1 = sequential(rank=0), sequential(rank=1)
    assert rank0[:2] == [[0, 1, 2], [6, 7, 8]]
    assert rank1[:2] == [[3, 4, 5], [9, 10, 11]]
    assert len(rank0) == len(rank1) == 8  # 50 // 6; the last 2 samples are dropped
    for g, (a, b) in enumerate(zip(rank0, rank1)):
        assert a + b == list(range(6 * g, 6 * g + 6))
    # Megatron keeps the last partial global batch with drop_last=False, sliced the same way.
    assert sequential(rank=0, drop_last=False)[-1] == [48, 49]
    assert sequential(rank=1, drop_last=False)[-1] == []


@pytest.mark.parametrize("consumed", [6, 18, 42, 48])
def test_sequential_resumes_exactly(consumed):
    for rank in (0, 1):
        assert sequential(consumed, rank) == sequential(0, rank)[consumed // 6:]
    # A resume point inside a global batch starts the next batch there, as in Megatron.
    assert sequential(7, 0)[0] == [7, 8, 9]


def test_sequential_bad_inputs():
    with pytest.raises(ValueError, match="consumed_samples=50 leaves no samples"):
        MegatronPretrainingSampler(50, 50, 3, 0, 2)
    with pytest.raises(ValueError, match="micro_batch_size must be > 0"):
        MegatronPretrainingSampler(50, 0, 0, 0, 2)
    with pytest.raises(ValueError, match="data_parallel_rank must be in"):
        MegatronPretrainingSampler(50, 0, 3, 2, 2)
    with pytest.raises(ValueError, match="no samples"):
        MegatronPretrainingSampler(0, 0, 3, 0, 2)


def random_sampler(consumed=0, rank=0, seed=1, sharding=True, total=50):
    return MegatronPretrainingRandomSampler(None, total, consumed, 3, rank, 2, sharding, seed)


@pytest.mark.parametrize("sharding", [True, False])
def test_cyclic_epochs_cover_every_sample_in_a_new_order(sharding):
    samplers = [random_sampler(rank=r, sharding=sharding) for r in (0, 1)]
    epochs = [[list(s) for s in samplers] for _ in range(3)]  # re-iterating: next epoch
    for epoch in epochs:
        flat = sorted(i for rank in epoch for batch in rank for i in batch)
        assert flat == list(range(48))  # 50 - 50 % 6: the incomplete global batch is dropped
        assert [len(rank) for rank in epoch] == [8, 8]
    if sharding:  # each rank owns a bucket of 24 samples
        assert sorted(i for b in epochs[0][0] for i in b) == list(range(24))
    orders = [[i for rank in epoch for batch in rank for i in batch] for epoch in epochs]
    assert orders[0] != orders[1] != orders[2]
    assert samplers[0].consumed_samples == 3 * 48


def test_cyclic_is_deterministic_with_the_seed():
    assert list(random_sampler(seed=1)) == list(random_sampler(seed=1))
    assert list(random_sampler(seed=1)) != list(random_sampler(seed=2))


@pytest.mark.parametrize("sharding", [True, False])
def test_cyclic_resumes_exactly(sharding):
    for rank in (0, 1):
        uninterrupted = random_sampler(rank=rank, sharding=sharding)
        full = list(uninterrupted) + list(uninterrupted) + list(uninterrupted)
        # Resume after 1 epoch + 3 global batches: 48 + 18 samples consumed.
        resumed = random_sampler(consumed=66, rank=rank, sharding=sharding)
        rest = list(resumed) + list(resumed)
        assert rest == full[11:]
    with pytest.raises(ValueError, match="not a whole number of global micro batches"):
        list(random_sampler(consumed=7))


def test_data_loader_single_and_cyclic():
    dataset = MockGPTDataset(20, 4, 100, seed=0)
    loader = build_pretraining_data_loader(dataset, 4, "single", micro_batch_size=2,
                                           num_workers=0, data_parallel_rank=1,
                                           data_parallel_size=2, seed=0)
    batches = list(loader)
    assert len(batches) == 4  # (20 - 4) // 4
    assert batches[0]["text"].dtype == torch.int64 and batches[0]["text"].shape == (2, 5)
    expected = np.stack([dataset[6]["text"], dataset[7]["text"]])  # consumed 4: next batch 4..7
    assert np.array_equal(batches[0]["text"].numpy(), expected)
    cyclic = build_pretraining_data_loader(dataset, 0, "cyclic", micro_batch_size=2,
                                           num_workers=2, data_parallel_rank=0,
                                           data_parallel_size=2, seed=3)
    indices = list(MegatronPretrainingRandomSampler(dataset, 20, 0, 2, 0, 2, True, 3))
    got = [batch["text"].numpy() for batch in cyclic]
    assert len(got) == len(indices) == 5
    for batch, idx in zip(got, indices):
        assert np.array_equal(batch, np.stack([dataset[i]["text"] for i in idx]))
    assert build_pretraining_data_loader(None, 0) is None
    with pytest.raises(ValueError, match="unknown --dataloader-type 'external'"):
        build_pretraining_data_loader(dataset, 0, "external")


class _UnansweredFd:
    """Stands for a worker's fd-sharing thread that never answers (e.g. stuck on a lock its
    process inherited held at fork): the training process would wait on it, untimed, while
    unpickling the batch. Failing loudly here instead keeps the test from hanging."""

    def __init__(self, fd):
        pass

    def detach(self):
        raise AssertionError("the training process asked a worker thread for a batch's memory")


class _WorkerWithoutFdSharing(MockGPTDataset):
    def __getitem__(self, idx):  # runs in the worker
        multiprocessing.reduction.DupFd = _UnansweredFd
        return super().__getitem__(idx)


def test_worker_batches_arrive_whole_without_calling_back_into_the_worker():
    """The hang seen in e2e runs: the rank waited forever inside Queue.get for a worker
    thread to hand over a batch's shared memory, every worker idle. Batches now travel whole
    (numpy in the pipe) and still come out as the same int64 tensors."""
    loader = build_pretraining_data_loader(_WorkerWithoutFdSharing(20, 4, 100, seed=0), 0,
                                           "single", micro_batch_size=2, num_workers=2,
                                           data_parallel_rank=0, data_parallel_size=2, seed=0)
    batches = list(loader)
    assert len(batches) == 5
    dataset = MockGPTDataset(20, 4, 100, seed=0)  # read here: leaves our DupFd alone
    for g, batch in enumerate(batches):
        assert batch["text"].dtype == torch.int64 and not batch["text"].is_shared()
        expected = np.stack([dataset[4 * g]["text"], dataset[4 * g + 1]["text"]])
        assert np.array_equal(batch["text"].numpy(), expected)


class _StoppingWorker(MockGPTDataset):
    def __getitem__(self, idx):  # runs in the worker: alive, but never answers
        os.kill(os.getpid(), signal.SIGSTOP)


def test_a_stuck_worker_is_one_error_not_a_hang(monkeypatch):
    monkeypatch.setattr(data_samplers, "BATCH_TIMEOUT_S", 0.5)
    loader = build_pretraining_data_loader(_StoppingWorker(20, 4, 100, seed=0), 0, "single",
                                           micro_batch_size=2, num_workers=1, seed=0)
    try:
        with pytest.raises(DataLoaderStalled, match="no batch from the data loader's workers"):
            next(iter(loader))
    finally:  # unregistered first, or torch's SIGCHLD handler raises on the kill
        iterator = loader._iterator
        signal_handling._remove_worker_pids(id(iterator))
        iterator._worker_pids_set = False
        for worker in iterator._workers:
            worker.kill()
            worker.join()


_EXIT_WITH_LIVE_WORKERS = """
import multiprocessing.process, os, sys
sys.path.insert(0, {root!r})
from megatron.core.datasets.mock_dataset import MockGPTDataset
from megatron.training.data.samplers import build_pretraining_data_loader

kill = multiprocessing.process.BaseProcess.kill
def kill_then_wait_for_its_sigchld(self):  # the race, lost every time
    kill(self)
    os.waitid(os.P_PID, self.pid, os.WEXITED | os.WNOWAIT)
multiprocessing.process.BaseProcess.kill = kill_then_wait_for_its_sigchld
loader = build_pretraining_data_loader(MockGPTDataset(20, 4, 100, seed=0), 0,
                                       micro_batch_size=2, num_workers=2)
batches = iter(loader)  # alive at exit, as when a traceback holds it
next(batches)
"""


@pytest.mark.slow  # starts processes: the full suite, not the quick tier
def test_exit_with_live_workers_kills_them_all(tmp_path):
    """At exit the loader workers (which ignore SIGTERM) are killed. torch's SIGCHLD handler
    raised at the first kill (a worker it watches died) and ended the loop, and
    multiprocessing then waited forever for the second worker."""
    from tests.e2e.runner import ROOT

    script = tmp_path / "exit_with_live_workers.py"
    script.write_text(_EXIT_WITH_LIVE_WORKERS.format(root=ROOT))
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=120)  # a deadline for a hang, not a speed limit
    assert proc.returncode == 0 and "Error" not in proc.stderr, proc.stderr
