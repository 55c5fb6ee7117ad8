"""Column- and row-parallel linear layers and the vocab-parallel embedding.

Weights are initialised as one full fp32 master weight drawn from the CPU generator (which is
seeded alike on every TP rank) and then sliced, so a model starts from the same full weights
whatever its TP size. Layers return ``(output, bias)``: ``bias`` is not None only with
``skip_bias_add``, so the caller can fuse the add into what follows.
"""
import functools
from typing import Callable, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn import Parameter

from megatron.core import device, parallel_state
from megatron.core.model_parallel_config import ModelParallelConfig
from megatron.core.tensor_parallel.fp8_input import fp8_forward, gather_kept
from megatron.core.tensor_parallel.mappings import (
    gather_along_first_dim,
    gather_from_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_along_first_dim,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_tensor_model_parallel_region,
)
from megatron.core.tensor_parallel.utils import vocab_range_for_rank
from megatron.core.tensor_parallel.weight_grad_store import (
    DeferredWeightGrad,
    current_weight_grad_store,
)
from megatron.core.utils import divide


def set_tensor_model_parallel_attributes(param: torch.Tensor, is_parallel: bool,
                                         partition_dim: int, stride: int = 1) -> None:
    """Mark how a parameter is sharded (read by grad clipping, checkpoint conversion)."""
    param.tensor_model_parallel = is_parallel
    param.partition_dim = partition_dim
    param.partition_stride = stride


def param_is_tensor_parallel_duplicate(param: torch.Tensor) -> bool:
    """True on TP ranks > 0 for parameters that every TP rank holds in full."""
    return not getattr(param, "tensor_model_parallel", False) and \
        parallel_state.get_tensor_model_parallel_rank() > 0


def initialize_affine_weight(weight: torch.Tensor, output_size: int, input_size: int,
                             partition_dim: int, init_method: Callable, stride: int = 1) -> None:
    """Fill ``weight`` (this rank's shard) from a full master weight.

    With ``stride`` s the master is cut into s * TP blocks along ``partition_dim`` and rank r
    takes blocks r, r + TP, ...: e.g. SwiGLU's [gate; up] weight (stride 2) gives each rank its
    own gate and up rows, and the full weight is the same whatever the TP size.
    """
    master = torch.empty(output_size, input_size, dtype=torch.float32)
    init_method(master)
    size = parallel_state.get_tensor_model_parallel_world_size()
    rank = parallel_state.get_tensor_model_parallel_rank()
    block = divide(weight.shape[partition_dim], stride, "partition by stride")
    blocks = torch.split(master, block, dim=partition_dim)
    with torch.no_grad():
        weight.copy_(torch.cat(blocks[rank::size], dim=partition_dim))


def _new_weight(rows: int, cols: int, config: ModelParallelConfig) -> Parameter:
    return Parameter(device.empty(rows, cols, dtype=config.params_dtype))


def _new_bias(size: int, config: ModelParallelConfig) -> Parameter:
    return Parameter(device.zeros(size, dtype=config.params_dtype))


_FP32_ACCUMULATE_FROM_HALF: dict = {}


def _fp32_accumulate_from_half_supported(dev: torch.device) -> bool:
    """Whether this device can add a bf16/fp16 GEMM into an fp32 tensor in one kernel
    (aten::addmm.dtype_out: cuBLAS with fp32 C; CUDA builds of recent torch, not CPU)."""
    if dev.type not in _FP32_ACCUMULATE_FROM_HALF:
        a = torch.ones(2, 2, dtype=torch.bfloat16, device=dev)
        c = torch.zeros(2, 2, dtype=torch.float32, device=dev)
        try:
            torch.ops.aten.addmm.dtype_out(c, a, a, torch.float32, out=c)
            _FP32_ACCUMULATE_FROM_HALF[dev.type] = bool((c == 2).all())
        except (RuntimeError, NotImplementedError):
            _FP32_ACCUMULATE_FROM_HALF[dev.type] = False
    return _FP32_ACCUMULATE_FROM_HALF[dev.type]


# Where the weight-gradient GEMM itself accumulates into main_grad (beta = 1): None means
# on CUDA only. Tests set it to exercise that kernel path on CPU.
ACCUMULATE_IN_GEMM = None


