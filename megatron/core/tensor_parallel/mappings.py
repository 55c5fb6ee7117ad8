"""Autograd functions that move activations into and out of the tensor-parallel region.

Each forward has the matching collective in backward (Megatron's f/g operators):
  copy_to        identity      | all-reduce
  reduce_from    all-reduce    | identity
  scatter_to     split last    | all-gather last
  gather_from    all-gather    | split last
and for sequence parallelism, along the first (sequence) dimension:
  scatter_to_sequence_parallel_region       split first      | all-gather first
  gather_from_sequence_parallel_region      all-gather first | reduce-scatter (or split)
  reduce_scatter_to_sequence_parallel_region reduce-scatter  | all-gather first
With one TP rank every operator is the identity and issues no collective.
"""
import torch
import torch.distributed as dist

from megatron.core import collectives, parallel_state


def _tp_size() -> int:
    return parallel_state.get_tensor_model_parallel_world_size()


def _reduce(x: torch.Tensor) -> torch.Tensor:
    if _tp_size() == 1:
        return x
    dist.all_reduce(x, group=parallel_state.get_tensor_model_parallel_group())
    return x


def _split_along_last_dim(x: torch.Tensor) -> torch.Tensor:
    size = _tp_size()
    if size == 1:
        return x
    if x.shape[-1] % size != 0:
        raise ValueError(f"last dimension {x.shape[-1]} is not divisible by TP size {size}.")
    return x.chunk(size, dim=-1)[parallel_state.get_tensor_model_parallel_rank()].contiguous()


def _split_along_first_dim(x: torch.Tensor) -> torch.Tensor:
    size = _tp_size()
    if size == 1:
        return x
    if x.shape[0] % size != 0:
        raise ValueError(f"sequence length {x.shape[0]} is not divisible by TP size {size}; "
                         f"sequence parallelism needs seq-length % tensor-model-parallel-size == 0.")
    return x.chunk(size, dim=0)[parallel_state.get_tensor_model_parallel_rank()].contiguous()


def gather_along_first_dim(x: torch.Tensor, async_op: bool = False):
    """All-gather along dim 0. With ``async_op`` returns (output, handle or None)."""
    size = _tp_size()
    if size == 1:
        return (x, None) if async_op else x
    x = x.contiguous()
    out = torch.empty((x.shape[0] * size, *x.shape[1:]), dtype=x.dtype, device=x.device)
    handle = collectives.all_gather_into_tensor(
        out, x, group=parallel_state.get_tensor_model_parallel_group(), async_op=async_op)
    return (out, handle) if async_op else out


def reduce_scatter_along_first_dim(x: torch.Tensor, async_op: bool = False):
    """Sum over TP ranks and keep this rank's dim-0 chunk. With ``async_op`` returns
    (output, handle or None)."""
    size = _tp_size()
    if size == 1:
        return (x, None) if async_op else x
    if x.shape[0] % size != 0:
        raise ValueError(f"first dimension {x.shape[0]} is not divisible by TP size {size}.")
    x = x.contiguous()
    out = torch.empty((x.shape[0] // size, *x.shape[1:]), dtype=x.dtype, device=x.device)
    handle = collectives.reduce_scatter_tensor(
        out, x, group=parallel_state.get_tensor_model_parallel_group(), async_op=async_op)
    return (out, handle) if async_op else out


def _gather_along_last_dim(x: torch.Tensor) -> torch.Tensor:
    size = _tp_size()
    if size == 1:
        return x
    # One flat all-gather along dim 0, with the last dim moved there and back.
    return gather_along_first_dim(x.movedim(-1, 0)).movedim(0, -1).contiguous()


class _CopyToModelParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x

    @staticmethod
    def backward(ctx, grad):
        return _reduce(grad.clone() if _tp_size() > 1 else grad)


class _ReduceFromModelParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        # All-reduce in place, no copy: the callers pass a partial sum that only this reduction
        # reads (a GEMM output, the masked embedding lookup). mark_dirty bumps its version, so
        # autograd raises rather than silently using it if something had saved it.
        if _tp_size() > 1:
            ctx.mark_dirty(x)
        return _reduce(x)

    @staticmethod
    def backward(ctx, grad):
        return grad


class _ScatterToModelParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return _split_along_last_dim(x)

    @staticmethod
    def backward(ctx, grad):
        return _gather_along_last_dim(grad)


class _GatherFromModelParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return _gather_along_last_dim(x)

    @staticmethod
    def backward(ctx, grad):
        return _split_along_last_dim(grad)


class _ScatterToSequenceParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return _split_along_first_dim(x)

    @staticmethod
    def backward(ctx, grad):
        return gather_along_first_dim(grad)


class _GatherFromSequenceParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, tensor_parallel_output_grad):
        ctx.tensor_parallel_output_grad = tensor_parallel_output_grad
        return gather_along_first_dim(x)

    @staticmethod
    def backward(ctx, grad):
        # If the consumer of the gathered tensor is tensor-parallel, each rank holds a partial
        # gradient and they must be summed; otherwise each rank holds the whole gradient.
        if ctx.tensor_parallel_output_grad:
            return reduce_scatter_along_first_dim(grad), None
        return _split_along_first_dim(grad), None


class _ReduceScatterToSequenceParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return reduce_scatter_along_first_dim(x)

    @staticmethod
    def backward(ctx, grad):
        return gather_along_first_dim(grad)


def copy_to_tensor_model_parallel_region(x):
    return _CopyToModelParallelRegion.apply(x)


def reduce_from_tensor_model_parallel_region(x):
    return _ReduceFromModelParallelRegion.apply(x)


def scatter_to_tensor_model_parallel_region(x):
    return _ScatterToModelParallelRegion.apply(x)


def gather_from_tensor_model_parallel_region(x):
    return _GatherFromModelParallelRegion.apply(x)


def scatter_to_sequence_parallel_region(x):
    return _ScatterToSequenceParallelRegion.apply(x)


def gather_from_sequence_parallel_region(x, tensor_parallel_output_grad: bool = True):
    return _GatherFromSequenceParallelRegion.apply(x, tensor_parallel_output_grad)


def reduce_scatter_to_sequence_parallel_region(x):
    return _ReduceScatterToSequenceParallelRegion.apply(x)
