"""Per-rank memory estimate of a training configuration, before anything is allocated.

    estimate = estimate_memory(transformer_config, padded_vocab_size=32000, seq_length=4096,
                               micro_batch_size=1, num_microbatches=64,
                               setup=OptimizerSetup(data_parallel_size=8,
                                                    use_distributed_optimizer=True))
    print(format_report(estimate))

Parameters, gradients and optimizer state come from ``params`` (exact for this code
base); activations from ``activations`` (Korthikanti et al.'s terms for these layers,
times the microbatches a stage holds at the peak of its schedule; under zb-h1 / zbv also the
deferred weight-gradient inputs between each B and its W, ``schedules``).
``pretrain()`` prints the report on rank 0 at start. Not counted: the CUDA context and
allocator caching/fragmentation, communication buffers, and temporaries of single kernels
(e.g. the logits' gradient), which is why real peaks sit somewhat above the estimate.

Context parallelism (``config.context_parallel_size``): activations are those of s/CP tokens
(``activations``), plus the ring's K/V block in flight, reported on its own line; the
parameters and gradients do not change, and the distributed optimizer shards over DP x CP
(``OptimizerSetup.data_parallel_size`` is that group's size: ``optimizer_setup_from``).
"""
from dataclasses import dataclass, field
from typing import List

import torch

from megatron.core.distributed.distributed_data_parallel import bucket_size_for
from megatron.training.memory.activations import (
    ActivationSetup,
    StageActivations,
    layer_bytes,
    stage_activations,
)
from megatron.training.memory.base import ModelStateBytes, OptimizerSetup
from megatron.training.memory.modes import mode_name, rank_memory

GIB = 1024 ** 3


