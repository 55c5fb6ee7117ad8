"""Current scaling: a tensor to FP8 with the scales that bring it back, per recipe.

Every quantized operand is 2-D with the GEMM's contraction dimension last (row-major), as
``torch._scaled_mm`` takes its first operand; the caller transposes first where a GEMM
contracts the other dimension (the weight gradient contracts tokens). For each scaling group
(the tensor, a row, a 1 x 128 tile or a 128 x 128 block) with absolute maximum ``amax``:

    encode = max_fp8 / amax / 2^margin        (1 where amax is 0: an all-zero group)
    data   = clamp(x * encode, -max_fp8, max_fp8) cast to FP8 (round to nearest even)
    scale  = 1 / encode                       (the decode scale the GEMMs multiply by)

in fp32. The clamp saturates: torch's cast to ``float8_e4m3fn`` turns an out-of-range value
into NaN (the format has no infinity), and values past ``amax`` appear only when the margin
is negative, which the config refuses; it stays as the rule a reference can follow exactly.

Scale shapes: tensorwise ``()``, rowwise ``(rows, 1)``, 1 x 128 tiles ``(rows, ceil(cols /
128))``, 128 x 128 blocks ``(ceil(rows / 128), ceil(cols / 128))``. A dimension that is not a
multiple of 128 ends in a partial tile whose amax is over the values it has; the data keeps
the tensor's shape (no padding is stored: the GEMM pads where its kernel needs it).

Passes over ``x``: one reduction for the amaxes (``vector_norm(inf)``: no ``|x|`` copy), then
the encode scales (tiny tensors, eager: the division stays out of compiled code, whose
division and reciprocal need not round as eager's do), then one scale-clamp-cast pass. With
``compile`` (the layers' ``--torch-compile``) that pass is one inductor kernel writing the
FP8 bytes (and with ``transpose`` their transposed copy); eager it is a fp32 product (no
fp32 copy of a bf16 ``x`` first), an in-place clamp and the cast. Both are the same
arithmetic element for element (tests/unit/test_fp8_fused.py checks the bytes).
"""
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from megatron.core.compiled import compiled_any_shape
from megatron.core.fp8.config import TILE, fp8_max

TENSORWISE, ROWWISE, TILES_1x128, BLOCKS_128x128 = "tensorwise", "rowwise", "1x128", "128x128"
SCALINGS = (TENSORWISE, ROWWISE, TILES_1x128, BLOCKS_128x128)


@dataclass
class Quantized:
    """An FP8 operand: ``data`` [rows, cols] (contraction dimension last) and its fp32 decode
    ``scale`` for ``scaling`` (one of SCALINGS); ``transposed``: the same values transposed
    (tensorwise, where asked for), or None."""
    data: torch.Tensor
    scale: torch.Tensor
    scaling: str
    transposed: Optional["Quantized"] = None

    @property
    def shape(self):
        return self.data.shape


def encode_scale(amax: torch.Tensor, dtype: torch.dtype, margin: int) -> torch.Tensor:
    """max_fp8 / amax / 2^margin in fp32, 1 where amax is 0 (an all-zero group)."""
    amax = amax.float()
    encode = fp8_max(dtype) / amax / (2.0 ** margin)
    return torch.where(amax > 0, encode, 1.0)


