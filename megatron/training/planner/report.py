"""A plan as a ranked table for people and as JSON for machines (the same rows)."""
import dataclasses
import shlex
from typing import Dict, List

from megatron.training.memory.estimate import GIB
from megatron.training.planner.layouts import CP_COMM_TYPE, MODE_FLAGS, is_moe
from megatron.training.planner.plan import Plan, PlanRow
from megatron.training.planner.step_time import Cluster
from megatron.training.planner.workload import Workload

MIB = 2 ** 20
COLUMNS = ("#", "TP", "CP", "PP", "VPP/sched", "DP", "MBS", "recompute", "dist-opt", "mem GiB",
           "bubble", "step s", "tok/s/GPU", "MFU")
EP_COLUMN = COLUMNS.index("DP") + 1  # MoE models: the EP size after DP


def _same_memory(row: PlanRow) -> bool:
    """Megatron-LLaMA's optimizer needs the same memory (bucket padding aside: < 1 MiB)."""
    return (row.overlapped_optimizer_bytes is not None
            and abs(row.overlapped_optimizer_bytes - row.memory.max_total) < MIB)


def _cells(rank: int, row: PlanRow) -> List[str]:
    lay, step = row.layout, row.step
    sharded = ("yes*" if _same_memory(row) else "yes") if lay.distributed_optimizer else "no"
    if lay.memory_mode:  # e.g. yes+zero2, no+fsdp2, no+cpu-offload
        sharded += "+" + lay.memory_mode
    if lay.instances > 1:  # HSDP: one optimizer instance per node, e.g. yes+hsdp2
        sharded += f"+hsdp{lay.instances}"
    return [str(rank), str(lay.tensor_parallel), str(lay.context_parallel),
            str(lay.pipeline_parallel),
            str(lay.schedule or lay.virtual_pipeline or "-"), str(lay.data_parallel),
            str(lay.micro_batch_size), lay.recompute or "none", sharded,
            f"{row.memory.max_total / GIB:.1f}", f"{step.bubble_fraction:.3f}",
            f"{step.step_s:.2f}", f"{step.tokens_per_s_per_gpu:.0f}", f"{step.mfu:.1%}"]


