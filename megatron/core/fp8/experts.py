"""The MoE experts' two projections in FP8: for each local expert e, the tokens routed to it
times its weight, ``x_e @ W[e].T``, with the recipe's three GEMMs of a linear (fp8/linear.py):
each expert's weight is scaled on its own (a tensor, its rows or its 128 x 128 blocks), each
token's activations as in a dense linear. Each expert's quantized weight (and its dgrad
transpose) is cached on the stacked weight for the step, as a dense linear's: quantized once
per step, not per microbatch.

One FP8 GEMM per expert and direction, over contiguous slices (the experts' counts come to the
host once per layer, as the loop fallback of experts.py needs them too). The rowwise recipe's
forward and dgrad are grouped instead (fp8/grouped.py): the whole x (dy) and the stacked
weights quantized once, then torch's grouped FP8 GEMM (``torch._scaled_grouped_mm``) over
every expert where a probe on the device agrees with the per-expert GEMMs, the same GEMMs
expert by expert elsewhere; its weight gradient stays per expert.

Expert parallelism keeps whole experts on a rank: nothing to reduce. Expert tensor
parallelism splits fc1's rows and fc2's columns over the ETP group, as a column- and a
row-parallel linear split theirs: ``use_fp8`` gives the two projections the Fp8Gemms of those
kinds over the ETP group, so the amax all-reduces make an ETP rank quantize its shard as one
process quantizes the whole expert (every ETP rank sees the same tokens per expert, so the
all-reduces happen in the same order on all of them).
"""
from typing import List

import torch

from megatron.core.fp8.grouped import grouped_gemm, stacked_rows
from megatron.core.fp8.linear import Fp8Gemms, _cached_weight
from megatron.core.fp8.quantize import ROWWISE


def _grouped(gemms: Fp8Gemms, tokens: int) -> bool:
    """The rowwise recipe, with tokens to quantize (no expert of this rank has any: the loop,
    which does nothing)."""
    return isinstance(gemms, Fp8Gemms) and gemms.act == gemms.weight == ROWWISE and tokens > 0


def _stacked_weight(gemms: Fp8Gemms, weight: torch.Tensor, transpose: bool):
    """The experts' weights [E, N, K] (dgrad: their transposes [E, K, N]) quantized in rows,
    cached for the step: (data, scales [E, rows]). A row's scale spans the expert-TP shards
    where it runs along the sharded dimension (fc2's K, fc1's N), as a dense linear's."""
    experts = weight.shape[0]
    rows = weight.transpose(1, 2) if transpose else weight
    sharded = gemms.kind == ("column" if transpose else "row")
    q = _cached_weight(weight, gemms._key("grouped dgrad" if transpose else "grouped"),
                       lambda: gemms._quantize(rows.detach().reshape(-1, rows.shape[-1]),
                                               gemms.config.forward_dtype, ROWWISE, sharded))
    return stacked_rows(q, experts)


class _Fp8ExpertLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, counts: List[int], gemms: Fp8Gemms):
        ctx.save_for_backward(x, weight)
        ctx.counts, ctx.gemms = counts, gemms
        if _grouped(gemms, x.shape[0]):
            return grouped_gemm(gemms._input(x), *_stacked_weight(gemms, weight, False),
                                counts, x.dtype)
        out = x.new_empty(x.shape[0], weight.shape[1])
        start = 0
        for e, n in enumerate(counts):
            if n:
                out[start:start + n] = gemms.forward(x[start:start + n], weight, e)
            start += n
        return out

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        gemms = ctx.gemms
        grad = grad.contiguous()
        # Every row belongs to an expert (the counts sum to N); an idle expert's weight
        # gradient stays zero.
        grouped = _grouped(gemms, x.shape[0])
        grad_x = torch.empty_like(x) if ctx.needs_input_grad[0] else None
        if grouped and grad_x is not None:
            grad_x = grouped_gemm(gemms.quantize_grad(grad),
                                  *_stacked_weight(gemms, weight, True), ctx.counts, x.dtype)
        grad_w = torch.zeros_like(weight) if ctx.needs_input_grad[1] else None
        start = 0
        for e, n in enumerate(ctx.counts):
            if n:
                rows = slice(start, start + n)
                # the rowwise wgrad quantizes grad.T itself: no grad_q to share
                grad_q = None if grouped else gemms.quantize_grad(grad[rows])
                if grad_x is not None and not grouped:
                    grad_x[rows] = gemms.dgrad(grad[rows], weight, grad_q, e)
                if grad_w is not None:
                    grad_w[e] = gemms.wgrad(grad[rows], x[rows], weight.dtype, grad_q)
            start += n
        return grad_x, grad_w, None, None


def fp8_expert_linear(x: torch.Tensor, weight: torch.Tensor, counts: List[int],
                      gemms: Fp8Gemms) -> torch.Tensor:
    """x [N, K] grouped by expert (``counts`` rows each), weight [E, M, K] -> [N, M]."""
    return _Fp8ExpertLinear.apply(x, weight, list(counts), gemms)