def accumulate_weight_grad(main_grad: torch.Tensor, grad_2d: torch.Tensor,
                           input_2d: torch.Tensor) -> None:
    """``main_grad += grad_2d^T @ input_2d`` without a weight-sized temporary where possible.

    On CUDA: one in-place GEMM (beta = 1); bf16/fp16 activations into an fp32 main_grad as one
    GEMM with fp32 output where torch has it (else computed in the activation dtype, then
    added). On CPU the product is computed, then added: the arithmetic of the unfused path,
    so CPU runs are bitwise the same with and without fusion (a GEMM with beta = 1 rounds the
    running sum once per k-block, a few ulps away from mm + add once microbatches
    accumulate). Either way the gradient skips .grad and DDP's hook."""
    in_gemm = ACCUMULATE_IN_GEMM if ACCUMULATE_IN_GEMM is not None else \
        main_grad.device.type == "cuda"
    if in_gemm and grad_2d.dtype == main_grad.dtype:
        main_grad.addmm_(grad_2d.t(), input_2d)
    elif in_gemm and main_grad.dtype == torch.float32 and \
            _fp32_accumulate_from_half_supported(main_grad.device):
        torch.ops.aten.addmm.dtype_out(main_grad, grad_2d.t(), input_2d, torch.float32,
                                       out=main_grad)
    else:
        main_grad.add_(grad_2d.t().matmul(input_2d))


