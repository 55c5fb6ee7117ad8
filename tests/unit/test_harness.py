"""The multi-rank harness itself: values come back in rank order, failures and hangs surface."""
import time

import pytest
import torch
import torch.distributed as dist

from megatron.core import parallel_state
from tests import distributed
from tests.distributed import RankFailed, run_distributed


def _rank_and_sum(offset):
    t = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(t)
    return dist.get_rank() + offset, t.item()


@pytest.mark.parametrize("world_size", [1, 2, 4, 8])
def test_every_rank_runs_and_communicates(world_size):
    got = run_distributed(_rank_and_sum, world_size=world_size, offset=100)
    total = float(sum(range(world_size)))
    assert got == [(100 + r, total) for r in range(world_size)]


def _layout_is_set():
    return (parallel_state.get_tensor_model_parallel_world_size(),
            parallel_state.get_pipeline_model_parallel_world_size())


def test_layout_is_initialised_and_torn_down():
    assert run_distributed(_layout_is_set, world_size=4, tp=2, pp=2) == [(2, 2)] * 4
    # The previous task destroyed its groups, so a new layout can be made on the same ranks.
    assert run_distributed(_layout_is_set, world_size=4, tp=4) == [(4, 1)] * 4


def _fail_on_rank_one():
    if dist.get_rank() == 1:
        raise ValueError("boom on purpose")
    dist.barrier()  # rank 0 would wait forever for rank 1


def test_failing_rank_traceback_is_reraised(monkeypatch):
    # The survivors' grace to report their own failures is spent waiting on the barrier
    # here: a shorter one tests the same path.
    monkeypatch.setattr(distributed, "_GRACE_AFTER_FAILURE_S", 1.0)
    with pytest.raises(RankFailed, match=r"(?s)rank 1:.*ValueError: boom on purpose"):
        run_distributed(_fail_on_rank_one, world_size=2, timeout=60)
    # The pool that hung on the barrier was killed; a fresh one works.
    assert run_distributed(_rank_and_sum, world_size=2, offset=0) == [(0, 1.0), (1, 1.0)]


def _hang_on_rank_zero():
    if dist.get_rank() == 0:
        time.sleep(600)


def test_timeout_kills_all_ranks():
    start = time.monotonic()
    with pytest.raises(TimeoutError, match=r"ranks \[0\] of 2 did not finish within 1 s"):
        run_distributed(_hang_on_rank_zero, world_size=2, timeout=1)
    assert time.monotonic() - start < 30
    assert run_distributed(_rank_and_sum, world_size=2, offset=0) == [(0, 1.0), (1, 1.0)]
