"""The memory estimate of the memory modes against the tensors real CPU runs hold.

After one real training step on every rank (gloo, fp32 / bf16): the bytes of the distinct
storages of the parameters, gradients, fp32 main params and their gradients, optimizer states
and step counters equal ``rank_state_bytes`` / ``rank_memory`` to the byte, for FSDP2 (ZeRO-3
and ZeRO-2) at DP=4, at PP=2 x DP=2 and CP=2 x DP=2, and for the distributed optimizer's
ZeRO-2 (--shard-gradients) at DP=4;
ZeRO-2's backward transient (the most full gradient buckets alive at once) is measured too.
Then, from those measurements: state at DP=4 <= state at DP=1 / 4 + the unsharded remainder
the estimate states (ZeRO-2: the full parameters and step counters; FSDP2: the step counters;
both: the padding's share). The distributed optimizer's 8-byte ``_step_slot`` (used at saves)
is outside the estimate, as in test_theoretical_memory.
"""
import dataclasses

import pytest
import torch

from megatron.core import optimizer_instances
from megatron.core import parallel_state as ps
from megatron.core.distributed import (
    DistributedDataParallel,
    ddp_config_for_optimizer,
    finalize_model_grads,
)
from megatron.core.distributed.fsdp import TorchFSDP2Config
from megatron.core.models import LlamaModel
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.pipeline_parallel import build_model_chunks
from megatron.training.memory.base import FP32, ModelStateBytes
from megatron.training.memory.estimate import optimizer_setup_from
from megatron.training.memory.modes import rank_memory, rank_state_bytes
from megatron.training.training import build_model, train_step
from tests.distributed import run_distributed
from tests.unit.test_data_parallel import ADAM, MBS, SEQ, VOCAB, _config, _forward_step
from tests.unit.test_zero2 import (
    MICROBATCHES,
    FullGradTracker,
    _buckets,
    _build,
    _global_batches,
    _train,
)


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def _storages(tensors, exclude=()):
    found = {}
    for t in tensors:
        storage = _local(t).untyped_storage()
        if storage.data_ptr() not in exclude:
            found[storage.data_ptr()] = storage.nbytes()
    return found


def _measured(params, grads, optimizer) -> ModelStateBytes:
    """The distinct storages of each kind (main params/grads: those not the model's own)."""
    mains = [p for g in optimizer.optimizer.param_groups for p in g["params"]]
    states, steps = [], 0
    for main in mains:
        for key, value in optimizer.optimizer.state.get(main, {}).items():
            if key == "step":
                steps += value.numel() * value.element_size()
            else:
                states.append(value)
    param_storages, grad_storages = _storages(params), _storages(grads)
    return ModelStateBytes(
        params=sum(param_storages.values()), grads=sum(grad_storages.values()),
        main_params=sum(_storages(mains, exclude=param_storages).values()),
        main_grads=sum(_storages([m.grad for m in mains if m.grad is not None],
                                 exclude=grad_storages).values()),
        optimizer_states=sum(_storages(states).values()), step_counters=steps)


def _setup(model, optimizer):
    return optimizer_setup_from(model[0].ddp_config, optimizer.config,
                                ps.get_data_parallel_world_size())


# --- FSDP2 ---------------------------------------------------------------------------------

