"""An FP8 linear's input between its forward and its weight gradient
(``layers.LinearWithGradAllReduce``, FP8 with a recipe whose wgrad reuses the forward's
quantized input: ``Fp8Gemms.reuses_input``, tensorwise).

The layer keeps x's FP8 bytes and scale for backward in place of the high-precision input:
x.T [K, M] as the forward wrote it, or under sequence parallelism this rank's rows of the
gathered x [m, K] (the same bytes a rank's shard quantizes to with the gathered tensor's
scale), which backward all-gathers as bytes (half a bf16 gather) and wgrad transposes. Both
stay correct wherever the high-precision input went before: the fused accumulation into
``main_grad`` and the zero-bubble split's deferred W take the same pair.
"""
import torch

from megatron.core import parallel_state
from megatron.core.tensor_parallel.mappings import gather_along_first_dim


def fp8_forward(fp8, total_input, input_, weight, sequence_parallel):
    """``total_input @ weight.T`` by FP8 GEMM, in the dtype torch.matmul would give
    (autocast's where it is on), and what to keep for wgrad: (data, scale) or None."""
    x = total_input.reshape(-1, total_input.shape[-1])
    if torch.is_autocast_enabled(x.device.type):
        x = x.to(torch.get_autocast_dtype(x.device.type))
    kept = None
    if getattr(fp8, "reuses_input", False):  # a stand-in without it: keep x
        rows = None
        if sequence_parallel:
            m = input_.numel() // input_.shape[-1]
            rank = parallel_state.get_tensor_model_parallel_rank()
            rows = slice(rank * m, (rank + 1) * m)
        out, kept = fp8.forward_keeping_input(x, weight, rows)
    else:
        out = fp8.forward(x, weight)
    # _unsafe_view, as torch.matmul's own 3-D path: a plain view of a tensor made inside a
    # custom Function may not be modified in place (the TP all-reduce does).
    return torch.ops.aten._unsafe_view(out, (*total_input.shape[:-1], weight.shape[0])), kept


def gather_kept(data: torch.Tensor, sequence_parallel: bool = True, async_op: bool = False):
    """The kept FP8 data of the whole input: as kept, or (sequence parallelism) the ranks'
    rows all-gathered as bytes. Returns (data, handle or None): wait on the handle before
    reading the data."""
    if not sequence_parallel:
        return data, None
    out, handle = gather_along_first_dim(data.view(torch.uint8), async_op=True)
    if not async_op and handle is not None:
        handle.wait()
        handle = None
    return out.view(data.dtype), handle
