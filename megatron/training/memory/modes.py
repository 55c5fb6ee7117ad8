"""What the memory modes of issue 27 change in a rank's parameters, gradients and optimizer
state: ZeRO-2 for the distributed optimizer (``--shard-gradients``), torch FSDP2
(``--use-torch-fsdp2``, ZeRO-3, or ZeRO-2 with ``--no-reshard-after-forward``) and optimizer
CPU offload (``--optimizer-cpu-offload``).

Three amounts per rank (``RankMemory``):

- ``device``: what the device holds after the optimizer step (``params``' kinds),
  exact for this code base (tests/unit/test_memory_modes.py measures it);
- ``host``: CPU offload's main params, their gradients, the optimizer state and step counters
  in host memory (exact; pinned allocations on CUDA may be rounded up by the allocator);
- ``transient_bytes``: held on top of ``device`` during forward/backward only. ZeRO-2
  (distributed optimizer): the full gradient buckets, on top of the persistent shard buffers
  ``device`` counts (exact with gradient accumulation: every bucket lives from the first
  microbatch's backward to the reduction; an upper bound with one microbatch, where each
  bucket is freed once reduced and only a few coexist). FSDP2: the all-gathered compute-dtype
  parameters (ZeRO-3: the root unit - embedding, final norm, output layer, which FSDP2 keeps
  unsharded after forward - plus two layers, the running one and the prefetched one; ZeRO-2:
  every unit, kept from its forward to its backward) and the unsharded gradients before their
  reduce-scatter (the root's and two layers': each microbatch's are reduce-scattered into the
  sharded gradients, not accumulated unsharded). The FSDP2 transient is a
  stated estimate (all-gather and reduce-scatter buffers of the collectives aside), not a
  measurement.

Bytes per parameter of the device state (N parameters, d = DP size, bf16 params with fp32
gradients, Adam; padding and step counters aside): after the step, at the backward peak
(activations aside), and in host memory:

                                          after step   backward peak            host
    DDP                                   18           18                       -
    distributed optimizer                 6 + 12/d     6 + 12/d                 -
    distributed optimizer, ZeRO-2         2 + 16/d     6 + 16/d (accumulating)  -
    FSDP2 ZeRO-3                          16/d         16/d + gathered, grads   -
    FSDP2 ZeRO-2                          16/d         16/d + 2 + grads         -
    FSDP2 ZeRO-3, CPU offload             0            gathered, grads          16/d
    CPU offload, plain optimizer          6            6                        16
    CPU offload, distributed optimizer    6            6                        16/d
    CPU offload, distributed, ZeRO-2      2 + 4/d      6 + 4/d                  16/d
"""
import dataclasses
import math
from dataclasses import dataclass, field
from typing import List

from megatron.training.memory.base import FP32, ModelStateBytes, OptimizerSetup, ParamShape
from megatron.training.memory.fp8 import fp8_weight_cache_bytes
from megatron.training.memory.moe import expert_data_parallel_size, is_expert_param
from megatron.training.memory.params import (
    _shard_states,
    add_states,
    bucket_layout,
    chunk_state_bytes,
    rank_chunks,
)
from megatron.training.memory.schedules import is_zero_bubble

FSDP_PREFETCHED_LAYERS = 2  # the layer running and the next one, gathered ahead


@dataclass
class RankMemory:
    device: ModelStateBytes = field(default_factory=ModelStateBytes)
    host: ModelStateBytes = field(default_factory=ModelStateBytes)
    transient_bytes: int = 0


def mode_name(setup: OptimizerSetup) -> str:
    if setup.fsdp2:
        name = "FSDP2 " + ("ZeRO-3" if setup.reshard_after_forward else "ZeRO-2")
    else:
        name = "distributed optimizer" if setup.use_distributed_optimizer else "DDP"
    if setup.shard_gradients:
        name += " ZeRO-2"
    return name + (" + CPU offload" if setup.cpu_offload else "")


# --- FSDP2 ---------------------------------------------------------------------------------

def _fsdp_units(shapes: List[ParamShape]) -> List[List[ParamShape]]:
    """fully_shard units: one per transformer layer, then the root (everything else)."""
    layers, root = {}, []
    for shape in shapes:
        if shape.name.startswith("decoder.layers."):
            layers.setdefault(shape.name.split(".")[2], []).append(shape)
        else:
            root.append(shape)
    return list(layers.values()) + [root]


