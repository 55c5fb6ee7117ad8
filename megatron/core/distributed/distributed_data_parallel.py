"""Data parallelism: gradients accumulated in contiguous buffers and averaged over DP ranks.

    model = DistributedDataParallel(config, ddp_config, model_chunk)

Every parameter's gradient goes to ``param.main_grad`` (a view into its buffer) after each
backward. Gradients are reduced once per iteration: with ``no_sync()`` held for every
microbatch but the last (the schedules do this), either by ``finish_grad_sync()`` or, with
``overlap_grad_reduce``, by each bucket's asynchronous all-reduce launched from the backward
hooks the moment the bucket's last gradient arrives; ``finish_grad_sync()`` then only waits.
With ``shard_gradients`` (ZeRO-2) a bucket's full gradients exist from its first gradient of
an iteration until its reduce-scatter into the persistent shard has completed (see
param_and_grad_buffer): on the last microbatch the reduction is launched as soon as the bucket
is complete, also without overlap (then synchronously, in the backward hook), and at most
``MAX_BUCKETS_IN_FLIGHT`` overlapped reductions are outstanding, so the full buckets need not
all coexist at the end of backward.
"""
import contextlib
import functools
from typing import Dict, List, Optional

import torch
import torch.distributed as dist

from megatron.core import optimizer_instances, parallel_state
from megatron.core.distributed.distributed_data_parallel_config import (
    DistributedDataParallelConfig,
)
from megatron.core.distributed.param_and_grad_buffer import Bucket, GradBuffer
from megatron.core.fp8.param_gather import gathers_in_fp8
from megatron.core.param_sync import WAIT_ATTR
from megatron.core.utils import weak_hook


def is_expert(param: torch.nn.Parameter) -> bool:
    """A routed expert's weight: held by the expert-parallel ranks, reduced over expert-DP."""
    return getattr(param, "expert_parallel", False)


# ZeRO-2, overlapped: launching a bucket's reduction first waits for (and frees) the bucket
# launched this many before it; it had a bucket's backward to complete.
MAX_BUCKETS_IN_FLIGHT = 2


def default_bucket_size(data_parallel_size: int) -> int:
    """Megatron's: large enough that a bucket's all-reduce is bandwidth-bound."""
    return max(40_000_000, 1_000_000 * data_parallel_size)


def bucket_size_for(ddp_config: DistributedDataParallelConfig,
                    data_parallel_size: int) -> Optional[int]:
    """Elements per bucket: the configured size, Megatron's default when overlapping, or None
    (one bucket per buffer: nothing to overlap with)."""
    if ddp_config.bucket_size is None and ddp_config.overlap_grad_reduce:
        return default_bucket_size(data_parallel_size)
    return ddp_config.bucket_size


def check_instances(ddp_config: DistributedDataParallelConfig) -> None:
    """The config's optimizer instances are the ones parallel_state made groups for."""
    made = optimizer_instances.num_instances()
    if ddp_config.num_distributed_optimizer_instances != made:
        raise ValueError(f"the data-parallel config asks for "
                         f"{ddp_config.num_distributed_optimizer_instances} optimizer "
                         f"instances, parallel_state made {made}: pass "
                         "num_distributed_optimizer_instances to initialize_model_parallel.")


def params_current_everywhere(model_chunks) -> None:
    """Before something reads whole parameters (a checkpoint save): the step's overlapped
    all-gathers finished, and --fp8-param-gather's high-precision weights gathered."""
    for chunk in model_chunks:
        sync = getattr(chunk, "gather_high_precision_params", None) or \
            getattr(chunk, "finish_param_sync", None)
        if sync is not None:
            sync()