def _padded(x: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """``x`` zero-padded at the end to [rows, cols] (zeros do not change an amax)."""
    r, c = x.shape
    if (r, c) == (rows, cols):
        return x
    return torch.nn.functional.pad(x, (0, cols - c, 0, rows - r))


def _tiles(n: int) -> int:
    return -(-n // TILE)


def group_amax(x: torch.Tensor, scaling: str) -> torch.Tensor:
    """The absolute maximum of each scaling group of ``x`` [rows, cols], fp32, in the scale's
    shape: one reduction over ``x`` (views where 128 divides the sizes, any strides)."""
    inf = float("inf")
    rows, cols = x.shape
    if scaling == TENSORWISE:
        amax = torch.linalg.vector_norm(x, inf)
    elif scaling == ROWWISE:
        amax = torch.linalg.vector_norm(x, inf, dim=1, keepdim=True)
    elif scaling == TILES_1x128:
        n = _tiles(cols)
        amax = torch.linalg.vector_norm(_padded(x, rows, n * TILE).reshape(rows, n, TILE), inf,
                                        dim=2)
    elif scaling == BLOCKS_128x128:
        nr, nc = _tiles(rows), _tiles(cols)
        blocks = _padded(x, nr * TILE, nc * TILE).reshape(nr, TILE, nc, TILE)
        amax = torch.linalg.vector_norm(blocks, inf, dim=(1, 3))
    else:
        raise ValueError(f"unknown scaling {scaling!r}; one of {', '.join(SCALINGS)}")
    return amax.float()


def _scale_and_cast(x: torch.Tensor, encode: torch.Tensor, scaling: str, top: float,
                    dtype: torch.dtype, transpose: bool):
    """clamp(x * encode, -top, top) in fp32, cast to ``dtype``, contiguous [rows, cols] (and
    its transposed copy): eager, or compiled whole by ``compiled_any_shape``."""
    rows, cols = x.shape
    if scaling in (TENSORWISE, ROWWISE):
        # A 2-D fp32 encode: a bf16 x is widened inside the product, no fp32 copy first.
        y = x * encode.reshape(-1, 1)
    elif scaling == TILES_1x128:
        n = encode.shape[1]
        y = (_padded(x, rows, n * TILE).reshape(rows, n, TILE) * encode[:, :, None]).reshape(
            rows, n * TILE)
    else:
        nr, nc = encode.shape
        y = (_padded(x, nr * TILE, nc * TILE).reshape(nr, TILE, nc, TILE)
             * encode[:, None, :, None]).reshape(nr * TILE, nc * TILE)
    data = y.clamp_(-top, top).to(dtype)[:rows, :cols].contiguous()
    return data, (data.t().contiguous() if transpose else None)


def _compiled_cast(x: torch.Tensor, encode: torch.Tensor, scaling: str, dtype: torch.dtype,
                   transpose: bool):
    """The compiled pass for this call: one compiled copy (compiled_any_shape's key) per
    recipe, dtypes, layout (row-major or transposed ``x``), padding (a partial tile) and size-1
    dimension (dynamo specializes those), so each copy holds about one graph and the sizes
    vary freely within it: a model's linears take a few copies, none near the recompile
    limit."""
    if scaling == TILES_1x128:
        padded = x.shape[1] % TILE != 0
    elif scaling == BLOCKS_128x128:
        padded = x.shape[0] % TILE != 0 or x.shape[1] % TILE != 0
    else:
        padded = False
    key = (scaling, x.dtype, dtype, transpose, x.stride(1) == 1, padded,
           tuple(d == 1 for d in (*x.shape, *encode.shape)))
    return compiled_any_shape(_scale_and_cast, key)


def quantize(x: torch.Tensor, dtype: torch.dtype, scaling: str, margin: int = 0,
             reduce_amax: Optional[Callable[[torch.Tensor], None]] = None,
             compile: bool = False, transpose: bool = False,
             encode: Optional[torch.Tensor] = None) -> Quantized:
    """``x`` [rows, cols] (any float dtype, any strides) -> Quantized, contiguous.
    ``reduce_amax`` (tensorwise and rowwise): takes the amax (fp32, in place) to that of the
    whole tensor ``x`` is a shard of, e.g. a MAX all-reduce over the TP ranks, so each shard
    is scaled as the unsharded tensor would be. ``compile``: the cast as one compiled kernel
    (the same bytes). ``transpose`` (tensorwise): also ``.transposed``, written by the same
    pass. ``encode`` (tensorwise): the encode scale to cast with, given (delayed scaling's,
    from an amax history: fp8/delayed.py) in place of one from ``x``'s amax."""
    if x.dim() != 2:
        raise ValueError(f"quantize takes a 2-D operand, got shape {tuple(x.shape)}")
    if transpose and scaling != TENSORWISE:
        raise ValueError(f"{scaling} groups do not transpose")
    if encode is None:
        amax = group_amax(x, scaling)
        if reduce_amax is not None and scaling in (TENSORWISE, ROWWISE):
            reduce_amax(amax)
        encode = encode_scale(amax, dtype, margin)
    elif scaling != TENSORWISE:
        raise ValueError(f"a given encode scale is tensorwise, not {scaling}")
    cast = _compiled_cast(x, encode, scaling, dtype, transpose) if compile else _scale_and_cast
    data, data_t = cast(x, encode, scaling, fp8_max(dtype), dtype, transpose)
    scale = torch.reciprocal(encode)
    q = Quantized(data, scale, scaling)
    if data_t is not None:
        q.transposed = Quantized(data_t, scale, scaling)
    return q


def expanded_scale(q: Quantized) -> torch.Tensor:
    """The decode scale of every element, [rows, cols] (fp32)."""
    rows, cols = q.shape
    scale = q.scale
    if q.scaling in (TENSORWISE, ROWWISE):
        return scale.expand(rows, cols)
    if q.scaling == TILES_1x128:
        return scale.repeat_interleave(TILE, dim=1)[:, :cols]
    return scale.repeat_interleave(TILE, dim=0).repeat_interleave(TILE, dim=1)[:rows, :cols]


def dequantize(q: Quantized, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The values ``q`` stands for: data x scale in fp32, then cast to ``dtype``."""
    return (q.data.float() * expanded_scale(q)).to(dtype)
