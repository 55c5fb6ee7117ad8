"""Global gradient norm over all model-parallel ranks, and clipping by it.

Each rank sums the squares of the gradients it owns (tensor-parallel duplicates and the second
copy of a tied embedding are counted once, on one rank); the sums are added over the
model-parallel group (TP x PP). Data-parallel replicas hold the same reduced gradients, so
they are not added again. With routed experts (spread over the EP ranks of the DP group) the
plain optimizer sums over every rank instead, counting each DP replica once.
"""
from typing import List, Optional, Tuple

import torch
import torch.distributed as dist

from megatron.core import device


def get_grad_norm_fp32(grads_for_norm: List[torch.Tensor],
                       model_parallel_group) -> torch.Tensor:
    """L2 norm of all ranks' gradients together: a one-element fp32 device tensor, not read
    (a read is a host sync on CUDA; the logger reads it at the log interval)."""
    total = device.zeros(1, dtype=torch.float32)
    if grads_for_norm:
        norms = torch._foreach_norm([g.float() for g in grads_for_norm])
        total += torch.stack(norms).square().sum()
    dist.all_reduce(total, group=model_parallel_group)
    return total.sqrt()


def clip_grad_by_total_norm_fp32(grads: List[torch.Tensor], max_norm: float,
                                 total_norm: torch.Tensor) -> None:
    """Scale fp32 gradients so their global norm is at most ``max_norm``, on the device.

    The coefficient is the host code's: ``max_norm / (norm + 1e-6)`` in float64, applied where
    it is < 1 (a NaN norm leaves the gradients alone). Elsewhere it is exactly 1.0, and
    multiplying by 1.0 leaves every value bitwise unchanged, so no read decides whether to
    scale."""
    if not grads:
        return
    coeff = max_norm / (total_norm.double() + 1.0e-6)
    # float32, as the Python scalar was rounded; 0-dim, as foreach ops take a tensor scalar
    coeff = torch.where(coeff < 1.0, coeff, 1.0).float().reshape(())
    if coeff.device != grads[0].device:  # CPU offload: host gradients
        coeff = coeff.to(grads[0].device)
    torch._foreach_mul_(grads, coeff)


def count_zeros_fp32(grads_for_norm: List[torch.Tensor], model_parallel_group) -> int:
    total = device.zeros(1, dtype=torch.float32)
    for grad in grads_for_norm:
        total += grad.numel() - torch.count_nonzero(grad)
    dist.all_reduce(total, group=model_parallel_group)
    return int(total.item())


def is_counted_in_norm(param: torch.nn.Parameter, tensor_parallel_rank: int,
                       replica_ranks: Optional[Tuple[int, int]] = None) -> bool:
    """Whether this rank's copy of ``param`` enters the global norm. ``replica_ranks`` =
    (DP rank, expert-DP rank) when the sum runs over data-parallel replicas too (routed
    experts with the plain optimizer): then only the first replica counts."""
    if getattr(param, "expert_parallel", False):
        # A routed expert's weight differs on every expert-TP and EP rank.
        return replica_ranks is None or replica_ranks[1] == 0
    if getattr(param, "shared_embedding", False):
        return False  # the last stage's copy of the tied embedding; the first stage counts it
    if not getattr(param, "tensor_model_parallel", False) and tensor_parallel_rank > 0:
        return False  # the same on every TP rank; TP rank 0 counts it
    return replica_ranks is None or replica_ranks[0] == 0
