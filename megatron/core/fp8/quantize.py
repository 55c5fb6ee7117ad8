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
"""
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from megatron.core.fp8.config import TILE, fp8_max

TENSORWISE, ROWWISE, TILES_1x128, BLOCKS_128x128 = "tensorwise", "rowwise", "1x128", "128x128"
SCALINGS = (TENSORWISE, ROWWISE, TILES_1x128, BLOCKS_128x128)


@dataclass
class Quantized:
    """An FP8 operand: ``data`` [rows, cols] (contraction dimension last) and its fp32 decode
    ``scale`` for ``scaling`` (one of SCALINGS)."""
    data: torch.Tensor
    scale: torch.Tensor
    scaling: str

    @property
    def shape(self):
        return self.data.shape


def _encode(amax: torch.Tensor, dtype: torch.dtype, margin: int) -> torch.Tensor:
    amax = amax.float()
    encode = fp8_max(dtype) / amax / (2.0 ** margin)
    return torch.where(amax > 0, encode, torch.ones_like(encode))


def _cast(x: torch.Tensor, encode: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    top = fp8_max(dtype)
    return (x.float() * encode).clamp_(-top, top).to(dtype)


def _padded(x: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """``x`` zero-padded at the end to [rows, cols] (zeros do not change an amax)."""
    r, c = x.shape
    if (r, c) == (rows, cols):
        return x
    return torch.nn.functional.pad(x, (0, cols - c, 0, rows - r))


def _tiles(n: int) -> int:
    return -(-n // TILE)


def quantize(x: torch.Tensor, dtype: torch.dtype, scaling: str, margin: int = 0,
             reduce_amax: Optional[Callable[[torch.Tensor], None]] = None) -> Quantized:
    """``x`` [rows, cols] (any float dtype, any strides) -> Quantized, contiguous.
    ``reduce_amax`` (tensorwise and rowwise): takes the amax (fp32, in place) to that of the
    whole tensor ``x`` is a shard of, e.g. a MAX all-reduce over the TP ranks, so each shard
    is scaled as the unsharded tensor would be."""
    if x.dim() != 2:
        raise ValueError(f"quantize takes a 2-D operand, got shape {tuple(x.shape)}")
    rows, cols = x.shape
    if scaling in (TENSORWISE, ROWWISE):
        amax = (x.abs().amax() if scaling == TENSORWISE else
                x.abs().amax(dim=1, keepdim=True)).float()
        if reduce_amax is not None:
            reduce_amax(amax)
        encode = _encode(amax, dtype, margin)
        data = _cast(x, encode, dtype)
    elif scaling == TILES_1x128:
        n = _tiles(cols)
        tiles = _padded(x, rows, n * TILE).reshape(rows, n, TILE)
        encode = _encode(tiles.abs().amax(dim=2), dtype, margin)  # [rows, n]
        data = _cast(tiles, encode[:, :, None], dtype).reshape(rows, n * TILE)[:, :cols]
    elif scaling == BLOCKS_128x128:
        nr, nc = _tiles(rows), _tiles(cols)
        blocks = _padded(x, nr * TILE, nc * TILE).reshape(nr, TILE, nc, TILE)
        encode = _encode(blocks.abs().amax(dim=(1, 3)), dtype, margin)  # [nr, nc]
        data = _cast(blocks, encode[:, None, :, None], dtype).reshape(
            nr * TILE, nc * TILE)[:rows, :cols]
    else:
        raise ValueError(f"unknown scaling {scaling!r}; one of {', '.join(SCALINGS)}")
    return Quantized(data.contiguous(), torch.reciprocal(encode), scaling)


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
