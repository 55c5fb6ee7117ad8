"""Enumerate layouts, keep those whose memory estimate fits, rank them by estimated MFU."""
from dataclasses import dataclass, field
from typing import Dict, List, Optional

from megatron.core.fp8.param_gather import GATHERED_RECIPES
from megatron.core.transformer.attention import math_attention_reason
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.utils import vocab_size_with_padding
from megatron.training.arguments.configs import transformer_config_from_args
from megatron.training.memory.estimate import GIB, MemoryEstimate, estimate_memory
from megatron.training.planner.layouts import (
    CP_MIN_SEQ_LENGTH,
    MEMORY_MODES,
    MODE_FLAGS,
    Layout,
    apply_layout,
    layout_families,
    optimizer_setup,
    overlapped_optimizer_flags,
)
from megatron.training.planner.step_time import Cluster, StepTime, estimate_step_time
from megatron.training.planner.workload import Workload
from megatron.training.training_config import ConfigError


@dataclass
class PlanRow:
    layout: Layout
    config: TransformerConfig
    padded_vocab_size: int
    memory: MemoryEstimate
    step: StepTime
    flags: List[str]
    # Megatron-LLaMA's --overlapped-distributed-optimizer instead (sharded rows only)
    overlapped_optimizer_flags: Optional[List[str]] = None
    overlapped_optimizer_bytes: Optional[int] = None


@dataclass
class Plan:
    rows: List[PlanRow] = field(default_factory=list)  # ranked, best first
    enumerated: int = 0
    fitting: int = 0
    memory_mode: Optional[str] = None  # the mode every row uses when none fits without one
    # The best fitting row of each side of the MoE choices (EP 1 or > 1, PP 1 or > 1), against
    # which the report explains the pick; a side without a fitting row is absent.
    best_by_choice: Dict[str, "PlanRow"] = field(default_factory=dict)


def padded_vocab(workload: Workload, tensor_parallel: int) -> int:
    return vocab_size_with_padding(workload.vocab_size,
                                   workload.args.make_vocab_size_divisible_by, tensor_parallel)


def schedule_microbatches(layout: Layout) -> int:
    """Microbatches that give the same activation peak as the layout's, walking fewer steps:
    after its warmup (< 3 PP forwards) a rank alternates forward and backward with chunks
    repeating every PP x VPP steps, so the live set repeats too and the peak is reached within
    one period; from 4 PP microbatches on it no longer changes (tested against the full walk)."""
    return min(layout.num_microbatches, 4 * layout.pipeline_parallel)


def layout_memory(workload: Workload, layout: Layout, config: TransformerConfig,
                  overlapped_optimizer: bool = False) -> MemoryEstimate:
    """``estimate_memory`` of ``layout`` (its TransformerConfig ``config``)."""
    args = workload.args
    return estimate_memory(
        config, padded_vocab_size=padded_vocab(workload, layout.tensor_parallel),
        seq_length=workload.seq_length, micro_batch_size=layout.micro_batch_size,
        num_microbatches=schedule_microbatches(layout),
        setup=optimizer_setup(args, layout, overlapped_optimizer),
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights)


def layout_config(workload: Workload, layout: Layout) -> TransformerConfig:
    return transformer_config_from_args(apply_layout(workload.args, layout))


def rank_key(row: PlanRow):
    """Best MFU first (rounded, so float noise does not split ties), then less memory."""
    return (-round(row.step.mfu, 9), row.memory.max_total)


def plan(workload: Workload, cluster: Cluster, *, top: Optional[int] = None,
         max_micro_batch_size: int = 16, grad_reduce_in_fp32: bool = True) -> Plan:
    """Every layout that fits, ranked; ConfigError (saying what to change) when none does.
    Context parallelism is tried from CP_MIN_SEQ_LENGTH on, or when layouts exist but none
    fits in memory without it (not to soak up GPUs a short sequence cannot use otherwise).
    When still none fits, the memory modes (MEMORY_MODES) are tried, cheapest first, and the
    first that gives fitting layouts is proposed (``Plan.memory_mode``)."""
    cluster.check()
    if max_micro_batch_size < 1:
        raise ConfigError(f"--max-micro-batch-size must be >= 1, got {max_micro_batch_size}.")
    with_cp = workload.seq_length >= CP_MIN_SEQ_LENGTH
    result, smallest = _search(workload, cluster, max_micro_batch_size, grad_reduce_in_fp32,
                               with_cp)
    if smallest is not None and not result.rows and not with_cp:  # layouts, none fits
        with_cp = True
        result, smallest = _search(workload, cluster, max_micro_batch_size,
                                   grad_reduce_in_fp32, True)
    muon = getattr(workload.args, "optimizer", "adam") == "muon"  # refuses every memory mode
    for mode in MEMORY_MODES if smallest is not None and not result.rows and not muon else ():
        found, _ = _search(workload, cluster, max_micro_batch_size, grad_reduce_in_fp32,
                           with_cp, mode)
        result.enumerated += found.enumerated
        if found.rows:
            result.rows, result.memory_mode = found.rows, mode
            break
    if smallest is None:
        raise ConfigError(_nothing_to_try(workload, cluster))
    if not result.rows:
        raise ConfigError(_nothing_fits(cluster, *smallest))
    result.fitting = len(result.rows)
    result.rows.sort(key=rank_key)
    for row in result.rows:  # ranked: the first of each side is its best
        for side in (f"EP {'1' if row.layout.expert_parallel == 1 else '> 1'}",
                     f"PP {'1' if row.layout.pipeline_parallel == 1 else '> 1'}"):
            result.best_by_choice.setdefault(side, row)
    result.rows = result.rows[:top] if top else result.rows
    for row in result.rows:
        if row.layout.distributed_optimizer and row.layout.memory_mode is None and not muon:
            row.overlapped_optimizer_flags = overlapped_optimizer_flags(
                workload.args.reduce_bucket_size)
            row.overlapped_optimizer_bytes = layout_memory(
                workload, row.layout, row.config, overlapped_optimizer=True).max_total
    return result


