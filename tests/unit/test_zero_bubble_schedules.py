"""The zero-bubble schedules (ZB-H1, and ZB-V over two chunks per rank placed in a V) against a
single process doing gradient accumulation over the same microbatches: every loss and every
parameter gradient, BITWISE.

Splitting a backward into B (input gradients) and W (weight gradients, run later) changes no
arithmetic: W runs the same GEMM on the same saved tensors and accumulates through autograd as
the whole backward did, and each parameter's microbatch gradients are still added in microbatch
order (W's run in their B's order, per chunk). So the comparison is test_pipeline_schedules'
(bitwise for LLaMA; 1e-5 absolute with TP=2, whose sums are ordered differently from one
process's in any schedule).
"""
import pytest
import torch

from tests.distributed import run_distributed
from tests.unit.test_pipeline_schedules import (
    _expected,
    _pipelined,
    _reference,
    _tp_pp_full_grads,
)


def _check(ranks, ref_losses, ref_grads, layers, loss_rank, tol=0.0):
    holder = ranks[loss_rank]
    assert len(holder["losses"]) == len(ref_losses)
    for got, want in zip(holder["losses"], ref_losses):
        assert torch.equal(got, want) if tol == 0 else abs(got - want) <= tol
    assert all(not r["losses"] for i, r in enumerate(ranks) if i != loss_rank)
    covered = []
    for rank in ranks:
        for stage in rank["stages"]:
            want = _expected(stage, ref_grads)
            assert stage["grads"].keys() == want.keys()
            for name, grad in stage["grads"].items():
                assert grad is not None, name
                if tol == 0:
                    assert torch.equal(grad, want[name]), (rank["pp_rank"], name)
                else:
                    torch.testing.assert_close(grad, want[name], rtol=0, atol=tol)
            covered += list(range(*stage["layer_range"]))
    assert sorted(covered) == list(range(layers)), "every layer on exactly one chunk"


def _run(schedule, pipe, num_microbatches, kind="llama"):
    virt = 2 if schedule == "zbv" else None
    layers = 2 * pipe if schedule == "zbv" else pipe
    ref_losses, ref_grads = run_distributed(_reference, world_size=1, tp=1, kind=kind,
                                            layers=layers,
                                            num_microbatches=num_microbatches)[0]
    ranks = run_distributed(_pipelined, world_size=pipe, tp=1, pp=pipe, vpp=virt, kind=kind,
                            layers=layers, pipe=pipe, virt=virt,
                            num_microbatches=num_microbatches, pipeline_schedule=schedule)
    loss_rank = 0 if schedule == "zbv" else pipe - 1
    _check(ranks, ref_losses, ref_grads, layers, loss_rank)


@pytest.mark.parametrize("pipe", [2, 4])
@pytest.mark.parametrize("multiple", ["pp", "2pp", "2pp+1"])
def test_zb_h1_equals_single_process_bitwise(pipe, multiple):
    _run("zb-h1", pipe, {"pp": pipe, "2pp": 2 * pipe, "2pp+1": 2 * pipe + 1}[multiple])


@pytest.mark.parametrize("pipe", [2, 4])
@pytest.mark.parametrize("multiple", ["2pp", "2pp+1"])
def test_zbv_equals_single_process_bitwise(pipe, multiple):
    _run("zbv", pipe, {"2pp": 2 * pipe, "2pp+1": 2 * pipe + 1}[multiple])
