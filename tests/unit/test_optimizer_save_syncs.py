"""A save reads the optimizer's step once, not once per piece: ``float()`` of each piece's step
tensor was a host sync each on CUDA (thousands per save on a real model). The state saved is
unchanged: the step is the one the previous code read piece by piece."""
import pytest
import torch

from megatron.core import parallel_state as ps
from tests.distributed import run_distributed
from tests.sync_counter import SyncCounter
from tests.unit.test_data_parallel import _global_batches
from tests.unit.test_distributed_optimizer import _build, _train

# Reads a save may make whatever the number of pieces: the agreed step (one .item()).
SAVE_READS = 1


def _pieces(optimizer):
    return [piece for shard in optimizer.shards for piece, *_ in shard.pieces]


def _step_read_piece_by_piece(optimizer):
    """The previous code's step: the last piece's, read with float()."""
    step = None
    for piece in _pieces(optimizer):
        if "step" in optimizer.optimizer.state.get(piece, {}):
            step = float(optimizer.optimizer.state[piece]["step"])
    return step


def _save_reads(dtype, bucket_size):
    dp = ps.get_data_parallel_world_size()
    model, optimizer = _build("distributed", bucket_size=bucket_size, dtype=dtype)
    _train(model, optimizer, _global_batches(dp, steps=2))
    with SyncCounter() as state_syncs:
        state = optimizer.state_dict()
    with SyncCounter() as sharded_syncs:
        parts, meta = optimizer.sharded_state()
    return dict(pieces=len(_pieces(optimizer)), state_syncs=state_syncs.calls,
                sharded_syncs=sharded_syncs.calls, step=meta["step"],
                state_step=None if state is None else state["step"],
                want_step=_step_read_piece_by_piece(optimizer), parts=len(parts))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_distributed_optimizer_save_reads_the_step_once(dtype):
    results = run_distributed(_save_reads, world_size=2, tp=1, dtype=dtype, bucket_size=2000)
    for result in results:
        assert result["pieces"] > 2 * SAVE_READS  # enough pieces for per-piece reads to show
        assert len(result["state_syncs"]) <= SAVE_READS, result["state_syncs"]
        assert len(result["sharded_syncs"]) <= SAVE_READS, result["sharded_syncs"]
        assert result["step"] == result["want_step"] == 2.0
    assert results[0]["state_step"] == 2.0 and results[1]["state_step"] is None
    assert all(r["parts"] == r["pieces"] for r in results)
