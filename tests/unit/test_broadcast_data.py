"""broadcast_data: TP rank 0's batch reaches every rank of its TP group, and only it."""
import torch

from megatron.core import parallel_state as ps
from megatron.core.tensor_parallel import broadcast_data
from tests.collective_counter import count_collectives
from tests.distributed import run_distributed


def _batch_of(dp_rank):
    base = 1000 * (dp_rank + 1)
    return {"text": torch.arange(base, base + 10).view(2, 5),
            "labels": torch.arange(base, base + 12, dtype=torch.int32).view(2, 3, 2),
            "scalar": torch.tensor(7)}


def _broadcast():
    dp_rank = ps.get_data_parallel_rank()
    is_source = ps.get_tensor_model_parallel_rank() == 0
    data = _batch_of(dp_rank) if is_source else None
    with count_collectives() as counts:
        got = broadcast_data(["text", "labels", "scalar"], data, torch.int64)
    want = _batch_of(dp_rank)
    same = all(torch.equal(got[k], want[k].to(torch.int64)) for k in want)
    return same, {k: v.dtype for k, v in got.items()}, dict(counts)


def test_broadcast_within_tp_group():
    results = run_distributed(_broadcast, world_size=4, tp=2)
    for same, dtypes, counts in results:
        assert same
        assert set(dtypes.values()) == {torch.int64}
        assert counts == {"broadcast": 2}


def _missing_key():
    data = {"text": torch.ones(2, 2)} if ps.get_tensor_model_parallel_rank() == 0 else None
    try:
        broadcast_data(["text", "labels"], data, torch.int64)
    except (ValueError, RuntimeError) as exc:
        return str(exc)
    return None


def test_bad_batch_fails_every_rank_instead_of_hanging():
    source, other = run_distributed(_missing_key, world_size=2, tp=2, timeout=60)
    assert "keys ['labels'] are not in the batch" in source
    assert "TP source rank 0 could not send its batch" in other