def _fsdp2_step(reshard, dtype, instances=1, offload=False):
    if instances > 1:  # HSDP: parallel_state's instance groups (run_distributed makes none)
        ps.initialize_model_parallel(1, 1, num_distributed_optimizer_instances=instances)
    config = _config(params_dtype=dtype,
                     pipeline_model_parallel_size=ps.get_pipeline_model_parallel_world_size(),
                     context_parallel_size=ps.get_context_parallel_world_size())
    model = build_model(lambda **stage: LlamaModel(config, VOCAB, **stage), config,
                        TorchFSDP2Config(reshard_after_forward=reshard,
                                         grad_reduce_in_fp32=True,
                                         num_distributed_optimizer_instances=instances,
                                         cpu_offload=offload),
                        seed=42)
    optimizer = get_megatron_optimizer(OptimizerConfig(bf16=dtype == torch.bfloat16,
                                                       optimizer_cpu_offload=offload, **ADAM),
                                       model)
    dp, rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    local = 4 // dp
    batch = _global_batches(4, steps=1)[0][rank * local:(rank + 1) * local]
    assert not train_step(_forward_step, iter(batch), model, optimizer, None, local, SEQ,
                          MBS)[1]
    params = list(model[0].module.parameters())
    measured = _measured(params, [p.grad for p in params], optimizer)
    # FSDP2 shards over DP x CP (HSDP: an instance's ranks): the setup's size and this
    # rank's place in that group.
    setup = optimizer_setup_from(model[0].ddp_config, optimizer.config, dp,
                                 ps.get_context_parallel_world_size())
    assert setup.fsdp2 and setup.reshard_after_forward == reshard
    assert setup.data_parallel_size == dp * ps.get_context_parallel_world_size() // instances
    estimate = rank_state_bytes(config, VOCAB, setup, ps.get_pipeline_model_parallel_rank(),
                                dtype.itemsize, optimizer_instances.shard_rank(),
                                share_embeddings_and_output_weights=False)
    if offload:  # everything on the host (here the CPU holds both): the estimate's host part
        memory = rank_memory(config, VOCAB, setup, ps.get_pipeline_model_parallel_rank(),
                             dtype.itemsize, optimizer_instances.shard_rank(),
                             share_embeddings_and_output_weights=False)
        assert memory.device.total == estimate.total == 0 and setup.cpu_offload
        group = model[0].module._get_fsdp_state()._fsdp_param_group  # torch's own record
        assert group.fsdp_params and all(p.offload_to_cpu for p in group.fsdp_params)
        estimate = memory.host
    return dataclasses.asdict(measured), dataclasses.asdict(estimate)


@pytest.mark.parametrize("reshard,dtype", [(True, torch.float32), (False, torch.float32),
                                           (True, torch.bfloat16)],
                         ids=["zero3-fp32", "zero2-fp32", "zero3-bf16"])
def test_fsdp2_state_estimate_equals_the_tensors_at_dp4(reshard, dtype):
    one = run_distributed(_fsdp2_step, world_size=1, tp=1, reshard=reshard, dtype=dtype)[0]
    four = run_distributed(_fsdp2_step, world_size=4, tp=1, reshard=reshard, dtype=dtype)
    for rank, (measured, estimate) in enumerate([one] + four):
        assert measured == estimate, rank
        assert measured["main_params"] == 0  # the fp32 shards are the main params
        assert min(measured["params"], measured["grads"], measured["optimizer_states"]) > 0
    # Sharded: params, grads, Adam moments (every dimension of this model divides by 4: no
    # padding). Unsharded remainder: one 4-byte step counter per parameter.
    remainder = one[0]["step_counters"]
    whole = sum(one[0].values()) - remainder
    for measured, _ in four:
        assert measured["step_counters"] == remainder
        assert sum(measured.values()) <= whole / 4 + remainder


@pytest.mark.parametrize("pp,cp", [(2, 1), (1, 2)], ids=["pp2-dp2", "cp2-dp2"])
def test_fsdp2_state_estimate_equals_the_tensors_with_pp_and_cp(pp, cp):
    """Each pipeline stage's chunk its own FSDP2 root (a stage's own layers and ends, not the
    first stage's), and the shards over DP x CP, to the byte on every rank."""
    four = run_distributed(_fsdp2_step, world_size=4, tp=1, pp=pp, cp=cp, reshard=True,
                           dtype=torch.float32)
    for rank, (measured, estimate) in enumerate(four):
        assert measured == estimate, rank
        assert min(measured["params"], measured["grads"], measured["optimizer_states"]) > 0
    if pp > 1:  # the two stages hold different parameters (the embedding, the output layer)
        assert four[0][0]["params"] != four[2][0]["params"]


def test_hsdp_fsdp2_state_estimate_equals_the_tensors():
    """HSDP at DP 4 (two instances of two): each rank holds what FSDP2 over two ranks holds,
    to the byte, and the same on both instances."""
    four = run_distributed(_fsdp2_step, world_size=4, reshard=True, dtype=torch.float32,
                           instances=2)
    two = run_distributed(_fsdp2_step, world_size=2, tp=1, reshard=True, dtype=torch.float32)
    for rank, (measured, estimate) in enumerate(four):
        assert measured == estimate == two[rank % 2][0], rank