class LinearWithGradAllReduce(torch.autograd.Function):
    """``input @ weight.T + bias`` whose input gradient is summed over TP ranks in backward.

    Under sequence parallelism the input arrives as this rank's sequence shard: it is
    all-gathered in forward, only the shard is kept for backward (re-gathered there, overlapped
    with the input-gradient GEMM), and the input gradient is reduce-scattered back to shards
    (overlapped with the weight-gradient GEMM). Otherwise the input gradient is all-reduced
    (if ``reduce_input_grad``), overlapped with the weight-gradient GEMM.

    Gradient-accumulation fusion (Megatron's): when the weight has a ``main_grad`` (DDP's fp32
    buffer), the weight-gradient GEMM accumulates straight into it instead of producing a
    gradient that DDP's hook then adds (a weight-sized write and read-modify-write per
    microbatch). The weight is marked ``grad_added_to_main_grad`` and its returned gradient is an
    uninitialised placeholder (an allocation only: no arithmetic, no memory traffic) so that
    autograd still runs DDP's post-accumulate hook, which launches overlapped reductions and
    skips the add. See ``accumulate_weight_grad`` for the arithmetic (bitwise the unfused one
    on CPU).

    Split backward (zero-bubble schedules): inside ``deferring_weight_grads(store)`` a
    ``deferrable`` layer's backward is B only (input gradient, its TP reduction, the bias
    gradient) and pushes the weight gradient into the store; W (``store.flush()``) runs the
    same ``_weight_grad_gemm`` later. See ``weight_grad_store``.

    FP8 (``fp8``, an ``fp8.linear.Fp8Gemms``): the forward, input-gradient and weight-gradient
    GEMMs run in FP8 with fp32 accumulation (``megatron/core/fp8``); everything above (the
    gathers, reductions, fusion and the split backward) is unchanged around them, except that
    a tensorwise layer keeps its input's FP8 (``fp8_input``) instead of the input.
    """

    @staticmethod
    def forward(ctx, input_, weight, bias, sequence_parallel, reduce_input_grad,
                gradient_accumulation_fusion=False, deferrable=True, fp8=None):
        ctx.fp8 = fp8
        ctx.use_bias = bias is not None
        ctx.sequence_parallel = sequence_parallel
        ctx.reduce_input_grad = reduce_input_grad
        ctx.gradient_accumulation_fusion = gradient_accumulation_fusion
        ctx.deferrable = deferrable
        total_input = gather_along_first_dim(input_) if sequence_parallel else input_
        kept = None
        if fp8 is not None:
            output, kept = fp8_forward(fp8, total_input, input_, weight, sequence_parallel)
        else:
            output = torch.matmul(total_input, weight.t())
        ctx.fp8_kept = kept is not None  # saved: x's FP8 and scale in place of x
        ctx.save_for_backward(*((kept[0], weight, kept[1]) if kept else (input_, weight)))
        if bias is not None:
            output = output + bias
        return output

    @staticmethod
    def backward(ctx, grad_output):
        input_, param, *kept_scale = ctx.saved_tensors  # input_: x's FP8 where fp8_kept
        weight = param
        cast = weight.dtype != grad_output.dtype  # forward ran under autocast: so does backward
        if cast:
            weight = weight.to(grad_output.dtype)
        need_input_grad, need_weight_grad = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        store = current_weight_grad_store() if ctx.deferrable else None
        if need_weight_grad and store is not None:
            store.push(DeferredWeightGrad(
                param, (grad_output, input_.detach(), *kept_scale),
                functools.partial(_weight_grad, param, cast=cast and not ctx.fp8_kept,
                                  sequence_parallel=ctx.sequence_parallel,
                                  fusion=ctx.gradient_accumulation_fusion, fp8=ctx.fp8)))
            need_weight_grad = False  # W delivers it; B returns None for the weight
        if cast and need_weight_grad and not ctx.fp8_kept:
            input_ = input_.to(grad_output.dtype)
        gather_handle = None
        total_input = input_
        if ctx.sequence_parallel and need_weight_grad:
            gather = gather_kept if ctx.fp8_kept else gather_along_first_dim
            total_input, gather_handle = gather(input_, async_op=True)

        grad_input = reduce_handle = grad_q = None
        if need_input_grad and ctx.fp8 is not None:
            grad_2d = grad_output.reshape(-1, grad_output.shape[-1])
            grad_q = ctx.fp8.quantize_grad(grad_2d)  # reused by the weight gradient
            grad_input = torch.ops.aten._unsafe_view(ctx.fp8.dgrad(grad_2d, weight, grad_q),
                                                     (*grad_output.shape[:-1], weight.shape[1]))
        elif need_input_grad:
            grad_input = grad_output.matmul(weight)
        if gather_handle is not None:
            gather_handle.wait()
        if need_input_grad:
            if ctx.sequence_parallel:
                grad_input, reduce_handle = reduce_scatter_along_first_dim(grad_input,
                                                                           async_op=True)
            elif ctx.reduce_input_grad:
                reduce_handle = dist.all_reduce(
                    grad_input, group=parallel_state.get_tensor_model_parallel_group(),
                    async_op=True)

        grad_weight = grad_bias = None
        if need_weight_grad:  # overlaps the input gradient's reduction
            grad_weight = _weight_grad_gemm(param, grad_output, total_input,
                                            ctx.gradient_accumulation_fusion, ctx.fp8, grad_q,
                                            kept_scale, ctx.sequence_parallel)
        if ctx.use_bias and ctx.needs_input_grad[2]:  # always in B: a column sum, tiny
            grad_bias = grad_output.reshape(-1, grad_output.shape[-1]).sum(dim=0)
        if reduce_handle is not None:
            reduce_handle.wait()
        return grad_input, grad_weight, grad_bias, None, None, None, None, None


def _weight_grad_gemm(param, grad_output, total_input, fusion, fp8=None, grad_q=None,
                      kept_scale=(), kept_rows=False):
    """The weight gradient from the (gathered) input: into ``param.main_grad`` when fused
    (returning the placeholder autograd delivers to DDP's hook), else returned. FP8: the
    GEMM in FP8 (``grad_q``: the output gradient dgrad quantized; with ``kept_scale``,
    ``total_input`` is the input's kept FP8, gathered rows where ``kept_rows``), its fp32
    result added to ``main_grad``."""
    grad_2d = grad_output.reshape(-1, grad_output.shape[-1])
    main_grad = getattr(param, "main_grad", None) if fusion else None
    if fp8 is not None:
        kept = (total_input, kept_scale[0]) if kept_scale else None
        input_2d = None if kept else total_input.reshape(-1, total_input.shape[-1])
        dtype = grad_2d.dtype if main_grad is None else torch.float32
        extra = {"kept": kept, "kept_rows": kept_rows} if kept else {}
        grad_weight = fp8.wgrad(grad_2d, input_2d, dtype, grad_q, **extra)
        if main_grad is None:
            return grad_weight
        main_grad.add_(grad_weight)
        param.grad_added_to_main_grad = True
        return torch.empty_like(param)
    input_2d = total_input.reshape(-1, total_input.shape[-1])
    if main_grad is None:
        return grad_2d.t().matmul(input_2d)
    accumulate_weight_grad(main_grad, grad_2d, input_2d)
    param.grad_added_to_main_grad = True
    return torch.empty_like(param)