def cluster_line(cluster: Cluster) -> str:
    nodes = max(1, cluster.num_gpus // cluster.gpus_per_node)
    per_node = min(cluster.gpus_per_node, cluster.num_gpus)
    return (f"{cluster.num_gpus} GPUs ({nodes} node(s) of {per_node}), "
            f"{cluster.gpu_memory_gib:g} GiB each with {cluster.memory_reserve_gib:g} GiB "
            f"reserved; peak {cluster.peak_tflops:g} TFLOP/s at {cluster.compute_efficiency:.0%} "
            f"efficiency; links {cluster.intra_node_bandwidth_gbs:g} GB/s within a node, "
            f"{cluster.inter_node_bandwidth_gbs:g} GB/s per GPU between nodes")


def launch_command(row: PlanRow, cluster: Cluster, workload: Workload) -> str:
    """torchrun over the cluster, the script the model flags suggest, the model's flags and
    the row's: a command to run as it is (add the data and tokenizer flags)."""
    per_node = min(cluster.gpus_per_node, cluster.num_gpus)
    nodes = max(1, cluster.num_gpus // per_node)
    launcher = ["torchrun", "--nproc-per-node", str(per_node)]
    if nodes > 1:
        launcher += ["--nnodes", str(nodes)]
    rope = workload.args.position_embedding_type == "rope"
    script = "pretrain_llama.py" if rope else "pretrain_gpt.py"
    return shlex.join(launcher + [script] + workload.flags + row.flags)


def _brief(row: PlanRow) -> str:
    lay = row.layout
    return (f"EP {lay.expert_parallel}, TP {lay.tensor_parallel}, PP {lay.pipeline_parallel}: "
            f"{row.step.mfu:.1%} MFU, {row.memory.max_total / GIB:.1f} GiB")


def moe_choice_lines(result: Plan) -> List[str]:
    """Why #1 splits the experts (EP) and the layers (PP) as it does: the best layout on the
    other side of each choice, in the same estimate, or that none fits there."""
    best, lines = result.rows[0], []
    for name, size, why in (
            ("EP", best.layout.expert_parallel,
             "each GPU holds 1/EP of the experts' weights and optimizer state, and the "
             "tokens travel by all-to-all"),
            ("PP", best.layout.pipeline_parallel,
             "each GPU holds 1/PP of the layers, and the schedule has a bubble")):
        other_side = f"{name} 1" if size > 1 else f"{name} > 1"
        other = result.best_by_choice.get(other_side)
        verdict = f"the best with {other_side} ({_brief(other)}) ranks lower" if other \
            else f"no layout with {other_side} fits"
        lines.append(f"why {name} {size}: {verdict} ({name} > 1: {why})")
    return lines


def format_table(result: Plan, cluster: Cluster, workload: Workload) -> str:
    rows = [list(COLUMNS)] + [_cells(i + 1, row) for i, row in enumerate(result.rows)]
    if is_moe(workload.args):
        rows[0].insert(EP_COLUMN, "EP")
        for cells, row in zip(rows[1:], result.rows):
            cells.insert(EP_COLUMN, str(row.layout.expert_parallel))
    widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
    lines = [f"model: {workload.describe()}",
             f"cluster: {cluster_line(cluster)}",
             f"{result.enumerated} layouts tried, {result.fitting} fit; the best "
             f"{len(result.rows)} by estimated MFU (ties: less memory):", ""]
    lines += ["  ".join(cell.rjust(w) for cell, w in zip(r, widths)) for r in rows]
    lines.append("")
    lines.append("flags (in place of any parallelism, batch, recomputation, optimizer-sharding "
                 "and precision flags of your command line):")
    if any(row.layout.context_parallel > 1 for row in result.rows):
        lines[-1] += (" CP: the sequence split over CP ranks (ring attention); mem GiB "
                      "includes its K/V block in flight")
    lines += [f"  #{i + 1}: {shlex.join(row.flags)}" for i, row in enumerate(result.rows)]
    lines.append(f"the whole command of #1: {launch_command(result.rows[0], cluster, workload)}")
    if is_moe(workload.args):
        lines += moe_choice_lines(result)
    if result.memory_mode:
        lines.append(f"no layout fits without a memory mode: every row uses "
                     f"{shlex.join(MODE_FLAGS[result.memory_mode])} (the cheapest mode that "
                     f"fits; dist-opt column: +{result.memory_mode}).")
    hsdp = sorted({row.layout.instances for row in result.rows} - {1})
    if hsdp:
        lines.append(f"+hsdpN (dist-opt column): --num-distributed-optimizer-instances N, "
                     f"one optimizer instance per node ({', '.join(map(str, hsdp))} nodes): "
                     "sharded over a node's ranks, all-reduced across nodes.")
    starred = [row for row in result.rows if _same_memory(row)]
    if starred:
        lines.append("yes*: Megatron-LLaMA's " + shlex.join(starred[0].overlapped_optimizer_flags)
                     + " in place of --use-distributed-optimizer --overlap-grad-reduce "
                     "--overlap-param-gather needs the same memory (bucket padding aside) and "
                     "has the same estimated step time.")
    return "\n".join(lines)


def _stage_dict(stage) -> Dict:
    return {"pipeline_rank": stage.pipeline_rank, "total_bytes": stage.total,
            **{f"{k}_bytes": v for k, v in dataclasses.asdict(stage.state).items()},
            "activation_bytes": stage.activations.stored_bytes,
            "recompute_working_bytes": stage.activations.recompute_working_bytes,
            "cp_kv_in_flight_bytes": stage.activations.cp_kv_in_flight_bytes,
            "transient_bytes": stage.transient_bytes, "host_bytes": stage.host.total,
            "microbatches_in_flight": stage.activations.in_flight}


def row_dict(row: PlanRow, workload: Workload) -> Dict:
    lay = row.layout
    overlapped = None
    if row.overlapped_optimizer_flags is not None:
        overlapped = {"flags": shlex.join(row.overlapped_optimizer_flags),
                      "memory_bytes": row.overlapped_optimizer_bytes}
    return {
        "tensor_parallel": lay.tensor_parallel, "context_parallel": lay.context_parallel,
        "cp_comm_type": CP_COMM_TYPE if lay.context_parallel > 1 else None,
        "pipeline_parallel": lay.pipeline_parallel,
        "virtual_pipeline": lay.virtual_pipeline, "pipeline_schedule": lay.schedule,
        "data_parallel": lay.data_parallel, "expert_parallel": lay.expert_parallel,
        "micro_batch_size": lay.micro_batch_size, "num_microbatches": lay.num_microbatches,
        "recompute": lay.recompute, "distributed_optimizer": lay.distributed_optimizer,
        "memory_mode": lay.memory_mode,
        "distributed_optimizer_instances": lay.instances,
        "sequence_parallel": lay.tensor_parallel > 1,
        "grad_reduce_in_fp32": lay.grad_reduce_in_fp32,
        "padded_vocab_size": row.padded_vocab_size,
        "memory_bytes": row.memory.max_total,
        "memory_gib": row.memory.max_total / GIB,
        "memory": {"peak_pipeline_rank": row.memory.peak.pipeline_rank,
                   "stages": [_stage_dict(stage) for stage in row.memory.stages]},
        "bubble_fraction": row.step.bubble_fraction, "step_time_s": row.step.step_s,
        "tokens_per_s_per_gpu": row.step.tokens_per_s_per_gpu, "mfu": row.step.mfu,
        "step_time": dataclasses.asdict(row.step),
        "flags": shlex.join(row.flags),
        "command": shlex.join(workload.flags + row.flags),
        "overlapped_distributed_optimizer": overlapped,
    }


def plan_dict(result: Plan, cluster: Cluster, workload: Workload) -> Dict:
    return {"model": workload.describe(), "model_flags": shlex.join(workload.flags),
            "global_batch_size": workload.global_batch_size,
            "seq_length": workload.seq_length, "cluster": dataclasses.asdict(cluster),
            "enumerated": result.enumerated, "fitting": result.fitting,
            "memory_mode": result.memory_mode,
            "rows": [row_dict(row, workload) for row in result.rows]}
