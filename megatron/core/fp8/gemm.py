"""One FP8 GEMM: ``a @ b.T`` of two Quantized operands (both [*, K], the contraction dimension
K last), accumulated in fp32, returned in ``out_dtype``.

- tensorwise and rowwise: ``torch._scaled_mm`` (cuBLAS / CUTLASS on Hopper, a reference
  kernel on CPU), whose decode scales multiply the fp32 accumulator once per output element.
- blockwise (1 x 128 tiles times 128 x 128 blocks, or tiles times tiles): on CUDA through
  ``torch.nn.functional.scaled_mm`` with its block scalings where this torch has them (sm90,
  cuBLASLt >= 12.9) and a probe agrees; else, and on CPU, one ``_scaled_mm`` per 128-wide
  slice of K in fp32, its block scales applied to that partial sum, summed in fp32 (the same
  arithmetic: DeepSeek-V3's kernels also apply each K block's scales to an fp32 partial sum).

The block scale layouts cuBLAS wants (``native_scale_layout``; torch's checks in
aten/src/ATen/native/cuda/ScaledBlas.cpp, ``_scaled_block1x128_block128x128`` and
``_scaled_block1x128_block1x128``, and torch/_meta_registrations.py's
``_check_scaled_mm_sizes_v2``), for ``scaled_mm(A [M, K] row-major, B [K, N] column-major)``:
a 1 x 128 operand's scales [rows, K/128] outer-dim-major (strides (1, rows)); a 128 x 128
operand's [L4, rows/128] with L4 = K/128 rounded up to a multiple of 4, strides (1, L4): each
row block's K-block scales contiguous, zero-padded to L4.
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


def native_scale_layout(q: Quantized) -> torch.Tensor:
    """``q.scale`` laid out as scaled_mm's block scalings take it (module docstring): 1 x 128
    tiles [rows, K/128] with strides (1, rows); 128 x 128 blocks [L4, rows/128] with strides
    (1, L4), zero-padded past K/128."""
    if q.scaling == TILES_1x128:
        return q.scale.t().contiguous().t()
    if q.scaling == BLOCKS_128x128:
        k_blocks = q.scale.shape[1]
        return F.pad(q.scale, (0, -k_blocks % 4)).t()
    raise ValueError(f"{q.scaling} is not a blockwise scaling")


def _native_blockwise_call(a: Quantized, b: Quantized, out_dtype: torch.dtype) -> torch.Tensor:
    return F.scaled_mm(a.data, b.data.t(), native_scale_layout(a),
                       getattr(F.ScalingType, _BLOCK_SCALINGS[a.scaling]),
                       native_scale_layout(b),
                       getattr(F.ScalingType, _BLOCK_SCALINGS[b.scaling]),
                       output_dtype=out_dtype)


NATIVE_BLOCKWISE_WHY: dict = {}  # (device type, a's, b's scaling) -> the probe's finding


@functools.lru_cache(maxsize=None)
def native_blockwise(device_type: str, a_scaling: str, b_scaling: str) -> bool:
    """Whether this torch runs this pair of block scalings natively on ``device_type`` AND
    gets what the slices get (checked once on random operands, fp32 and bf16 outputs: a wrong
    layout could be silent). Why not, or how close: ``NATIVE_BLOCKWISE_WHY``."""
    key = (device_type, a_scaling, b_scaling)
    if device_type != "cuda" or not hasattr(F, "scaled_mm") or not hasattr(F, "ScalingType"):
        NATIVE_BLOCKWISE_WHY[key] = "no CUDA, or no torch.nn.functional.scaled_mm"
        return False
    from megatron.core.fp8.quantize import quantize

    g = torch.Generator(device="cuda").manual_seed(0)
    # K of 5 blocks: the 128 x 128 scales' padding to 4 is exercised.
    x = torch.randn(2 * TILE, 5 * TILE, device="cuda", generator=g)
    y = torch.randn(3 * TILE, 5 * TILE, device="cuda", generator=g)
    a = quantize(x, torch.float8_e4m3fn, a_scaling)
    b = quantize(y, torch.float8_e4m3fn, b_scaling)
    want = _blockwise_by_slices(a, b)
    errors = []
    for out_dtype in (torch.float32, torch.bfloat16):
        try:
            got = _native_blockwise_call(a, b, out_dtype).float()
        except (RuntimeError, NotImplementedError, ValueError, TypeError) as exc:
            NATIVE_BLOCKWISE_WHY[key] = (f"refused ({out_dtype}): {type(exc).__name__}: "
                                         f"{' '.join(str(exc).split())[:400]}")
            return False
        errors.append(float((got - want).abs().max() / want.abs().max()))
    # fp32: summation order only; bf16: one rounding (2^-9)
    ok = errors[0] <= 1e-4 and errors[1] <= 2.0 ** -8
    NATIVE_BLOCKWISE_WHY[key] = (f"{'agrees' if ok else 'DISAGREES'}: max error / max "
                                 f"|value| {errors[0]:.1e} (fp32 out), {errors[1]:.1e} (bf16)")
    return ok


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