def _weight_grad(param, grad_output, input_, *kept_scale, cast, sequence_parallel, fusion,
                 fp8=None):
    """A deferred W: the whole backward's dtype handling, gather and GEMM (``kept_scale``:
    ``input_`` is the input's kept FP8). ``main_grad`` is looked up now, not at B (ZeRO-2
    creates it at the bucket's first gradient)."""
    if kept_scale:
        total_input, _ = gather_kept(input_, sequence_parallel)
    else:
        if cast:
            input_ = input_.to(grad_output.dtype)
        total_input = gather_along_first_dim(input_) if sequence_parallel else input_
    return _weight_grad_gemm(param, grad_output, total_input, fusion, fp8, None, kept_scale,
                             sequence_parallel)


class ColumnParallelLinear(torch.nn.Module):
    """Y = XA + b with A split by columns: rank r computes Y_r = X A_r + b_r.

    ``gather_output`` all-gathers Y along its last dim; otherwise the output stays sharded for a
    following RowParallelLinear. Under sequence parallelism X arrives sharded along the sequence
    (first) dimension and is all-gathered. ``skip_weight_param_allocation`` lets the caller pass
    the weight to ``forward`` (an output layer tied to the embedding).
    """

    def __init__(self, input_size: int, output_size: int, *, config: ModelParallelConfig,
                 init_method: Callable, bias: bool = True, gather_output: bool = False,
                 skip_bias_add: bool = False, stride: int = 1,
                 skip_weight_param_allocation: bool = False):
        super().__init__()
        world_size = parallel_state.get_tensor_model_parallel_world_size()
        self.input_size, self.output_size = input_size, output_size
        self.output_size_per_partition = divide(
            output_size, world_size, "ColumnParallelLinear output size by TP size")
        self.gather_output = gather_output
        self.skip_bias_add = skip_bias_add
        self.fp8 = None  # an fp8.linear.Fp8Gemms: its GEMMs in FP8 (set by use_fp8)
        self.sequence_parallel = config.sequence_parallel and world_size > 1
        self.gradient_accumulation_fusion = config.gradient_accumulation_fusion
        if self.sequence_parallel and gather_output:
            raise ValueError("ColumnParallelLinear: gather_output is incompatible with "
                             "sequence parallelism (the output would be gathered twice).")

        if skip_weight_param_allocation:
            self.weight = None
        else:
            self.weight = _new_weight(self.output_size_per_partition, input_size, config)
            if config.perform_initialization:
                initialize_affine_weight(self.weight, output_size, input_size, 0,
                                         init_method, stride)
            set_tensor_model_parallel_attributes(self.weight, True, 0, stride)
        if bias:
            self.bias = _new_bias(self.output_size_per_partition, config)
            set_tensor_model_parallel_attributes(self.bias, True, 0, stride)
        else:
            self.register_parameter("bias", None)

    def forward(self, input_: torch.Tensor, weight: Optional[torch.Tensor] = None):
        if weight is None:
            if self.weight is None:
                raise RuntimeError("ColumnParallelLinear was built with "
                                   "skip_weight_param_allocation; pass weight to forward().")
            weight = self.weight
        elif weight.shape != (self.output_size_per_partition, self.input_size):
            raise ValueError(f"weight of shape {tuple(weight.shape)} given, expected "
                             f"{(self.output_size_per_partition, self.input_size)}.")
        bias = None if self.skip_bias_add else self.bias
        tp_size = parallel_state.get_tensor_model_parallel_world_size()
        # A weight passed in (the tied embedding), or one with ``has_other_uses`` (the last
        # stage's tied copy that multi-token prediction also looks tokens up in), also gets
        # other gradients through .grad: keep the parts summed before the buffer add, as
        # without fusion (fused, the others would be lost), and its weight gradient in B (see
        # weight_grad_store's docstring).
        own = weight is self.weight
        fusion = own and not getattr(weight, "has_other_uses", False)
        output = LinearWithGradAllReduce.apply(
            input_, weight, bias, self.sequence_parallel, tp_size > 1,
            self.gradient_accumulation_fusion and fusion, own, self.fp8)
        if self.gather_output:
            output = gather_from_tensor_model_parallel_region(output)
        return output, (self.bias if self.skip_bias_add else None)