def dtype_bytes(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


@dataclass
class StageMemory:
    pipeline_rank: int
    state: ModelStateBytes  # on the device after the optimizer step
    activations: StageActivations
    # Held during forward/backward only (ZeRO-2's full gradient buckets, FSDP2's gathered
    # parameters and unsharded gradients: modes.py) and CPU offload's host state.
    transient_bytes: int = 0
    host: ModelStateBytes = field(default_factory=ModelStateBytes)

    @property
    def total(self) -> int:
        """The device peak: the state, what backward adds to it, and the activations."""
        return self.state.total + self.transient_bytes + self.activations.peak_bytes


@dataclass
class MemoryEstimate:
    stages: List[StageMemory] = field(default_factory=list)
    layer_activation_bytes: int = 0  # one layer, one microbatch, under the config's recompute
    mode: str = "DDP"  # modes.mode_name

    @property
    def peak(self) -> StageMemory:
        return max(self.stages, key=lambda stage: stage.total)

    @property
    def max_total(self) -> int:
        return self.peak.total


def estimate_memory(config, *, padded_vocab_size: int, seq_length: int, micro_batch_size: int,
                    num_microbatches: int, setup: OptimizerSetup,
                    share_embeddings_and_output_weights: bool = True,
                    data_parallel_rank: int = 0, device: str = "cuda") -> MemoryEstimate:
    """Every pipeline rank's estimate (one TP / DP rank each: TP ranks hold the same amounts;
    DP ranks differ only in the distributed optimizer's per-tensor step counters). Under
    context parallelism ``setup.data_parallel_size`` is DP x CP (the group gradients are
    reduced over and the distributed optimizer shards over) and ``data_parallel_rank`` the rank
    in it; ``seq_length`` is the whole sequence (each rank holds s/CP of it)."""
    element = dtype_bytes(config.params_dtype)
    activation_setup = ActivationSetup(seq_length, micro_batch_size, element,
                                       padded_vocab_size, device)
    estimate = MemoryEstimate(layer_activation_bytes=layer_bytes(
        config, activation_setup,
        config.recompute_granularity if config.recompute_granularity == "selective" else None),
        mode=mode_name(setup))
    for rank in range(config.pipeline_model_parallel_size):
        state = rank_memory(config, padded_vocab_size, setup, rank, element,
                            data_parallel_rank, share_embeddings_and_output_weights)
        activations = stage_activations(config, activation_setup, rank, num_microbatches)
        estimate.stages.append(StageMemory(rank, state.device, activations,
                                           state.transient_bytes, state.host))
    return estimate


def _gib(value: int) -> str:
    """GiB with 3 decimals, or a smaller unit for small (test) models."""
    for unit, size in (("GiB", GIB), ("MiB", 2 ** 20), ("KiB", 2 ** 10)):
        if value >= size:
            return f"{value / size:.3f} {unit}"
    return f"{value} B"


def format_report(estimate: MemoryEstimate) -> str:
    """The table pretrain() prints: per pipeline rank, state by kind and activations."""
    lines = [f"theoretical memory per rank, {estimate.mode} (one TP/CP/DP rank of each "
             "pipeline stage; excludes the CUDA context, allocator fragmentation and "
             "communication buffers):"]
    for stage in estimate.stages:
        s, a = stage.state, stage.activations
        optimizer = s.main_params + s.main_grads + s.optimizer_states + s.step_counters
        recompute = (f" + {_gib(a.recompute_working_bytes)} recompute working set"
                     if a.recompute_working_bytes else "")
        if a.deferred:  # zero-bubble schedules: W records between B and W (schedules.py)
            recompute = (f" (of which {_gib(a.weight_grad_bytes)} deferred weight-gradient "
                         f"inputs of {a.deferred} backward(s) awaiting W)") + recompute
        if a.cp_kv_in_flight_bytes:  # the context-parallel ring's send and receive buffers
            recompute += f" + {_gib(a.cp_kv_in_flight_bytes)} cp kv in flight"
        if a.moe_dispatch_bytes:  # the MoE dispatcher's rows of one layer in flight
            recompute += f" + {_gib(a.moe_dispatch_bytes)} moe dispatch buffers"
        if stage.transient_bytes:  # ZeRO-2 / FSDP2: state after the step vs. backward's peak
            recompute += (f" + {_gib(stage.transient_bytes)} during forward/backward only "
                          f"(full gradient buckets / gathered parameters)")
        if s.fp8_weights:  # the FP8 layers' cached quantized weights
            recompute += f"; fp8 weights {_gib(s.fp8_weights)}"
        if stage.host.total:
            recompute += f"; host (CPU offload) {_gib(stage.host.total)}"
        lines.append(
            f"  pipeline rank {stage.pipeline_rank}: params {_gib(s.params)}, "
            f"grads {_gib(s.grads)}, optimizer {_gib(optimizer)} (main params "
            f"{_gib(s.main_params)}, main grads {_gib(s.main_grads)}, states "
            f"{_gib(s.optimizer_states)}); activations {_gib(a.stored_bytes)} for "
            f"{a.in_flight} microbatch(es) in flight{recompute}; total {_gib(stage.total)}")
    lines.append(f"  peak: {_gib(estimate.max_total)} on pipeline rank "
                 f"{estimate.peak.pipeline_rank}; one layer's activations per microbatch: "
                 f"{_gib(estimate.layer_activation_bytes)}")
    return "\n".join(lines)


def optimizer_setup_from(ddp_config, optimizer_config, data_parallel_size: int,
                         context_parallel_size: int = 1) -> OptimizerSetup:
    """What the DDP and optimizer configs of a run give the estimate. Gradients are reduced,
    and the distributed optimizer (FSDP2) sharded, over DP x CP; under HSDP over one
    instance's DP x CP / N ranks, each instance holding what a flat run over that many ranks
    holds: that is the size the setup holds (the bucket size stays DDP's, from DP x CP)."""
    data_parallel_size *= context_parallel_size
    bucket_size = bucket_size_for(ddp_config, data_parallel_size)
    instances = getattr(ddp_config, "num_distributed_optimizer_instances", 1)
    return OptimizerSetup(
        data_parallel_size=data_parallel_size // instances,
        use_distributed_optimizer=ddp_config.use_distributed_optimizer,
        grad_reduce_in_fp32=ddp_config.grad_reduce_in_fp32,
        bucket_size=bucket_size,
        optimizer=optimizer_config.optimizer, sgd_momentum=optimizer_config.sgd_momentum,
        shard_gradients=ddp_config.shard_gradients,
        fsdp2=getattr(ddp_config, "use_torch_fsdp2", False),
        reshard_after_forward=getattr(ddp_config, "reshard_after_forward", True),
        fsdp2_reduce_once=getattr(ddp_config, "reduce_gradients_once", False),
        cpu_offload=optimizer_config.optimizer_cpu_offload)


def estimate_from_configs(configs, seq_length: int, device: str = "cuda") -> MemoryEstimate:
    """The estimate of a parsed command line (``MegatronConfigs``)."""
    t = configs.training
    setup = optimizer_setup_from(configs.ddp, configs.optimizer, t.data_parallel_size,
                                 configs.transformer.context_parallel_size)
    return estimate_memory(
        configs.transformer, padded_vocab_size=configs.model_kwargs["padded_vocab_size"],
        seq_length=seq_length, micro_batch_size=t.micro_batch_size,
        num_microbatches=t.global_batch_size // (t.micro_batch_size * t.data_parallel_size),
        setup=setup,
        share_embeddings_and_output_weights=configs.model_kwargs[
            "share_embeddings_and_output_weights"], device=device)


def report_theoretical_memory(configs, seq_length: int, device: str) -> str:
    """What ``pretrain()`` prints on rank 0 before the first iteration."""
    return format_report(estimate_from_configs(configs, seq_length, device))
