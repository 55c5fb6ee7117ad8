"""What the MoE layers report per log interval: each layer's aux and z losses and how evenly its
experts were loaded (Megatron logs the same: load_balancing_loss, z_loss per layer).

Each MoELayer sums its values over the training forwards since the last read (its share under
sequence and context parallelism) and counts them. At the log interval every rank reads its
layers into one [layers, 3 + E] tensor and one all-reduce over all ranks adds up the TP and CP
shares, the pipeline stages (each layer lives on one) and the DP replicas; dividing by the
forwards (counted once per TP x CP rank) gives the mean per micro batch, what one process
reports for the same batches.
"""
from typing import Dict, List, Optional

import torch
import torch.distributed as dist

from megatron.core import device
from megatron.core.pipeline_parallel.model_chunks import unwrap_model
from megatron.core.transformer.moe.moe_layer import MoELayer


def moe_layers(model_chunks: List[torch.nn.Module]) -> List[MoELayer]:
    return [m for chunk in model_chunks for m in unwrap_model(chunk).modules()
            if isinstance(m, MoELayer)]


def gather_moe_metrics(model_chunks, num_layers: int, num_experts: int,
                       ranks_per_micro_batch: int,
                       capacity_factor: Optional[float] = None) -> Dict[str, float]:
    """Collective over every rank; ``ranks_per_micro_batch``: TP x CP, the ranks that split
    one micro batch's tokens (each counts its forwards). Returns {"load balancing loss",
    "z loss": means over the MoE layers (present only if enabled), "max/mean tokens per
    expert": the worst layer's, plus per-layer "moe/<name> layer <n>" entries for
    TensorBoard; with a capacity factor "dropped token fraction": the routing choices the
    capacity dropped over all choices}."""
    columns = ("aux_loss", "z_loss", "forwards", "num_dropped")
    table = device.zeros(num_layers, len(columns) + num_experts, dtype=torch.float32)
    for layer in moe_layers(model_chunks):
        row, metrics = table[layer.layer_number - 1], layer.take_metrics()
        for column, name in enumerate(columns):
            if name in metrics:
                row[column] += metrics[name]
        if "routed_per_expert" in metrics:
            row[len(columns):] += metrics["routed_per_expert"]
    dist.all_reduce(table)
    table = table.cpu()
    routed = table[:, len(columns):]
    is_moe = routed.sum(dim=1) > 0
    micro_batches = (table[:, 2:3] / ranks_per_micro_batch).clamp(min=1)
    losses = table[:, :2] / micro_batches
    out = {}
    for column, label in enumerate(("load balancing loss", "z loss")):
        if losses[is_moe, column].any():
            out[label] = losses[is_moe, column].mean().item()
            for n in is_moe.nonzero().flatten().tolist():
                out[f"moe/{label} layer {n + 1}"] = losses[n, column].item()
    if capacity_factor is not None and is_moe.any():  # choices dropped / choices made
        out["dropped token fraction"] = (table[is_moe, 3].sum() / routed[is_moe].sum()).item()
    if is_moe.any():
        imbalance = routed.max(dim=1).values / routed.mean(dim=1).clamp(min=1e-9)
        out["max/mean tokens per expert"] = imbalance[is_moe].max().item()
        for n in is_moe.nonzero().flatten().tolist():
            out[f"moe/max/mean tokens per expert layer {n + 1}"] = imbalance[n].item()
    return out