def _search(workload: Workload, cluster: Cluster, max_micro_batch_size: int,
            grad_reduce_in_fp32: bool, with_cp: bool, memory_mode: Optional[str] = None):
    """(unranked Plan of the layouts that fit, (layout, bytes) of the smallest estimate)."""
    budget = (cluster.gpu_memory_gib - cluster.memory_reserve_gib) * GIB
    result, smallest = Plan(), None
    for family in layout_families(workload.args, cluster.num_gpus, cluster.gpus_per_node,
                                  workload.global_batch_size, max_micro_batch_size,
                                  grad_reduce_in_fp32, with_cp, memory_mode):
        for layout in family:  # ascending micro batch: stop at the first that does not fit
            config = layout_config(workload, layout)
            if layout.recompute == "selective" and (
                    layout.context_parallel > 1 or math_attention_reason(config, "cuda") is None):
                # Fused (or CP) attention keeps no s x s scores: selective recomputation is a
                # no-op (attention.py), the same layout as no recomputation.
                break
            result.enumerated += 1
            memory = layout_memory(workload, layout, config)
            if smallest is None or memory.max_total < smallest[1]:
                smallest = (layout, memory.max_total)
            if memory.max_total > budget:
                result.enumerated += len(family) - family.index(layout) - 1
                break
            vocab = padded_vocab(workload, layout.tensor_parallel)
            fp8_gather = fp8_param_gather_applies(workload, layout)
            step = estimate_step_time(config, layout, cluster, memory, workload.seq_length, vocab,
                                      fp8_gather)
            flags = layout.flags(workload.args.num_layers)
            result.rows.append(PlanRow(layout, config, vocab, memory, step,
                                       flags + (["--fp8-param-gather"] if fp8_gather else [])))
    return result, smallest


def fp8_param_gather_applies(workload: Workload, layout: Layout) -> bool:
    """An FP8 workload whose recipe the distributed optimizer gathers in FP8, on a layout with
    that optimizer: proposed with --fp8-param-gather (half the gathered weight bytes, the
    same numbers: fp8/param_gather.py)."""
    args = workload.args
    return (getattr(args, "fp8_format", None) is not None
            and args.fp8_recipe in GATHERED_RECIPES and layout.distributed_optimizer
            and not layout.fsdp2)


def _describe(layout: Layout) -> str:
    cp = f", CP {layout.context_parallel}" if layout.context_parallel > 1 else ""
    return (f"TP {layout.tensor_parallel}{cp}, PP {layout.pipeline_parallel}, micro batch "
            f"{layout.micro_batch_size}, {layout.recompute or 'no'} recomputation"
            f"{', distributed optimizer' if layout.distributed_optimizer else ''}")


def _nothing_fits(cluster: Cluster, layout: Layout, smallest: int) -> str:
    return (f"no layout fits in {cluster.gpu_memory_gib:g} GiB per GPU minus the "
            f"{cluster.memory_reserve_gib:g} GiB reserve: the smallest estimate is "
            f"{smallest / GIB:.1f} GiB ({_describe(layout)}), and none fits with "
            f"{', '.join(' '.join(MODE_FLAGS[m]) for m in MEMORY_MODES)} either. Use more "
            f"GPUs (--num-gpus), GPUs "
            f"with more memory (--gpu-memory-gib), a shorter --seq-length, or a smaller "
            f"--memory-reserve-gib if you know your overheads.")


def _nothing_to_try(workload: Workload, cluster: Cluster) -> str:
    a = workload.args
    return (f"no layout of {cluster.num_gpus} GPUs splits this model and batch: TP must divide "
            f"--gpus-per-node {cluster.gpus_per_node}, the {a.num_attention_heads} heads and "
            f"the FFN size {a.ffn_hidden_size}; PP the {a.num_layers} layers; and micro batch x "
            f"DP the --global-batch-size {workload.global_batch_size}. Make the global batch a "
            f"multiple of the number of GPUs, or change --num-gpus.")