class ReplicatedLinear(torch.nn.Module):
    """Y = XA (+ b) with the whole A on every TP rank, applied to whatever X this rank has:
    under sequence parallelism its sequence shard (Megatron's "duplicated" linear, e.g. the
    down projections of multi-latent attention). No communication; the weights then see only
    this rank's tokens, so they are marked ``sequence_parallel`` for the TP all-reduce that
    finalising gradients performs. Without sequence parallelism every rank sees all tokens,
    and the caller must make X's consumers deliver whole gradients (a column-parallel layer
    after it all-reduces its input gradient). Initialised from the same full master as the
    parallel layers, so the weight is the same at any TP size."""

    def __init__(self, input_size: int, output_size: int, *, config: ModelParallelConfig,
                 init_method: Callable, bias: bool = False):
        super().__init__()
        world_size = parallel_state.get_tensor_model_parallel_world_size()
        self.input_size, self.output_size = input_size, output_size
        self.fp8 = None  # the GEMMs stay in high precision (no FP8 path sets it)
        self.gradient_accumulation_fusion = config.gradient_accumulation_fusion
        sequence_parallel = config.sequence_parallel and world_size > 1
        self.weight = _new_weight(output_size, input_size, config)
        if config.perform_initialization:
            master = torch.empty(output_size, input_size, dtype=torch.float32)
            init_method(master)
            with torch.no_grad():
                self.weight.copy_(master)
        self.weight.sequence_parallel = sequence_parallel
        if bias:
            self.bias = _new_bias(output_size, config)
            self.bias.sequence_parallel = sequence_parallel
        else:
            self.register_parameter("bias", None)

    def forward(self, input_: torch.Tensor):
        # LinearWithGradAllReduce without its communication: the fused weight-gradient
        # accumulation and the zero-bubble split of the parallel layers.
        output = LinearWithGradAllReduce.apply(input_, self.weight, self.bias, False, False,
                                               self.gradient_accumulation_fusion, True,
                                               self.fp8)
        return output, None


class RowParallelLinear(torch.nn.Module):
    """Y = XA + b with A split by rows and X split by columns: Y = sum_r X_r A_r, then + b once.

    The sum is an all-reduce, or a reduce-scatter along the sequence dimension under sequence
    parallelism. The bias is replicated; under sequence parallelism each rank's bias gradient
    covers only its sequence shard, so it is marked ``sequence_parallel`` for the TP all-reduce
    that finalising gradients performs.
    """

    def __init__(self, input_size: int, output_size: int, *, config: ModelParallelConfig,
                 init_method: Callable, bias: bool = True, input_is_parallel: bool = True,
                 skip_bias_add: bool = False, stride: int = 1):
        super().__init__()
        world_size = parallel_state.get_tensor_model_parallel_world_size()
        self.input_size, self.output_size = input_size, output_size
        self.input_size_per_partition = divide(
            input_size, world_size, "RowParallelLinear input size by TP size")
        self.input_is_parallel = input_is_parallel
        self.skip_bias_add = skip_bias_add
        self.fp8 = None  # an fp8.linear.Fp8Gemms: its GEMMs in FP8 (set by use_fp8)
        self.sequence_parallel = config.sequence_parallel and world_size > 1
        self.gradient_accumulation_fusion = config.gradient_accumulation_fusion
        if self.sequence_parallel and not input_is_parallel:
            raise ValueError("RowParallelLinear: sequence parallelism needs "
                             "input_is_parallel=True.")

        self.weight = _new_weight(output_size, self.input_size_per_partition, config)
        if config.perform_initialization:
            initialize_affine_weight(self.weight, output_size, input_size, 1, init_method, stride)
        set_tensor_model_parallel_attributes(self.weight, True, 1, stride)
        if bias:
            self.bias = _new_bias(output_size, config)
            self.bias.sequence_parallel = self.sequence_parallel
        else:
            self.register_parameter("bias", None)

    def forward(self, input_: torch.Tensor):
        if not self.input_is_parallel:
            input_ = scatter_to_tensor_model_parallel_region(input_)
        # The same GEMMs as F.linear, with the weight gradient accumulated as above.
        partial = LinearWithGradAllReduce.apply(input_, self.weight, None, False, False,
                                                self.gradient_accumulation_fusion, True,
                                                self.fp8)
        if self.sequence_parallel:
            output = reduce_scatter_to_sequence_parallel_region(partial)
        else:
            output = reduce_from_tensor_model_parallel_region(partial)
        if self.skip_bias_add or self.bias is None:
            return output, (self.bias if self.skip_bias_add else None)
        return output + self.bias, None


