"""The MoE experts' two projections in FP8: for each local expert e, the tokens routed to it
times its weight, ``x_e @ W[e].T``, with the recipe's three GEMMs of a linear (fp8/linear.py):
each expert's weight is scaled on its own (a tensor, its rows or its 128 x 128 blocks), each
token's activations as in a dense linear.

One FP8 GEMM per expert and direction, over contiguous slices (the experts' counts come to the
host once per layer, as the loop fallback of experts.py needs them too). torch's grouped FP8
GEMM (``torch._scaled_grouped_mm``, rowwise, CUDA only) would run the experts in one kernel;
it is the next step on a GPU, where it can be measured and checked against this path.

Expert parallelism keeps whole experts on a rank: nothing to reduce. Expert tensor
parallelism splits fc1's rows and fc2's columns over the ETP group, as a column- and a
row-parallel linear split theirs: ``use_fp8`` gives the two projections the Fp8Gemms of those
kinds over the ETP group, so the amax all-reduces make an ETP rank quantize its shard as one
process quantizes the whole expert (every ETP rank sees the same tokens per expert, so the
all-reduces happen in the same order on all of them).
"""
from typing import List

import torch

from megatron.core.fp8.linear import Fp8Gemms


class _Fp8ExpertLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, counts: List[int], gemms: Fp8Gemms):
        ctx.save_for_backward(x, weight)
        ctx.counts, ctx.gemms = counts, gemms
        out = x.new_empty(x.shape[0], weight.shape[1])
        start = 0
        for e, n in enumerate(counts):
            if n:
                out[start:start + n] = gemms.forward(x[start:start + n], weight[e])
            start += n
        return out

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        gemms = ctx.gemms
        grad = grad.contiguous()
        # Every row belongs to an expert (the counts sum to N); an idle expert's weight
        # gradient stays zero.
        grad_x = torch.empty_like(x) if ctx.needs_input_grad[0] else None
        grad_w = torch.zeros_like(weight) if ctx.needs_input_grad[1] else None
        start = 0
        for e, n in enumerate(ctx.counts):
            if n:
                rows = slice(start, start + n)
                grad_q = gemms.quantize_grad(grad[rows])
                if grad_x is not None:
                    grad_x[rows] = gemms.dgrad(grad[rows], weight[e], grad_q)
                if grad_w is not None:
                    grad_w[e] = gemms.wgrad(grad[rows], x[rows], weight.dtype, grad_q)
            start += n
        return grad_x, grad_w, None, None


def fp8_expert_linear(x: torch.Tensor, weight: torch.Tensor, counts: List[int],
                      gemms: Fp8Gemms) -> torch.Tensor:
    """x [N, K] grouped by expert (``counts`` rows each), weight [E, M, K] -> [N, M]."""
    return _Fp8ExpertLinear.apply(x, weight, list(counts), gemms)
