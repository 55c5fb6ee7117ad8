"""Contiguous gradient buffers and the buckets they are reduced in.

Each parameter's gradient lives in a flat buffer (one per gradient dtype) as ``param.main_grad``,
so a bucket is one contiguous slice and one collective. Parameters are laid out in reverse
order of registration, roughly the order backward produces their gradients, so the first
bucket completes first and its all-reduce overlaps the rest of the backward pass.
"""
from typing import Dict, List, Optional

import torch
import torch.distributed as dist

from megatron.core import device


class Bucket:
    """A contiguous slice of a gradient buffer holding whole parameters' gradients."""

    def __init__(self, params: List[torch.nn.Parameter], grad_data: torch.Tensor,
                 data_parallel_group, scaling: float):
        self.params = params
        self.grad_data = grad_data
        self.group = data_parallel_group
        self.scaling = scaling
        self.reset()

    def reset(self) -> None:
        self.ready = set()
        self.handle: Optional[dist.Work] = None
        self.launched = False

    def launch(self, async_op: bool) -> None:
        """Average this bucket's gradients over the data-parallel group."""
        if self.launched:
            return
        self.launched = True
        if self.scaling != 1.0:
            self.grad_data.mul_(self.scaling)  # exact when DP is a power of two
        self.handle = dist.all_reduce(self.grad_data, group=self.group, async_op=async_op)

    def mark_ready(self, param: torch.nn.Parameter) -> bool:
        """Record that ``param``'s gradient is final; True when the whole bucket is."""
        if param in self.ready:
            raise RuntimeError("a parameter's gradient was reported twice in one backward "
                               "pass; the bucket may already be reducing it.")
        self.ready.add(param)
        return len(self.ready) == len(self.params)

    def wait(self) -> None:
        if self.handle is not None:
            self.handle.wait()
            self.handle = None


class GradBuffer:
    """One flat gradient tensor for parameters sharing a gradient dtype, split into buckets."""

    def __init__(self, params: List[torch.nn.Parameter], grad_dtype: torch.dtype,
                 bucket_size: Optional[int], data_parallel_group, scaling: float):
        self.grad_dtype = grad_dtype
        self.numel = sum(p.numel() for p in params)
        self.grad_data = device.zeros(self.numel, dtype=grad_dtype)
        self.buckets: List[Bucket] = []
        self.bucket_of: Dict[torch.nn.Parameter, Bucket] = {}
        offset, bucket_params, bucket_start = 0, [], 0
        for i, param in enumerate(params):
            param.main_grad = self.grad_data[offset:offset + param.numel()].view(param.shape)
            offset += param.numel()
            bucket_params.append(param)
            last = i == len(params) - 1
            if last or (bucket_size is not None and offset - bucket_start >= bucket_size):
                bucket = Bucket(bucket_params, self.grad_data[bucket_start:offset],
                                data_parallel_group, scaling)
                self.buckets.append(bucket)
                for p in bucket_params:
                    self.bucket_of[p] = bucket
                bucket_params, bucket_start = [], offset

    def reset(self) -> None:
        self.grad_data.zero_()
        for bucket in self.buckets:
            bucket.reset()
