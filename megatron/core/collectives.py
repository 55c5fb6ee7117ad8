"""Flat-tensor collectives that work on every torch we support (>= 2.4) and on gloo and nccl.

torch renamed ``all_gather_into_tensor`` / ``reduce_scatter_tensor`` to ``*_single``; we call
whichever exists so callers never see a deprecation warning or a missing function.
"""
import torch
import torch.distributed as dist


def all_gather_into_tensor(output: torch.Tensor, input_: torch.Tensor, group=None,
                           async_op: bool = False):
    """Concatenate every rank's ``input_`` along dim 0 into ``output``."""
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return fn(output, input_, group=group, async_op=async_op)


def reduce_scatter_tensor(output: torch.Tensor, input_: torch.Tensor, group=None,
                          async_op: bool = False):
    """Sum ``input_`` over ranks and keep this rank's dim-0 chunk in ``output``."""
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return fn(output, input_, op=dist.ReduceOp.SUM, group=group, async_op=async_op)