def _padded_shard(shape: ParamShape, dp: int) -> int:
    """Elements of FSDP2's padded shard of ``shape`` (dim 0 split in chunks of ceil(rows/DP))."""
    return math.ceil(shape.dim0 / dp) * (shape.numel // shape.dim0)


def _local_shard(shape: ParamShape, dp: int, rank: int) -> int:
    """Elements of this rank's unpadded shard (torch.chunk: the last ranks get fewer rows)."""
    rows = math.ceil(shape.dim0 / dp)
    mine = max(0, min(rows, shape.dim0 - rank * rows))
    return mine * (shape.numel // shape.dim0)


def fsdp2_chunk_state(shapes: List[ParamShape], setup: OptimizerSetup, param_bytes: int,
                      rank: int) -> ModelStateBytes:
    """FSDP2: every parameter an fp32 DTensor shard (padded storage: they are the main params
    too); each unit's gradients one reduce-scatter output of the padded shards (fp32 when
    reduced in fp32), the optimizer state the unpadded local shards."""
    dp = setup.data_parallel_size
    reduce_bytes = FP32 if setup.grad_reduce_in_fp32 else param_bytes
    state = ModelStateBytes()
    state.params = sum(_padded_shard(s, dp) for s in shapes) * FP32
    if setup.cpu_offload:  # each reduced local shard copied to the host in fp32
        state.grads = sum(_local_shard(s, dp, rank) for s in shapes) * FP32
    elif reduce_bytes == FP32:
        state.grads = state.params
    else:  # the reduce-scatter output, then an fp32 copy of each local shard
        state.grads = sum(_padded_shard(s, dp) for s in shapes) * reduce_bytes
        state.main_grads = sum(_local_shard(s, dp, rank) for s in shapes) * FP32
    state.optimizer_states = setup.states_per_element() * FP32 * sum(
        _local_shard(s, dp, rank) for s in shapes)
    state.step_counters = len(shapes) * FP32 if setup.has_step_counters() else 0
    return state


def fsdp2_rank_chunk_state(config, shapes: List[ParamShape], setup: OptimizerSetup,
                           param_bytes: int, rank: int) -> ModelStateBytes:
    """One chunk on one rank: the dense parameters sharded over DP x CP, the routed experts'
    over the expert-DP group (their own fully_shard, fsdp.py), as DDP's buffers are."""
    experts = [s for s in shapes if is_expert_param(s)]
    state = fsdp2_chunk_state([s for s in shapes if not is_expert_param(s)], setup,
                              param_bytes, rank)
    if experts:
        expert_setup = dataclasses.replace(setup, data_parallel_size=expert_data_parallel_size(
            config, setup.data_parallel_size))
        add_states(state, fsdp2_chunk_state(experts, expert_setup, param_bytes,
                                            rank % expert_setup.data_parallel_size))
    return state


def fsdp2_state_bytes(config, padded_vocab_size: int, setup: OptimizerSetup, rank: int,
                      share_embeddings_and_output_weights: bool = True,
                      pipeline_rank: int = 0) -> ModelStateBytes:
    """Every chunk of one pipeline rank (each chunk its own FSDP2 root, its stage's shapes)."""
    total = ModelStateBytes()
    for shapes, _ in rank_chunks(config, padded_vocab_size, pipeline_rank,
                                 share_embeddings_and_output_weights):
        add_states(total, fsdp2_rank_chunk_state(config, shapes, setup,
                                                 config.params_dtype.itemsize, rank))
    return total


def fsdp2_transient_bytes(shapes: List[ParamShape], setup: OptimizerSetup,
                          param_bytes: int, hold_gradients: bool = False) -> int:
    """Gathered compute-dtype parameters and unsharded gradients (module docstring). With
    ``hold_gradients`` (fsdp.py's reduce_gradients_once, and the zero-bubble schedules:
    each unit reduced once, after the last backward / W)
    every unit's unsharded gradients are held in the reduce dtype, plus the units' fresh
    compute-dtype gradients in flight where the two dtypes differ."""
    dp = setup.data_parallel_size
    units = [sum(_padded_shard(s, dp) * dp for s in unit) for unit in _fsdp_units(shapes)]
    layers, root = sorted(units[:-1], reverse=True), units[-1]
    in_flight = root + sum(layers[:FSDP_PREFETCHED_LAYERS])
    gathered = in_flight if setup.reshard_after_forward else sum(units)
    reduce_bytes = FP32 if setup.grad_reduce_in_fp32 else param_bytes
    if hold_gradients:
        fresh = in_flight * param_bytes if reduce_bytes != param_bytes else 0
        return gathered * param_bytes + sum(units) * reduce_bytes + fresh
    return gathered * param_bytes + in_flight * reduce_bytes  # grads reduced per microbatch


# --- CPU offload -----------------------------------------------------------------------------

def host_state_bytes(shapes: List[ParamShape], setup: OptimizerSetup, data_parallel_rank: int,
                     alone=lambda shape: False) -> ModelStateBytes:
    """CPU offload: fp32 main params (of every parameter, fp32 ones too) and an fp32 gradient
    buffer for them, the optimizer state and step counters, in host memory; the distributed
    optimizer's are this rank's shard of each bucket (padding included)."""
    host = ModelStateBytes()
    if not setup.use_distributed_optimizer:
        numel = sum(s.numel for s in shapes)
        host.main_params = host.main_grads = numel * FP32
        host.optimizer_states = sum(setup.states_of(s) * s.numel for s in shapes) * FP32
        host.step_counters = sum(setup.steps_of(s) for s in shapes) * FP32
        return host
    dp = setup.data_parallel_size
    for group, padded in bucket_layout(shapes, setup, alone):
        steps, state_elements = _shard_states(group, padded, dp, data_parallel_rank, setup)
        host.main_params += padded // dp * FP32
        host.main_grads += padded // dp * FP32
        host.optimizer_states += state_elements * FP32
        host.step_counters += steps * FP32
    return host


# --- one rank ------------------------------------------------------------------------------

def rank_memory(config, padded_vocab_size: int, setup: OptimizerSetup, pipeline_rank: int,
                param_bytes: int, data_parallel_rank: int = 0,
                share_embeddings_and_output_weights: bool = True) -> RankMemory:
    """Device state after the step, host state, and what forward/backward adds (docstring)."""
    share = share_embeddings_and_output_weights
    memory = RankMemory()
    if setup.fsdp2:  # each chunk its own root; transients summed over chunks (a bound)
        for shapes, _ in rank_chunks(config, padded_vocab_size, pipeline_rank, share):
            step = fsdp2_rank_chunk_state(config, shapes, setup, param_bytes,
                                          data_parallel_rank)
            if setup.cpu_offload:  # torch's CPUOffloadPolicy: all of it on the host
                add_states(memory.host, step)
                step = ModelStateBytes()
            step.fp8_weights = fp8_weight_cache_bytes(config, shapes)
            add_states(memory.device, step)
            memory.transient_bytes += fsdp2_transient_bytes(
                shapes, setup, param_bytes, setup.fsdp2_reduce_once or is_zero_bubble(config))
        return memory
    full_grads = dataclasses.replace(setup, shard_gradients=False)
    for shapes, alone in rank_chunks(config, padded_vocab_size, pipeline_rank, share):
        step = chunk_state_bytes(shapes, setup, param_bytes, data_parallel_rank, alone)
        step.fp8_weights = fp8_weight_cache_bytes(config, shapes)
        add_states(memory.device, step)
        if setup.cpu_offload:
            add_states(memory.host, host_state_bytes(shapes, setup, data_parallel_rank, alone))
        if setup.shard_gradients:  # the full buckets of backward, next to the shards
            backward = chunk_state_bytes(shapes, full_grads, param_bytes, data_parallel_rank,
                                         alone)
            memory.transient_bytes += backward.grads
    return memory


def rank_state_bytes(config, padded_vocab_size: int, setup: OptimizerSetup,
                     pipeline_rank: int, param_bytes: int, data_parallel_rank: int = 0,
                     share_embeddings_and_output_weights: bool = True) -> ModelStateBytes:
    """Every chunk of one pipeline rank, on the device, after the optimizer step."""
    if setup.fsdp2 and setup.cpu_offload:
        return ModelStateBytes()  # the shards, gradients and state live on the host
    if setup.fsdp2:
        return fsdp2_state_bytes(config, padded_vocab_size, setup, data_parallel_rank,
                                 share_embeddings_and_output_weights, pipeline_rank)
    total = ModelStateBytes()
    expert_setup = dataclasses.replace(
        setup, data_parallel_size=expert_data_parallel_size(config, setup.data_parallel_size))
    for shapes, alone in rank_chunks(config, padded_vocab_size, pipeline_rank,
                                     share_embeddings_and_output_weights):
        # Routed experts have DDP buffers of their own, sharded over the expert-DP group.
        experts = [s for s in shapes if is_expert_param(s)]
        dense = [s for s in shapes if not is_expert_param(s)]
        dense_state = chunk_state_bytes(dense, setup, param_bytes, data_parallel_rank, alone)
        dense_state.fp8_weights = fp8_weight_cache_bytes(config, dense)
        add_states(total, dense_state)
        if experts:
            add_states(total, chunk_state_bytes(
                experts, expert_setup, param_bytes,
                data_parallel_rank % expert_setup.data_parallel_size))
    return total
