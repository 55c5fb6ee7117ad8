"""The three GEMMs of a linear layer in FP8, for the tensor-parallel layers' autograd function
(which keeps the TP communication, sequence parallelism, gradient-accumulation fusion and the
zero-bubble split; ``tensor_parallel/layers.py``):

    forward   y  = x @ W.T        contracts K: x [M, K] per token, W [N, K] per output row
    dgrad     dx = dy @ W         contracts N: dy [M, N] per token, W.T [K, N]
    wgrad     dW = dy.T @ x       contracts M: dy.T [N, M], x.T [K, M] (tokens contracted)

Operand scalings per recipe (activations and gradients ``act``, the weight ``weight``):
tensorwise both tensorwise; rowwise both rowwise; blockwise 1 x 128 tiles for activations
and gradients, 128 x 128 blocks for the weight. The forward operands are e4m3, the output
gradient e4m3 or (``hybrid``) e5m2. Accumulation is fp32; outputs are in the activation's
dtype.

Quantized once: the weight per optimizer step (cached on the parameter until its version
changes, i.e. until the optimizer writes it), and reused transposed for dgrad where the
recipe's groups transpose exactly (a tensor's scale, a 128 x 128 block's); rowwise needs
the weight's columns scaled, a second quantization of the same step's weight, cached too.
The output gradient is quantized once for dgrad and, transposed the same way, for wgrad
(rowwise and blockwise: again along the tokens).
"""
from typing import Optional

import torch

from megatron.core.fp8.config import Fp8Config
from megatron.core.fp8.gemm import fp8_gemm
from megatron.core.fp8.quantize import (
    BLOCKS_128x128,
    ROWWISE,
    TENSORWISE,
    TILES_1x128,
    Quantized,
    quantize,
)

_SCALINGS = {"tensorwise": (TENSORWISE, TENSORWISE), "rowwise": (ROWWISE, ROWWISE),
             "blockwise": (TILES_1x128, BLOCKS_128x128)}


def _transposed(q: Quantized) -> Quantized:
    """``q`` of the transposed tensor, where its groups transpose exactly (no new scales)."""
    if q.scaling not in (TENSORWISE, BLOCKS_128x128):
        raise ValueError(f"{q.scaling} groups do not transpose")
    scale = q.scale.t().contiguous() if q.scaling == BLOCKS_128x128 else q.scale
    return Quantized(q.data.t().contiguous(), scale, q.scaling)


def _cached_weight(weight: torch.Tensor, key: str, make) -> Quantized:
    """The quantized weight of this optimizer step: recomputed when ``weight``'s version
    (bumped by every in-place write, the optimizer's included) or storage changes."""
    stamp = (weight._version, weight.data_ptr(), key)
    cache = getattr(weight, "_fp8_cache", None)
    if cache is None or cache[0] != stamp:
        cache = (stamp, make())
        weight._fp8_cache = cache
    return cache[1]


class Fp8Gemms:
    """The three GEMMs of ``config``'s recipe; inputs and outputs 2-D in high precision."""

    def __init__(self, config: Fp8Config):
        self.config = config
        self.act, self.weight = _SCALINGS[config.recipe]

    def _quantize(self, x, dtype, scaling):
        return quantize(x, dtype, scaling, self.config.margin)

    def _weight(self, weight: torch.Tensor) -> Quantized:
        """W [N, K] for the forward."""
        dtype = self.config.forward_dtype
        return _cached_weight(weight, f"forward {self.config.recipe} {self.config.margin}",
                              lambda: self._quantize(weight.detach(), dtype, self.weight))

    def _weight_t(self, weight: torch.Tensor) -> Quantized:
        """W.T [K, N] for dgrad."""
        if self.weight in (TENSORWISE, BLOCKS_128x128):
            return _cached_weight(weight, f"dgrad {self.config.recipe} {self.config.margin}",
                                  lambda: _transposed(self._weight(weight)))
        dtype = self.config.forward_dtype
        return _cached_weight(weight, f"dgrad {self.config.recipe} {self.config.margin}",
                              lambda: self._quantize(weight.detach().t(), dtype, self.weight))

    def forward(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        xq = self._quantize(x, self.config.forward_dtype, self.act)
        return fp8_gemm(xq, self._weight(weight), x.dtype)

    def dgrad(self, grad: torch.Tensor, weight: torch.Tensor,
              grad_q: Optional[Quantized] = None) -> torch.Tensor:
        gq = grad_q if grad_q is not None else self.quantize_grad(grad)
        return fp8_gemm(gq, self._weight_t(weight), grad.dtype)

    def quantize_grad(self, grad: torch.Tensor) -> Quantized:
        return self._quantize(grad, self.config.gradient_dtype, self.act)

    def wgrad(self, grad: torch.Tensor, x: torch.Tensor, out_dtype: torch.dtype,
              grad_q: Optional[Quantized] = None) -> torch.Tensor:
        """dW [N, K] = grad.T @ x, both [M, *]: the tokens contracted."""
        if self.act == TENSORWISE:
            gq = _transposed(grad_q if grad_q is not None else self.quantize_grad(grad))
            xq = _transposed(self._quantize(x, self.config.forward_dtype, TENSORWISE))
        else:
            gq = self._quantize(grad.t(), self.config.gradient_dtype, self.act)
            xq = self._quantize(x.t(), self.config.forward_dtype, self.act)
        return fp8_gemm(gq, xq, out_dtype)


def use_fp8(module: torch.nn.Module, config: Fp8Config) -> int:
    """Run the GEMMs of every column- and row-parallel linear in ``module`` in FP8; returns
    how many. (The MoE experts' grouped GEMMs are not these layers and stay as they are.)"""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    gemms = Fp8Gemms(config)
    count = 0
    for layer in module.modules():
        if isinstance(layer, (ColumnParallelLinear, RowParallelLinear)):
            layer.fp8 = gemms
            count += 1
    return count
