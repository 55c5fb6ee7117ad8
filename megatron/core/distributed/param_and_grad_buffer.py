"""Contiguous gradient (and, for the distributed optimizer, parameter) buffers and the buckets
they are reduced in.

Each parameter's gradient lives in a flat buffer (one per parameter/gradient dtype pair) as
``param.main_grad``, so a bucket is one contiguous slice and one collective. Parameters are
laid out in reverse order of registration, roughly the order backward produces their
gradients, so the first bucket completes first and its reduction overlaps the rest of the
backward pass.

For the distributed optimizer each bucket is padded to a multiple of the data-parallel size
and split into equal shards, one per DP rank, regardless of parameter boundaries: gradients are
reduce-scattered (each rank gets its shard, summed) and, after each rank updates its shard,
parameters are all-gathered back. The parameters themselves then live in a flat buffer of the
same layout (``param.data`` is a view into it), so the all-gather writes them in place.

Sharded gradients (ZeRO-2, ``shard_grads``): each bucket's gradients get a storage of their
own, and once the optimizer takes the reduced gradients (``reduced_grad_shard()``, at the start
of its step) the bucket keeps only a copy of this rank's shard and drops the full tensor (and
the parameters' ``main_grad`` views into it); ``zero_grad_buffer()`` allocates a zeroed one at
the start of the next iteration (``restore_full_grad()``). Resizing the storage to 0 and back
instead would keep the views but turn a stray write into one past a freed allocation.

Why this design and not a reduce-scatter per microbatch into an accumulating shard
(DeepSpeed's ZeRO-2): gradient accumulation adds every microbatch into the full-size
``main_grad`` (the fused weight-gradient GEMM writes there), and reducing only once per
iteration needs that full sum, so the full buffer must exist from the first backward of an
iteration to its reduction; one reduction per microbatch would cost DP traffic x microbatches.
The result is exact (the same reduce-scatter, then a copy) and the full buffer is absent from
the optimizer step to the next iteration's start: during the step, evaluation and checkpoint
saves. It is freed after ``finalize_model_grads`` (not right after each bucket's
reduce-scatter) because the sequence-parallel and tied-embedding sums that follow still work
on the full ``main_grad`` views. The peak of forward/backward (full gradients + activations)
is unchanged: lowering it needs the per-microbatch reduction.
"""
import math
from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from megatron.core import device
from megatron.core.collectives import all_gather_into_tensor, reduce_scatter_tensor


class Bucket:
    """A contiguous slice of the buffers holding whole parameters."""

    def __init__(self, params: List[torch.nn.Parameter], grad_data: torch.Tensor,
                 param_data: Optional[torch.Tensor], param_ranges: Dict, group,
                 scaling: float, shard_grads: bool = False):
        self.params = params
        self.grad_data = grad_data
        self.numel = grad_data.numel()
        # ZeRO-2: grad_data is a tensor of its own, dropped once the shard is copied out.
        self.shard_grads = shard_grads
        self.grad_shard: Optional[torch.Tensor] = None  # set while the full storage is freed
        self.param_data = param_data  # None unless sharded
        self.param_ranges: Dict[torch.nn.Parameter, Tuple[int, int]] = param_ranges
        self.group = group
        self.scaling = scaling
        self.sharded = param_data is not None
        self.param_gather_handle = None
        self.reset()

    def reset(self) -> None:
        self.ready = set()
        self.handle: Optional[dist.Work] = None
        self.launched = False

    def shard_range(self) -> Tuple[int, int]:
        """This DP rank's [begin, end) within the bucket."""
        size = self.numel // dist.get_world_size(self.group)
        rank = dist.get_rank(self.group)
        return rank * size, (rank + 1) * size

    def launch(self, async_op: bool) -> None:
        """Average this bucket's gradients over DP: all-reduce, or reduce-scatter into this
        rank's shard when sharded."""
        if self.launched:
            return
        self.launched = True
        if self.scaling != 1.0:
            self.grad_data.mul_(self.scaling)  # exact when DP is a power of two
        if self.sharded:
            begin, end = self.shard_range()
            self.handle = reduce_scatter_tensor(self.grad_data[begin:end], self.grad_data,
                                                group=self.group, async_op=async_op)
        else:
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

    @property
    def full_grad_released(self) -> bool:
        return self.grad_shard is not None

    def reduced_grad_shard(self) -> torch.Tensor:
        """This rank's shard of the reduced gradients (after ``wait()``). With ``shard_grads``
        the shard is copied out and the full bucket dropped: ``grad_data`` and the
        parameters' ``main_grad`` become None (so a stray write fails instead of landing in
        freed memory) until ``restore_full_grad``."""
        begin, end = self.shard_range()
        if not self.shard_grads:
            return self.grad_data[begin:end]
        if self.grad_shard is None:
            if self.handle is not None:
                raise RuntimeError("the bucket's reduce-scatter was not waited for.")
            self.grad_shard = self.grad_data[begin:end].clone()
            self.grad_data = None
            for param in self.params:
                param.main_grad = None
        return self.grad_shard

    def restore_full_grad(self) -> None:
        """A zeroed full gradient bucket again, with the parameters' ``main_grad`` views."""
        if self.grad_shard is not None:
            self.grad_data = device.zeros(self.numel, dtype=self.grad_shard.dtype)
            for param, (begin, end) in self.param_ranges.items():
                param.main_grad = self.grad_data[begin:end].view(param.shape)
            self.grad_shard = None

    def start_param_gather(self, async_op: bool) -> None:
        """Every rank's updated shard of the parameters, into every rank's buffer."""
        begin, end = self.shard_range()
        self.param_gather_handle = all_gather_into_tensor(
            self.param_data, self.param_data[begin:end], group=self.group, async_op=async_op)
        if not async_op:
            self.param_gather_handle = None

    def wait_param_gather(self) -> None:
        if self.param_gather_handle is not None:
            self.param_gather_handle.wait()
            self.param_gather_handle = None