def _held_unsharded_gradient_bytes(chunk) -> int:
    return sum(grad.nbytes for grad in chunk.held_gradients())


def _fsdp2_held_gradients_step():
    """PP2 under ZB-H1, or PP1 with reduce_gradients_once: both hold every reduction."""
    pp = ps.get_pipeline_model_parallel_world_size()
    config = _config(pipeline_model_parallel_size=pp,
                     pipeline_schedule="zb-h1" if pp > 1 else None)
    model = build_model(lambda **stage: LlamaModel(config, VOCAB, **stage), config,
                        TorchFSDP2Config(grad_reduce_in_fp32=True,
                                         reduce_gradients_once=pp == 1), seed=42)
    optimizer = get_megatron_optimizer(OptimizerConfig(**ADAM), model)
    held, reduce = [], model[0].finish_grad_sync

    def measure_then_reduce():
        held.append(_held_unsharded_gradient_bytes(model[0]))
        reduce()
    model[0].finish_grad_sync = measure_then_reduce
    rank, dp = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
    batch = _global_batches(4, steps=1)[0][rank * 2:(rank + 1) * 2]
    assert not train_step(_forward_step, iter(batch), model, optimizer, None, 2, SEQ, MBS)[1]
    setup = optimizer_setup_from(model[0].ddp_config, optimizer.config, dp)
    assert setup.fsdp2_reduce_once == (pp == 1)
    stage = ps.get_pipeline_model_parallel_rank()
    # the same run reducing per microbatch: 1F1B's schedule, no reduce-once
    per_microbatch = (dataclasses.replace(config, pipeline_schedule="1f1b" if pp > 1 else None),
                      dataclasses.replace(setup, fsdp2_reduce_once=False))
    transients = [rank_memory(c, VOCAB, s, stage, 4, rank,
                              share_embeddings_and_output_weights=False).transient_bytes
                  for c, s in ((config, setup), per_microbatch)]
    after = _held_unsharded_gradient_bytes(model[0])
    return held, after, transients, sum(p.numel() for p in model[0].module.parameters()) * 4


@pytest.mark.parametrize("pp", [2, 1], ids=["pp2-zb-h1", "pp1-reduce-once"])
def test_fsdp2_held_reductions_hold_the_estimated_unsharded_gradients(pp):
    """Under ZB-H1 (PP2 x DP2), or with reduce_gradients_once (DP2, two microbatches), fp32,
    ZeRO-3, FSDP2 reduces once, after the last backward: just before it every parameter of the
    stage holds its whole unsharded gradient, none after. The estimate's transient is the
    per-microbatch one with the two layers' gradients in flight replaced by all of them: half
    of it (its gathered layers, fp32 like their gradients) plus what was measured held."""
    world = 2 * pp
    for held, after, (once, per_microbatch), stage_bytes in run_distributed(
            _fsdp2_held_gradients_step, world_size=world, tp=1, pp=pp):
        assert held == [stage_bytes] and after == 0
        assert once == per_microbatch // 2 + stage_bytes


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_fsdp2_cpu_offload_host_estimate_equals_the_tensors(dtype):
    """FSDP2 with torch's CPUOffloadPolicy at DP 2: the fp32 shards, their gradients (each
    rank's unpadded shard, copied to the host in fp32) and Adam's state are the estimate's
    host bytes; nothing of the state stays on the device."""
    for rank, (measured, estimate) in enumerate(run_distributed(
            _fsdp2_step, world_size=2, tp=1, reshard=True, dtype=dtype, offload=True)):
        assert measured == estimate, rank
        assert min(measured["params"], measured["grads"], measured["optimizer_states"]) > 0


# --- ZeRO-2 for the distributed optimizer --------------------------------------------------

