"""The MoE log's dropped-token fraction (capacity factor): the routing choices the capacity
dropped over all the choices made, summed over the interval's forwards and over ranks; the
reference is each forward's own count (MoELayer.forward_with_aux's "num_dropped" and its
"routed_per_expert")."""
import pytest
import torch

from megatron.core import parallel_state as ps
from megatron.training.logging.moe_metrics import gather_moe_metrics
from tests.distributed import run_distributed
from tests.unit.test_moe_host_syncs import BATCH, EXPERTS, HIDDEN, SEQ, _layer


def _fraction(capacity_factor):
    ps.initialize_model_parallel(1, 1, expert_model_parallel_size=2)
    try:
        moe = {} if capacity_factor is None else dict(moe_expert_capacity_factor=capacity_factor)
        layer = _layer(ep=2, **moe)
        layer.train()
        dropped = routed = 0.0
        generator = torch.Generator().manual_seed(20 + ps.get_expert_model_parallel_rank())
        for _ in range(3):
            x = torch.randn(SEQ, BATCH, HIDDEN, generator=generator, requires_grad=True)
            with torch.no_grad():  # the reference counts of the same forward
                _, aux = layer.forward_with_aux(x)
            dropped += float(aux["num_dropped"])
            routed += float(aux["routed_per_expert"].sum())
            out, _ = layer(x)
            out.square().sum().backward()
        metrics = gather_moe_metrics([layer], 1, EXPERTS, 1, capacity_factor)
        totals = torch.tensor([dropped, routed])
        torch.distributed.all_reduce(totals)
        return metrics.get("dropped token fraction"), (totals[0] / totals[1]).item()
    finally:
        ps.destroy_model_parallel()


@pytest.mark.parametrize("capacity_factor", [0.5, None])
def test_dropped_token_fraction_is_the_forwards_own_count(capacity_factor):
    for got, want in run_distributed(_fraction, world_size=2, capacity_factor=capacity_factor):
        if capacity_factor is None:
            assert got is None and want == 0  # nothing dropped, nothing logged
        else:
            assert 0 < want < 1 and got == pytest.approx(want, rel=1e-6)