class VocabParallelEmbedding(torch.nn.Module):
    """Embedding whose rows (the vocabulary) are split across TP ranks.

    Each rank looks up the tokens in its row range, zeroes the others, and the partial results
    are summed: an all-reduce giving [batch, seq, hidden], or with ``reduce_scatter_embeddings``
    a reduce-scatter into this rank's sequence shard of the transposed [seq, batch, hidden]
    (what sequence parallelism wants next).
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, *, config: ModelParallelConfig,
                 init_method: Callable, reduce_scatter_embeddings: bool = False):
        super().__init__()
        world_size = parallel_state.get_tensor_model_parallel_world_size()
        if num_embeddings % world_size != 0:
            raise ValueError(
                f"vocabulary of {num_embeddings} rows is not divisible by tensor-model-parallel "
                f"size {world_size}; pad it with tensor_parallel.vocab_size_with_padding() "
                f"(--make-vocab-size-divisible-by).")
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.reduce_scatter_embeddings = reduce_scatter_embeddings
        self.vocab_start_index, self.vocab_end_index = vocab_range_for_rank(
            num_embeddings, parallel_state.get_tensor_model_parallel_rank(), world_size)
        rows = self.vocab_end_index - self.vocab_start_index
        self.weight = _new_weight(rows, embedding_dim, config)
        if config.perform_initialization:
            initialize_affine_weight(self.weight, num_embeddings, embedding_dim, 0, init_method)
        set_tensor_model_parallel_attributes(self.weight, True, 0)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return vocab_parallel_lookup(input_ids, self.weight, self.reduce_scatter_embeddings)


def vocab_parallel_lookup(input_ids: torch.Tensor, weight: torch.Tensor,
                          reduce_scatter: bool = False) -> torch.Tensor:
    """Look ``input_ids`` [b, s] up in this TP rank's rows ``weight`` of a vocab-parallel
    table (an embedding, or the last pipeline stage's tied copy of it): [b, s, h] summed over
    TP, or with ``reduce_scatter`` this rank's sequence shard of [s, b, h]."""
    tp_size = parallel_state.get_tensor_model_parallel_world_size()
    if tp_size > 1:
        start, end = vocab_range_for_rank(weight.shape[0] * tp_size,
                                          parallel_state.get_tensor_model_parallel_rank(),
                                          tp_size)
        outside = (input_ids < start) | (input_ids >= end)
        local_ids = (input_ids - start).masked_fill(outside, 0)
        partial = F.embedding(local_ids, weight)
        partial = partial.masked_fill(outside.unsqueeze(-1), 0.0)
    else:
        partial = F.embedding(input_ids, weight)
    if reduce_scatter:
        return reduce_scatter_to_sequence_parallel_region(partial.transpose(0, 1).contiguous())
    return reduce_from_tensor_model_parallel_region(partial)


__all__ = [
    "ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding", "vocab_parallel_lookup",
    "LinearWithGradAllReduce", "initialize_affine_weight",
    "set_tensor_model_parallel_attributes", "param_is_tensor_parallel_duplicate",
]
