"""Where an FSDP2 shard lies in its tensor-parallel tensor, for the sharded checkpoint format.

``fully_shard`` splits each parameter (this TP rank's local tensor) on dim 0 over the DP
group as ``torch.chunk`` does: rank r holds rows ``[r * ceil(R / DP), ...)``, the last ranks
fewer or none. Rows of a row-major tensor are a contiguous flat range, so a shard is the
flat range ``[begin, begin + numel)`` of the TP-local tensor: the same (name, begin, end)
pieces the distributed optimizer writes, which the checkpoint reader serves to any layout
(DDP at any TP/PP/DP, the distributed optimizer at any DP, FSDP2 at any DP).
"""
import math
import sys
from typing import Tuple

import torch


def is_sharded(tensor) -> bool:
    """A DTensor (FSDP2's parameters, gradients and states). Asked without importing
    torch.distributed.tensor, about 1 s of every process start: no tensor is one before
    that module is loaded."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(tensor, module.DTensor)


def local_rows(tensor) -> Tuple[int, torch.Tensor]:
    """(first flat element of this rank's shard (a DTensor) in the TP-local tensor, the
    shard itself: a view of the DTensor's storage, so copying into it writes the
    parameter/state)."""
    from torch.distributed.tensor import Replicate, Shard

    # HSDP's 2-D mesh: replicated over instances, split within one (the last mesh dimension).
    if tuple(tensor.placements) not in ((Shard(0),), (Replicate(), Shard(0))):
        raise ValueError(f"an FSDP2 shard split on dim 0 (HSDP: replicated, then split) was "
                         f"expected, not {tensor.placements}")
    local = tensor.to_local()
    rows = tensor.shape[0]
    split = tensor.device_mesh.ndim - 1
    ways = tensor.device_mesh.size(split)
    rank = tensor.device_mesh.get_local_rank(split)
    per_rank = -(-rows // ways)
    first = min(rank * per_rank, rows)
    if local.shape[0] != min(per_rank, rows - first) or local.shape[1:] != tensor.shape[1:]:
        raise ValueError(f"FSDP2 shard of shape {tuple(local.shape)} on rank {rank} of {ways} "
                         f"is not rows [{first}, ...) of {tuple(tensor.shape)}")
    return first * math.prod(tensor.shape[1:]), local


def first_replica(tensor) -> bool:
    """Whether this rank's shard is the one a checkpoint takes: HSDP's instances all hold it,
    and instance 0 writes it."""
    mesh = tensor.device_mesh
    return mesh.ndim == 1 or mesh.get_local_rank(0) == 0