class GradBuffer:
    """Flat buffers for parameters sharing a (param dtype, grad dtype), split into buckets."""

    def __init__(self, params: List[torch.nn.Parameter], grad_dtype: torch.dtype,
                 bucket_size: Optional[int], data_parallel_group, scaling: float,
                 shard: bool = False, shard_grads: bool = False):
        if shard_grads and not shard:
            raise ValueError("sharded gradients need sharded buckets (the distributed "
                             "optimizer).")
        self.grad_dtype = grad_dtype
        groups, current, count = [], [], 0
        for param in params:
            # Sharded, the two copies of an embedding tied across pipeline stages must be cut
            # into the same DP shards, or their gradient sum would add mismatched pieces:
            # each copy gets a bucket of its own.
            alone = shard and getattr(param, "tied_across_stages", False)
            if alone and current:
                groups.append(current)
                current, count = [], 0
            current.append(param)
            count += param.numel()
            if alone or (bucket_size is not None and count >= bucket_size):
                groups.append(current)
                current, count = [], 0
        if current:
            groups.append(current)
        dp = dist.get_world_size(data_parallel_group)
        sizes = [sum(p.numel() for p in g) for g in groups]
        if shard:  # equal shards per DP rank, whatever the parameter sizes
            sizes = [math.ceil(size / dp) * dp for size in sizes]
        self.numel = sum(sizes)
        # One flat buffer, or (sharded gradients) one storage per bucket, so that each
        # bucket's can be freed on its own: then grad_data is None.
        self.grad_data = None if shard_grads else device.zeros(self.numel, dtype=grad_dtype)
        self.param_data = device.zeros(self.numel, dtype=params[0].dtype) if shard else None
        self.buckets: List[Bucket] = []
        self.bucket_of: Dict[torch.nn.Parameter, Bucket] = {}
        start = 0
        for group, size in zip(groups, sizes):
            if shard_grads:
                grads = device.zeros(size, dtype=grad_dtype)
            else:
                grads = self.grad_data[start:start + size]
            offset, ranges = start, {}
            for param in group:
                end = offset + param.numel()
                param.main_grad = grads[offset - start:end - start].view(param.shape)
                if shard:
                    self.param_data[offset:end].copy_(param.data.view(-1))
                    param.data = self.param_data[offset:end].view(param.shape)
                ranges[param] = (offset - start, end - start)
                offset = end
            bucket = Bucket(group, grads,
                            self.param_data[start:start + size] if shard else None, ranges,
                            data_parallel_group, scaling, shard_grads)
            self.buckets.append(bucket)
            self.bucket_of.update({p: bucket for p in group})
            start += size

    def reset(self) -> None:
        if self.grad_data is not None:
            self.grad_data.zero_()
        for bucket in self.buckets:
            if self.grad_data is None:
                if bucket.full_grad_released:
                    bucket.restore_full_grad()  # zeroed
                else:
                    bucket.grad_data.zero_()
            bucket.reset()
