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

Sharded gradients (ZeRO-2, ``shard_grads``): each bucket keeps one persistent buffer of this
rank's shard (``grad_shard``, allocated once) that the reduce-scatter writes into, and a full
gradient storage of its own that exists only while gradients accumulate: it is allocated
(zeroed) at the bucket's first gradient of an iteration (``ensure_full_grad``, from the DDP
hook) and freed as soon as its reduce-scatter has completed on the last microbatch
(``release_full_grad``): synchronously, right after it; overlapped, when its asynchronous op is
waited for (DDP keeps at most two in flight). Between the reduction and the next iteration the
parameters' ``main_grad`` is None (a stray write fails instead of landing in freed memory) and
``main_grad_shard`` is the 1-D slice of ``grad_shard`` inside the parameter (possibly empty):
the sequence-parallel and tied-embedding sums of finalize_model_grads work on that slice, the
only part of the reduced gradient this rank's optimizer reads. Their sums are elementwise over
TP / the two stages, whose bucket layouts are identical, so the result equals summing the full
``main_grad`` and keeping its shard (bitwise for two ranks: a + b; larger groups may sum in
another order when the buffer's length changes gloo's ring chunks).

Why not a reduce-scatter per microbatch into an accumulating shard (DeepSpeed's ZeRO-2):
gradient accumulation adds every microbatch into the full-size ``main_grad`` (the fused
weight-gradient GEMM writes there) and reducing once per iteration needs that full sum, so
with several microbatches the full buckets live from the first microbatch's backward to the
last one's reduction (plus the shard buffers: the backward peak is the distributed
optimizer's + 1/DP of the gradients). With one microbatch they are absent during forward and
appear bucket by bucket in backward while activations are freed. The first gradient of an
iteration finds no ``main_grad``, so a fused linear computes that weight's gradient into a
temporary once, which the hook adds into the fresh zeroed bucket (0 + g: exact).
"""
import math
from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from megatron.core import device
from megatron.core.collectives import all_gather_into_tensor, reduce_scatter_tensor
from megatron.core.fp8.param_gather import Fp8ShardGather


class Bucket:
    """A contiguous slice of the buffers holding whole parameters."""

    def __init__(self, params: List[torch.nn.Parameter], grad_data: Optional[torch.Tensor],
                 param_data: Optional[torch.Tensor], param_ranges: Dict, group,
                 scaling: float, numel: int, grad_dtype: torch.dtype,
                 shard_grads: bool = False, replica_group=None, fp8_gather: bool = False):
        self.params = params
        self.grad_data = grad_data  # ZeRO-2: None while the full storage is freed
        self.numel = numel
        self.grad_dtype = grad_dtype
        self.param_data = param_data  # None unless sharded
        self.param_ranges: Dict[torch.nn.Parameter, Tuple[int, int]] = param_ranges
        self.group = group
        # HSDP (optimizer_instances.py): ``group`` is this rank's instance, and the reduced
        # shard is then all-reduced with the same shard of the other instances.
        self.replica_group = replica_group
        self.replica_pending = False
        self.scaling = scaling
        self.sharded = param_data is not None
        self.shard_grads = shard_grads
        # ZeRO-2: set by the reduction, cleared by zero_grad_buffer; a gradient in between
        # would start accumulating on top of a finished iteration.
        self.awaiting_zero = False
        self.param_gather_handle = None
        # --fp8-param-gather: the FP8 weights' copy that is gathered in their place; the
        # high-precision weights are then current only in this rank's shard until a
        # high-precision gather (fp8/param_gather.py)
        self.fp8_gather = Fp8ShardGather(param_ranges, numel, group) if fp8_gather else None
        self.high_precision_stale = False
        self.grad_shard: Optional[torch.Tensor] = None
        if shard_grads:
            begin, end = self.shard_range()
            self.grad_shard = device.zeros(end - begin, dtype=grad_dtype)
            for param, (p_begin, p_end) in param_ranges.items():
                lo = max(p_begin, begin)
                hi = max(lo, min(p_end, end))
                param.main_grad_shard = self.grad_shard[lo - begin:hi - begin]
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
        rank's shard when sharded (ZeRO-2: into the persistent shard buffer)."""
        if self.launched:
            return
        self.launched = True
        self.ensure_full_grad()  # a bucket that got no gradient reduces zeros
        if self.scaling != 1.0:
            self.grad_data.mul_(self.scaling)  # exact when DP is a power of two
        if self.sharded:
            begin, end = self.shard_range()
            output = self.grad_shard if self.shard_grads else self.grad_data[begin:end]
            self.handle = reduce_scatter_tensor(output, self.grad_data, group=self.group,
                                                async_op=async_op)
            self.replica_pending = self.replica_group is not None
        else:
            self.handle = dist.all_reduce(self.grad_data, group=self.group, async_op=async_op)
        if not async_op:
            self.finish()

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
        if self.replica_pending:  # HSDP: the instances' sums of this shard, added up
            self.replica_pending = False
            begin, end = self.shard_range()
            shard = self.grad_shard if self.shard_grads else self.grad_data[begin:end]
            dist.all_reduce(shard, group=self.replica_group)

    def finish(self) -> None:
        """Wait for the reduction; ZeRO-2 then frees the full storage."""
        self.wait()
        if self.shard_grads and self.launched:
            self.release_full_grad()

    @property
    def full_grad_released(self) -> bool:
        return self.shard_grads and self.grad_data is None

    def ensure_full_grad(self) -> None:
        """ZeRO-2: a zeroed full gradient storage and the parameters' ``main_grad`` views,
        unless it exists."""
        if self.awaiting_zero:
            raise RuntimeError(self.RELEASED)
        if self.grad_data is None:
            self.grad_data = device.zeros(self.numel, dtype=self.grad_dtype)
            for param, (begin, end) in self.param_ranges.items():
                param.main_grad = self.grad_data[begin:end].view(param.shape)

    RELEASED = ("the gradients of this iteration were reduced (--shard-gradients freed the "
                "full buffers): call zero_grad_buffer() before the next forward with "
                "gradients.")

    def release_full_grad(self) -> None:
        self.grad_data = None
        for param in self.params:
            param.main_grad = None
        self.awaiting_zero = True

    def reduced_grad_shard(self) -> torch.Tensor:
        """This rank's shard of the reduced gradients (after ``wait()``)."""
        if not self.shard_grads:
            begin, end = self.shard_range()
            return self.grad_data[begin:end]
        if not self.awaiting_zero:
            raise RuntimeError("the bucket's gradients were not reduced (finish_grad_sync).")
        return self.grad_shard

    def start_param_gather(self, async_op: bool, high_precision: bool = False) -> None:
        """Every rank's updated shard of the parameters, into every rank's buffer; the FP8
        weights' bucket (--fp8-param-gather) gathers their FP8 copy instead, unless
        ``high_precision``."""
        begin, end = self.shard_range()
        if self.fp8_gather is not None and not high_precision:
            self.fp8_gather.start(self.param_data, begin, end, async_op)
            self._mark_high_precision(stale=True)
            return
        self.param_gather_handle = all_gather_into_tensor(
            self.param_data, self.param_data[begin:end], group=self.group, async_op=async_op)
        if not async_op:
            self.param_gather_handle = None
        self._mark_high_precision(stale=False)

    def _mark_high_precision(self, stale: bool) -> None:
        """Whether the FP8 weights' high-precision copies are other ranks' older values (the
        FP8 layers refuse to quantize them then: fp8/linear.py)."""
        self.high_precision_stale = stale
        if self.fp8_gather is not None:
            for param in self.params:
                param.fp8_high_precision_stale = stale

    def wait_param_gather(self) -> None:
        if self.fp8_gather is not None:
            self.fp8_gather.wait()
        if self.param_gather_handle is not None:
            self.param_gather_handle.wait()
            self.param_gather_handle = None


class GradBuffer:
    """Flat buffers for parameters sharing a (param dtype, grad dtype), split into buckets."""

    def __init__(self, params: List[torch.nn.Parameter], grad_dtype: torch.dtype,
                 bucket_size: Optional[int], data_parallel_group, scaling: float,
                 shard: bool = False, shard_grads: bool = False, replica_group=None,
                 fp8_gather: bool = False):
        if shard_grads and not shard:
            raise ValueError("sharded gradients need sharded buckets (the distributed "
                             "optimizer).")
        if fp8_gather and not shard:
            raise ValueError("an FP8 parameter gather needs sharded buckets (the distributed "
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
        # One flat buffer, or (sharded gradients) one storage per bucket made when needed, so
        # that each bucket's can be freed on its own: then grad_data is None.
        self.grad_data = None if shard_grads else device.zeros(self.numel, dtype=grad_dtype)
        self.param_data = device.zeros(self.numel, dtype=params[0].dtype) if shard else None
        self.buckets: List[Bucket] = []
        self.bucket_of: Dict[torch.nn.Parameter, Bucket] = {}
        start = 0
        for group, size in zip(groups, sizes):
            # ZeRO-2: no full storage until the bucket's first gradient (ensure_full_grad)
            grads = None if shard_grads else self.grad_data[start:start + size]
            offset, ranges = start, {}
            for param in group:
                end = offset + param.numel()
                param.main_grad = None if shard_grads else \
                    grads[offset - start:end - start].view(param.shape)
                if shard:
                    self.param_data[offset:end].copy_(param.data.view(-1))
                    param.data = self.param_data[offset:end].view(param.shape)
                ranges[param] = (offset - start, end - start)
                offset = end
            bucket = Bucket(group, grads,
                            self.param_data[start:start + size] if shard else None, ranges,
                            data_parallel_group, scaling, size, grad_dtype, shard_grads,
                            replica_group, fp8_gather)
            self.buckets.append(bucket)
            self.bucket_of.update({p: bucket for p in group})
            start += size

    def reset(self) -> None:
        if self.grad_data is not None:
            self.grad_data.zero_()
        for bucket in self.buckets:
            if self.grad_data is None:  # ZeRO-2: a freed bucket is re-made at its first grad
                if bucket.grad_data is not None:
                    bucket.grad_data.zero_()
                bucket.awaiting_zero = False
            bucket.reset()