def _zero2_step(dtype):
    chunks, optimizer = _build("distributed", True, dtype)
    tracker = FullGradTracker(chunks)
    _train(chunks, optimizer, _global_batches(MICROBATCHES // 2, steps=1), tracker)
    buckets = _buckets(chunks)
    assert all(b.full_grad_released for b in buckets)
    params = [p for chunk in chunks for p in chunk.module.parameters()]
    measured = _measured(params, [b.grad_shard for b in buckets], optimizer)
    setup = _setup(chunks, optimizer)
    assert setup.shard_gradients and setup.use_distributed_optimizer
    memory = rank_memory(chunks[0].config, VOCAB, setup, 0, dtype.itemsize,
                         ps.get_data_parallel_rank(), share_embeddings_and_output_weights=False)
    padding = sum(b.numel for b in buckets) - sum(p.numel() for p in params)
    return dict(measured=dataclasses.asdict(measured),
                estimate=dataclasses.asdict(memory.device),
                transient=(tracker.peak, memory.transient_bytes), padding=padding)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_zero2_state_estimate_equals_the_tensors_at_dp4(dtype):
    one = run_distributed(_zero2_step, world_size=1, tp=1, dtype=dtype)[0]
    four = run_distributed(_zero2_step, world_size=4, tp=1, dtype=dtype)
    for rank, result in enumerate([one] + four):
        assert result["measured"] == result["estimate"], rank
    # The full buckets of backward, next to the shards: all of them with 4 microbatches
    # (DP=1), exact; fewer at once with one microbatch (DP=4): the estimate bounds them.
    assert one["padding"] == 0 and one["transient"][0] == one["transient"][1] > 0
    for r in four:
        assert 0 < r["transient"][0] <= r["transient"][1] == 4 * r["measured"]["grads"]
    # Unsharded remainder (the estimate's): the full model parameters and the step counters;
    # sharded: gradients, fp32 main params (bf16), Adam moments, plus the padding's share.
    per_element = FP32 + 2 * FP32 + (FP32 if dtype == torch.bfloat16 else 0)
    sharded_one = sum(one["measured"].values()) - one["measured"]["params"] - \
        one["measured"]["step_counters"]
    for result in four:
        m = result["measured"]
        remainder = m["params"] + m["step_counters"] + result["padding"] * per_element / 4
        assert sum(m.values()) <= sharded_one / 4 + remainder


# --- CPU offload ---------------------------------------------------------------------------

def _offload_step(distributed):
    config = _config(params_dtype=torch.bfloat16)
    opt_config = OptimizerConfig(use_distributed_optimizer=distributed, bf16=True,
                                 optimizer_cpu_offload=True, **ADAM)
    ddp = ddp_config_for_optimizer(opt_config, grad_reduce_in_fp32=True, bucket_size=3000)
    torch.manual_seed(1)
    chunks = [DistributedDataParallel(config, ddp, chunk) for chunk in build_model_chunks(
        lambda **stage: LlamaModel(config, VOCAB, **stage), config)]
    config.finalize_model_grads_func = finalize_model_grads
    optimizer = get_megatron_optimizer(opt_config, chunks)
    _train(chunks, optimizer, _global_batches(4, steps=1))
    params = [p for chunk in chunks for p in chunk.module.parameters()]
    grads = [b.grad_data for b in _buckets(chunks)]
    # the optimizer's own tensors: none is the model's parameters or gradient buckets
    host = _measured([], [], optimizer)
    on_device = _measured(params, grads, optimizer)
    assert (on_device.main_params, on_device.main_grads) == (host.main_params, host.main_grads)
    memory = rank_memory(config, VOCAB, _setup(chunks, optimizer), 0, 2,
                         ps.get_data_parallel_rank(), share_embeddings_and_output_weights=False)
    device = dataclasses.asdict(memory.device)
    assert device["main_params"] == device["optimizer_states"] == 0
    return dataclasses.asdict(host), dataclasses.asdict(memory.host)


@pytest.mark.parametrize("distributed", [True, False], ids=["distributed", "plain"])
def test_cpu_offload_host_estimate_equals_the_optimizers_tensors(distributed):
    for measured, estimate in run_distributed(_offload_step, world_size=2, tp=1,
                                              distributed=distributed):
        assert measured == estimate and measured["optimizer_states"] > 0
