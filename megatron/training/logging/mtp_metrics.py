"""What the multi-token prediction depths report per log interval: each depth's mean loss over
the training microbatches since the last read (Megatron logs "mtp_1 loss", ...).

The depths live on the last pipeline stage; every TP (and CP) rank there holds the same values
and counts its forwards. One all-reduce over all ranks of [D sums, forwards] adds the TP and
CP copies, the DP replicas and nothing from other stages (zeros), so sums / forwards is the
mean per microbatch over the DP replicas, as one process reports for the same batches.
"""
from typing import Dict, List

import torch
import torch.distributed as dist

from megatron.core import device
from megatron.core.pipeline_parallel.model_chunks import unwrap_model


def gather_mtp_metrics(model_chunks: List[torch.nn.Module], depths: int) -> Dict[str, float]:
    """Collective over every rank: {"mtp_k loss": mean} for k = 1..D (empty without
    training forwards since the last call)."""
    table = device.zeros(depths + 1, dtype=torch.float32)
    for chunk in model_chunks:
        mtp = getattr(unwrap_model(chunk), "mtp", None)
        if mtp is None:
            continue
        sums, forwards = mtp.take_metrics()
        if forwards:
            table[:depths] += sums.float()
            table[depths] += forwards
    dist.all_reduce(table)
    table = table.cpu()
    if table[depths] == 0:
        return {}
    return {f"mtp_{k + 1} loss": (table[k] / table[depths]).item() for k in range(depths)}
