"""One FP8 GEMM: ``a @ b.T`` of two Quantized operands (both [*, K], the contraction dimension
K last), accumulated in fp32, returned in ``out_dtype``.

- tensorwise and rowwise: ``torch._scaled_mm`` (cuBLAS / CUTLASS on Hopper, a reference
  kernel on CPU), whose decode scales multiply the fp32 accumulator once per output element.
- blockwise (1 x 128 tiles times 128 x 128 blocks, or tiles times tiles): on CUDA through
  ``torch.nn.functional.scaled_mm`` with its block scalings where this torch has them; else,
  and on CPU, one ``_scaled_mm`` per 128-wide slice of K in fp32, its block scales applied
  to that partial sum, summed in fp32 (the same arithmetic: DeepSeek-V3's kernels also apply
  each K block's scales to an fp32 partial sum).
"""
import functools

import torch
import torch.nn.functional as F

from megatron.core.fp8.config import TILE
from megatron.core.fp8.quantize import (
    BLOCKS_128x128,
    ROWWISE,
    TENSORWISE,
    TILES_1x128,
    Quantized,
)

_BLOCK_SCALINGS = {TILES_1x128: "BlockWise1x128", BLOCKS_128x128: "BlockWise128x128"}


def _row_scale(q: Quantized, k_tile: int) -> torch.Tensor:
    """The decode scale of each row of ``q`` for K slice ``k_tile``: [rows] (fp32)."""
    if q.scaling == TILES_1x128:
        return q.scale[:, k_tile]
    if q.scaling == BLOCKS_128x128:
        return q.scale[:, k_tile].repeat_interleave(TILE)[:q.shape[0]]
    raise ValueError(f"{q.scaling} is not a blockwise scaling")


def _blockwise_by_slices(a: Quantized, b: Quantized) -> torch.Tensor:
    """Each 128-wide K slice's FP8 product accumulated in fp32 (unit scales: the tensorwise
    kernel writes fp32 on every device, where CUDA's rowwise one writes bf16 only), then
    scaled by its rows' and columns' decode scales, summed in fp32."""
    one = torch.ones((), device=a.data.device)
    out = None
    for t, lo in enumerate(range(0, a.shape[1], TILE)):
        part = torch._scaled_mm(
            a.data[:, lo:lo + TILE].contiguous(), b.data[:, lo:lo + TILE].contiguous().t(),
            one, one, out_dtype=torch.float32)
        part.mul_(_row_scale(a, t)[:, None]).mul_(_row_scale(b, t)[None, :])
        out = part if out is None else out.add_(part)
    return out


def _native_blockwise_call(a: Quantized, b: Quantized, out_dtype: torch.dtype) -> torch.Tensor:
    return F.scaled_mm(a.data, b.data.t(), a.scale,
                       getattr(F.ScalingType, _BLOCK_SCALINGS[a.scaling]),
                       b.scale.t() if b.scaling == TILES_1x128 else b.scale,
                       getattr(F.ScalingType, _BLOCK_SCALINGS[b.scaling]),
                       output_dtype=out_dtype)


@functools.lru_cache(maxsize=None)
def native_blockwise(device_type: str, a_scaling: str, b_scaling: str) -> bool:
    """Whether this torch runs this pair of block scalings natively on ``device_type`` AND
    gets what the slices get (checked once on random operands: the scale layouts the kernels
    want are not documented alike across versions, and a wrong one would be silent)."""
    if device_type != "cuda" or not hasattr(F, "scaled_mm") or not hasattr(F, "ScalingType"):
        return False
    from megatron.core.fp8.quantize import quantize

    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(2 * TILE, 2 * TILE, device="cuda", generator=g)
    y = torch.randn(3 * TILE, 2 * TILE, device="cuda", generator=g)
    a = quantize(x, torch.float8_e4m3fn, a_scaling)
    b = quantize(y, torch.float8_e4m3fn, b_scaling)
    try:
        got = _native_blockwise_call(a, b, torch.float32)
    except (RuntimeError, NotImplementedError, ValueError):
        return False
    want = _blockwise_by_slices(a, b)
    return bool(((got - want).abs().max() <= 1e-4 * want.abs().max()).item())


def fp8_gemm(a: Quantized, b: Quantized, out_dtype: torch.dtype) -> torch.Tensor:
    """``dequantize(a) @ dequantize(b).T`` with fp32 accumulation, in ``out_dtype``."""
    if a.shape[1] != b.shape[1]:
        raise ValueError(f"fp8_gemm: contraction sizes differ, {tuple(a.shape)} and "
                         f"{tuple(b.shape)}")
    if a.scaling == b.scaling == TENSORWISE:
        return torch._scaled_mm(a.data, b.data.t(), a.scale, b.scale, out_dtype=out_dtype)
    if a.scaling == b.scaling == ROWWISE:
        # CUDA's rowwise kernel writes bf16 only: an fp32 request (the fused weight
        # gradient) gets its bf16 result widened.
        kernel_dtype = torch.bfloat16 if a.data.is_cuda else out_dtype
        return torch._scaled_mm(a.data, b.data.t(), a.scale, b.scale.reshape(1, -1),
                                out_dtype=kernel_dtype).to(out_dtype)
    if a.scaling in _BLOCK_SCALINGS and b.scaling in _BLOCK_SCALINGS:
        if a.shape[1] % TILE == 0 and native_blockwise(a.data.device.type, a.scaling,
                                                       b.scaling):
            return _native_blockwise_call(a, b, out_dtype)
        return _blockwise_by_slices(a, b).to(out_dtype)
    raise ValueError(f"fp8_gemm: no GEMM for {a.scaling} x {b.scaling} scaling")