class DistributedDataParallel(torch.nn.Module):
    def __init__(self, config, ddp_config: DistributedDataParallelConfig,
                 module: torch.nn.Module):
        super().__init__()
        self.config = config
        self.ddp_config = ddp_config
        self.module = module
        check_instances(ddp_config)
        # Context-parallel ranks hold the same weights and other tokens of the same
        # sequences: gradients are averaged over DP x CP (the loss is scaled by CP).
        self.data_parallel_group = parallel_state.get_data_parallel_group(
            with_context_parallel=True)
        dp_size = parallel_state.get_data_parallel_world_size(with_context_parallel=True)
        bucket_size = bucket_size_for(ddp_config, dp_size)
        self.is_last_microbatch = True

        by_dtype: Dict[tuple, List[torch.nn.Parameter]] = {}
        for param in module.parameters():
            if param.requires_grad:
                grad_dtype = torch.float32 if ddp_config.grad_reduce_in_fp32 else param.dtype
                # --fp8-param-gather: the FP8 linears' weights in buffers of their own
                fp8 = ddp_config.fp8_param_gather and gathers_in_fp8(param)
                key = (is_expert(param), param.dtype, grad_dtype, fp8)
                by_dtype.setdefault(key, []).append(param)
        # Reverse registration order ~ the order backward produces gradients. Routed experts'
        # gradients are reduced over the ranks holding the same experts (expert-DP); they
        # already hold the sum over their EP ranks' tokens, so they are scaled by 1/DP too.
        self.buffers = [GradBuffer(params[::-1], grad_dtype, bucket_size,
                                   self._reduction_group(expert), 1.0 / dp_size,
                                   shard=ddp_config.use_distributed_optimizer,
                                   shard_grads=ddp_config.shard_gradients,
                                   replica_group=self._replica_group(expert),
                                   fp8_gather=fp8)
                        for (expert, _, grad_dtype, fp8), params in by_dtype.items()]
        self._bucket_of = {p: bucket for b in self.buffers for p, bucket in b.bucket_of.items()}
        # The sharded buckets in forward order (by their first parameter's registration),
        # the order the next forward needs their all-gathers; [:_gathers_launched] are issued.
        position = {p: i for i, p in enumerate(module.parameters())}
        self._gather_order = sorted((b for b in self._buckets() if b.sharded),
                                    key=lambda b: min(position[p] for p in b.params))
        self._gathers_launched = len(self._gather_order)
        self._in_flight = []  # ZeRO-2: overlapped buckets launched, not yet waited for
        self._hooks = [p.register_post_accumulate_grad_hook(weak_hook(self._grad_ready))
                       for p in self._bucket_of]
        if ddp_config.overlap_param_gather:
            self._register_param_gather_waits()
        self.broadcast_params()

    def _reduction_group(self, expert: bool):
        """Where gradients are summed (sharded: the ranks sharing one optimizer instance)."""
        if self.ddp_config.use_distributed_optimizer:
            return optimizer_instances.shard_group(expert)
        if expert:
            return parallel_state.get_expert_data_parallel_group()
        return self.data_parallel_group

    def _replica_group(self, expert: bool):
        """HSDP: the other instances' ranks holding the same shard (None: one instance)."""
        if self.ddp_config.use_distributed_optimizer:
            return optimizer_instances.replica_group(expert)
        return None

    def _buckets(self):
        return [bucket for buffer in self.buffers for bucket in buffer.buckets]

    def _register_param_gather_waits(self) -> None:
        """Before a module runs forward, wait for the all-gather of its own parameters only;
        a parameter read outside its owner's forward waits through param_sync.gathered()."""
        index = {id(b): i for i, b in enumerate(self._gather_order)}
        wait = weak_hook(self._wait_param_gather)
        for i, bucket in enumerate(self._gather_order):
            for param in bucket.params:
                setattr(param, WAIT_ATTR, functools.partial(wait, i))
        for module in self.module.modules():
            buckets = {index[id(self._bucket_of[p])] for p in module.parameters(recurse=False)
                       if p in self._bucket_of}
            if buckets:
                def wait(_module, _inputs, buckets=tuple(sorted(buckets))):
                    for i in buckets:
                        self._wait_param_gather(i)
                self._hooks.append(module.register_forward_pre_hook(wait))

    def _launch_param_gathers(self, upto: int) -> None:
        """Issue the all-gathers of buckets [0, upto] in forward order (once each)."""
        while self._gathers_launched <= min(upto, len(self._gather_order) - 1):
            self._gather_order[self._gathers_launched].start_param_gather(async_op=True)
            self._gathers_launched += 1

    def _wait_param_gather(self, i: int) -> None:
        """Prefetch: bucket i+1's all-gather runs while the modules of bucket i compute
        (Megatron-Core's order; all at once would make the first layer wait behind them)."""
        self._launch_param_gathers(i + 1)
        self._gather_order[i].wait_param_gather()

    def start_param_sync(self, async_op: bool = False) -> None:
        """Distributed optimizer: all-gather every rank's updated parameter shard. With
        ``async_op`` only the first bucket in forward order is issued; each forward pre-hook
        issues the next one (``finish_param_sync`` issues whatever is left)."""
        self.finish_param_sync()  # a previous round still in flight writes the same buffers
        if async_op:
            self._gathers_launched = 0
            self._launch_param_gathers(0)
        else:
            for bucket in self._gather_order:
                bucket.start_param_gather(async_op=False)

    def finish_param_sync(self) -> None:
        """Every parameter is up to date when this returns."""
        self._launch_param_gathers(len(self._gather_order) - 1)
        for bucket in self._gather_order:
            bucket.wait_param_gather()

    def gather_high_precision_params(self) -> None:
        """--fp8-param-gather: bring the FP8 weights' high-precision copies up to date (the
        step gathered only their FP8 bytes); what reads whole weights (a checkpoint save)
        calls this first."""
        self.finish_param_sync()
        for bucket in self._gather_order:
            if bucket.high_precision_stale:
                bucket.start_param_gather(async_op=False, high_precision=True)

    def forward(self, *args, **kwargs):
        if self.ddp_config.shard_gradients and torch.is_grad_enabled() and \
                any(b.awaiting_zero for b in self._buckets()):
            raise RuntimeError(Bucket.RELEASED)
        return self.module(*args, **kwargs)

    def _grad_ready(self, param: torch.nn.Parameter) -> None:
        """Move the fresh gradient into the buffer; launch the bucket's reduction if it is the
        last microbatch and the bucket is now complete."""
        if param.grad is None and not getattr(param, "grad_added_to_main_grad", False):
            return  # a deferred weight in a zero-bubble B: autograd visits it without a grad
        bucket = self._bucket_of[param]
        if self.ddp_config.shard_gradients:
            bucket.ensure_full_grad()  # the bucket's first gradient of the iteration
        if getattr(param, "grad_added_to_main_grad", False):
            # Gradient-accumulation fusion: the layer's backward already added it to main_grad
            # and .grad is only a placeholder (see tensor_parallel.LinearWithGradAllReduce).
            param.grad_added_to_main_grad = False
        else:
            param.main_grad.add_(param.grad)
        param.grad = None
        overlap = self.ddp_config.overlap_grad_reduce
        if (overlap or self.ddp_config.shard_gradients) and self.is_last_microbatch:
            if bucket.mark_ready(param):
                bucket.launch(async_op=overlap)  # ZeRO-2 without overlap: reduced and freed
                if overlap and self.ddp_config.shard_gradients:
                    self._limit_in_flight(bucket)

    def _limit_in_flight(self, launched) -> None:
        self._in_flight.append(launched)
        while len(self._in_flight) > MAX_BUCKETS_IN_FLIGHT:
            self._in_flight.pop(0).finish()

    @contextlib.contextmanager
    def no_sync(self):
        """Accumulate gradients without reducing them (all microbatches but the last)."""
        self.is_last_microbatch = False
        try:
            yield
        finally:
            self.is_last_microbatch = True

    def start_grad_sync(self) -> None:
        """Launch every bucket not launched yet (all of them without overlap)."""
        for bucket in self._buckets():
            bucket.launch(async_op=self.ddp_config.overlap_grad_reduce)

    def finish_grad_sync(self) -> None:
        """After the last backward: gradients in ``main_grad`` are averaged over DP (with the
        distributed optimizer: this rank's shard of each bucket holds the average)."""
        self.start_grad_sync()
        for bucket in self._buckets():
            bucket.finish()  # ZeRO-2: frees the full gradients
            bucket.reset()
        self._in_flight = []  # the next iteration reduces again, even without zeroing

    def zero_grad_buffer(self) -> None:
        """Start an iteration: zero the gradient buffers and forget bucket state."""
        for param in self._bucket_of:
            param.grad = None
        for buffer in self.buffers:
            buffer.reset()

    def broadcast_params(self) -> None:
        """Make every DP replica start from DP rank 0's parameters."""
        src = parallel_state.get_data_parallel_ranks(with_context_parallel=True)[0]
        with torch.no_grad():
            for param in self.module.parameters():
                if is_expert(param):
                    dist.broadcast(param.data,
                                   src=parallel_state.get_expert_data_parallel_ranks()[0],
                                   group=parallel_state.get_expert_data_parallel_group())
                else:
                    dist.broadcast(param.data, src=src, group=self.data_parallel_group)

    def state_dict(self, *args, **kwargs):
        self.finish_param_sync()
        return self.module.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict, strict: bool = True):
        return self.module.load_state_dict(state_dict, strict=strict)
