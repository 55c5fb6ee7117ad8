"""The nccl-faithful test group (tests/nccl_faithful.py) against gloo's own results: outputs
poisoned until wait(), results equal once waited, inputs watched, tags ignored."""
import math

import pytest
import torch
import torch.distributed as dist

from tests import nccl_faithful
from tests.distributed import run_distributed


@pytest.fixture
def faithful(monkeypatch):
    monkeypatch.setenv(nccl_faithful.ENV, "1")


def _collectives():
    rank, world = dist.get_rank(), dist.get_world_size()
    seen = {"backend": dist.get_backend()}
    x = torch.arange(4, dtype=torch.float32) + 10 * rank
    work = dist.all_reduce(x, async_op=True)
    seen["all_reduce before wait"] = x.isnan().all().item()
    work.wait()
    seen["all_reduce"] = x.tolist()
    # in place: the input is this rank's chunk of the output, which nccl leaves alone
    buffer = torch.zeros(2 * world)
    buffer[2 * rank:2 * rank + 2] = rank + 1.0
    work = dist.all_gather_into_tensor(buffer, buffer[2 * rank:2 * rank + 2], async_op=True)
    seen["all_gather before wait"] = [math.isnan(v) or v for v in buffer.tolist()]
    work.wait()
    seen["all_gather"] = buffer.tolist()
    full = torch.arange(2 * world, dtype=torch.float32) * (rank + 1)
    shard = torch.empty(2)
    dist.reduce_scatter_tensor(shard, full)
    seen["reduce_scatter"] = shard.tolist()
    ints = torch.full((3,), rank, dtype=torch.int64)
    work = dist.all_reduce(ints, async_op=True)
    seen["int before wait"] = ints.tolist()
    work.wait()
    seen["int"] = ints.tolist()
    # point to point by order: a receive tagged 7 gets the send tagged 3
    if rank == 0:
        dist.send(torch.tensor([1.5]), 1, tag=3)
        dist.send(torch.tensor([2.5]), 1, tag=7)
    elif rank == 1:
        first = torch.empty(1)
        dist.recv(first, 0, tag=7)
        second = torch.empty(1)
        dist.recv(second, 0, tag=3)
        seen["recv order"] = [first.item(), second.item()]
    return seen


def test_outputs_poisoned_until_wait_and_equal_to_gloo_after(faithful):
    ranks = run_distributed(_collectives, world_size=2)
    big = torch.iinfo(torch.int64).max
    for rank, seen in enumerate(ranks):
        assert seen["backend"] == nccl_faithful.BACKEND
        assert seen["all_reduce before wait"] is True
        assert seen["all_reduce"] == [10.0, 12.0, 14.0, 16.0]
        own = [1.0 * (rank + 1)] * 2
        expected = [True] * 4
        expected[2 * rank:2 * rank + 2] = own
        assert seen["all_gather before wait"] == expected
        assert seen["all_gather"] == [1.0, 1.0, 2.0, 2.0]
        assert seen["reduce_scatter"] == [3.0 * (2 * rank), 3.0 * (2 * rank + 1)]
        assert seen["int before wait"] == [big] * 3
        assert seen["int"] == [1, 1, 1]
    assert ranks[1]["recv order"] == [1.5, 2.5]


def _write_input_before_wait():
    x = torch.ones(4)
    out = torch.empty(4 * dist.get_world_size())
    work = dist.all_gather_into_tensor(out, x, async_op=True)
    x.add_(1)  # nccl may still be reading x
    try:
        work.wait()
    except nccl_faithful.InputChangedBeforeWait as exc:
        return str(exc)
    return None


def test_an_input_written_before_wait_is_an_error(faithful):
    for message in run_distributed(_write_input_before_wait, world_size=2):
        assert message is not None and "all-gather" in message
