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
import os
import re

import pytest
import torch
import torch.distributed as dist

from megatron.core import parallel_state as ps
from megatron.core.models.tp_sharding import merge_state_dicts
from megatron.core.pipeline_parallel import PipelineTrace
from megatron.core.pipeline_parallel.schedule_order import Step, max_in_flight, schedule_order
from megatron.core.pipeline_parallel.trace import load_trace
from tests.distributed import run_distributed
from tests.unit.test_pipeline_behaviour import _run as _run_traced
from tests.unit.test_pipeline_schedules import (
    _expected,
    _pipelined,
    _reference,
)


def _check(ranks, ref_losses, ref_grads, layers, loss_rank):
    holder = ranks[loss_rank]
    assert len(holder["losses"]) == len(ref_losses)
    for got, want in zip(holder["losses"], ref_losses):
        assert torch.equal(got, want)
    assert all(not r["losses"] for i, r in enumerate(ranks) if i != loss_rank)
    covered = []
    for rank in ranks:
        for stage in rank["stages"]:
            want = _expected(stage, ref_grads)
            assert stage["grads"].keys() == want.keys()
            for name, grad in stage["grads"].items():
                assert grad is not None, name
                assert torch.equal(grad, want[name]), (rank["pp_rank"], name)
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


# --- against our 1F1B at the same TP / SP / model: bitwise, whatever the placement ----------
# TP=2 reorders sums against one process (hence the 1e-5 of test_pipeline_schedules), but a
# zero-bubble schedule runs the same kernels in the same order per microbatch as our 1F1B at
# the same TP, and W accumulates each weight's microbatch gradients in microbatch order: so
# every gradient (merged over TP, keyed by global layer) is bitwise 1F1B's. GPT's tied
# embedding: both schedules sum each copy over the microbatches, then add the two copies.

_LAYER = re.compile(r"decoder\.layers\.(\d+)\.(.*)")


def _global_grads(kind, layers, pipe, virt, num_microbatches, sp, schedule):
    tp = ps.get_tensor_model_parallel_world_size()
    result = _pipelined(kind, layers, pipe, virt, num_microbatches, tp=tp, sequence_parallel=sp,
                        pipeline_schedule=schedule)
    grads = {}
    for stage in result["stages"]:
        local = dict(stage["grads"])
        if tp > 1:
            for name in stage["sequence_parallel"]:  # norm weights: partial sums per TP rank
                local[name] = local[name].clone()
                dist.all_reduce(local[name], group=ps.get_tensor_model_parallel_group())
            shards = [None] * tp
            dist.all_gather_object(shards, local, group=ps.get_tensor_model_parallel_group())
            local = merge_state_dicts(shards, gated_mlp=kind == "llama")
        start = stage["layer_range"][0]
        for name, grad in local.items():
            match = _LAYER.match(name)
            if match:  # a layer, by its global number; the rest by the end of the model
                key = f"decoder.layers.{int(match.group(1)) + start}.{match.group(2)}"
            else:
                key = (stage["pre_process"], stage["post_process"], name)
            grads[key] = grad
    return result["losses"], grads


def _all_grads(schedule, kind, layers, pipe, num_microbatches, tp=1, sp=False):
    virt = 2 if schedule == "zbv" else None
    ranks = run_distributed(_global_grads, world_size=pipe * tp, tp=tp, pp=pipe, vpp=virt,
                            kind=kind, layers=layers, pipe=pipe, virt=virt,
                            num_microbatches=num_microbatches, sp=sp, schedule=schedule)
    losses = [loss for rank_losses, _ in ranks for loss in rank_losses]
    grads = {}
    for _, rank_grads in ranks:
        for key, grad in rank_grads.items():
            assert key not in grads or torch.equal(grads[key], grad), key  # TP copies agree
            grads[key] = grad
    return losses, grads


@pytest.mark.parametrize("schedule", ["zb-h1", "zbv"])
@pytest.mark.parametrize("kind,tp,sp", [("llama", 2, False), ("llama", 2, True),
                                        ("gpt", 1, False)],
                         ids=["tp2", "tp2-sp", "gpt-tied"])
def test_zero_bubble_equals_our_1f1b_bitwise(schedule, kind, tp, sp):
    pipe, layers, num_microbatches = 2, 4, 5
    want_losses, want = _all_grads("1f1b", kind, layers, pipe, num_microbatches, tp, sp)
    got_losses, got = _all_grads(schedule, kind, layers, pipe, num_microbatches, tp, sp)
    assert len(got_losses) == len(want_losses) == num_microbatches * tp
    assert all(torch.equal(a, b) for a, b in zip(got_losses, want_losses))
    assert got.keys() == want.keys()
    for key, grad in want.items():
        assert torch.equal(got[key], grad), key


# --- the run executes the pure order; what it holds stays within the schedule's bound -------

def _traced_steps(pipe, virt, num_microbatches, schedule, forward_only, directory):
    trace = PipelineTrace(rank=dist.get_rank(),
                          pipeline_rank=ps.get_pipeline_model_parallel_rank())
    _run_traced(layers=2 * pipe, pipe=pipe, virt=virt, num_microbatches=num_microbatches,
                trace=trace, forward_only=forward_only,
                config_changes=dict(pipeline_schedule=schedule))
    path = os.path.join(directory, f"rank{trace.rank}.json")
    trace.write(path)
    return [(e["kind"][0].upper(), e["microbatch"], e["chunk"])
            for e in load_trace(path)["events"] if e["kind"] != "wait"]


@pytest.mark.parametrize("schedule,pipe,num,forward_only", [
    ("zb-h1", 4, 6, False), ("zb-h1", 2, 5, False), ("zbv", 2, 5, False), ("zbv", 4, 8, False),
    ("zbv", 2, 4, True)])
def test_run_follows_the_pure_order_within_the_memory_bound(schedule, pipe, num, forward_only,
                                                            tmp_path):
    virt = 2 if schedule == "zbv" else None
    ranks = run_distributed(_traced_steps, world_size=pipe, tp=1, pp=pipe, vpp=virt, pipe=pipe,
                            virt=virt, num_microbatches=num, schedule=schedule,
                            forward_only=forward_only, directory=str(tmp_path))
    bound = 2 * pipe if schedule == "zbv" else pipe  # 1F1B's p microbatches (zbv: half-chunks)
    for rank, executed in enumerate(ranks):
        order = schedule_order(pipe, rank, num, virt, forward_only, schedule)
        assert executed == [(s.kind, s.microbatch, s.chunk) for s in order], rank
        if not forward_only:  # counted from the executed steps: F holds, W releases
            assert max_in_flight([Step(*step) for step in executed]) <= bound
            assert sum(kind == "W" for kind, _, _ in executed) == num * (virt or 1)
