"""The block scales as torch's native block-scaled GEMM takes them (fp8/gemm.py's
``native_scale_layout``): element for element the documented layout (a 1 x 128 operand's
[rows, K/128] outer-dim-major; a 128 x 128 operand's [L4, rows/128], L4 = K/128 rounded up to
4, K-blocks contiguous, zero-padded), and accepted by torch's own shape and stride checks
(its meta kernel, on CPU), which refuse the row-major layout the first version passed."""
import pytest
import torch
import torch.nn.functional as F

from megatron.core.fp8.config import E4M3, TILE
from megatron.core.fp8.gemm import native_blockwise, native_scale_layout
from megatron.core.fp8.quantize import BLOCKS_128x128, TILES_1x128, quantize


def _q(rows, k, scaling):
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows + k))
    return quantize(x * torch.logspace(-2, 2, k), E4M3, scaling)


@pytest.mark.parametrize("k_blocks", [1, 2, 4, 5])
def test_the_scales_are_laid_out_as_documented(k_blocks):
    rows = 3 * TILE
    tiles = _q(rows, k_blocks * TILE, TILES_1x128)
    s = native_scale_layout(tiles)
    assert s.shape == (rows, k_blocks) and (k_blocks == 1 or s.stride() == (1, rows))
    for r in range(rows):
        for k in range(k_blocks):
            assert s[r, k] == tiles.scale[r, k]
            if k_blocks > 1:  # outer-dim-major: rows adjacent in memory
                assert s.as_strided((s.numel(),), (1,))[k * rows + r] == tiles.scale[r, k]
    blocks = _q(rows, k_blocks * TILE, BLOCKS_128x128)
    s = native_scale_layout(blocks)
    l4 = -(-k_blocks // 4) * 4
    assert s.shape == (l4, rows // TILE) and s.stride() == (1, l4)
    flat = s.as_strided((s.numel(),), (1,))
    for n in range(rows // TILE):
        for k in range(l4):
            want = blocks.scale[n, k] if k < k_blocks else 0.0
            assert s[k, n] == want and flat[n * l4 + k] == want


@pytest.mark.parametrize("b_scaling", [BLOCKS_128x128, TILES_1x128])
def test_torchs_checks_accept_the_layout(b_scaling):
    """scaled_mm on meta tensors runs torch's shape/stride checks for the block scalings
    (torch/_meta_registrations.py, the CUDA kernel's checks mirrored) without a GPU."""
    m, n, k = 256, 384, 640
    a, b = _q(m, k, TILES_1x128), _q(n, k, b_scaling)
    recipes = {TILES_1x128: F.ScalingType.BlockWise1x128,
               BLOCKS_128x128: F.ScalingType.BlockWise128x128}

    def call(sa, sb):
        return F.scaled_mm(a.data.to("meta"), b.data.to("meta").t(), sa.to("meta"),
                           F.ScalingType.BlockWise1x128, sb.to("meta"), recipes[b_scaling],
                           output_dtype=torch.float32)

    assert call(native_scale_layout(a), native_scale_layout(b)).shape == (m, n)
    with pytest.raises(RuntimeError):
        call(a.scale, b.scale.t() if b_scaling == TILES_1x128 else b.scale)


def test_no_native_blockwise_on_cpu_and_the_reason_is_recorded():
    from megatron.core.fp8.gemm import NATIVE_BLOCKWISE_WHY

    assert not native_blockwise("cpu", TILES_1x128, BLOCKS_128x128)
    assert "no CUDA" in NATIVE_BLOCKWISE_WHY[("cpu", TILES_1x128, BLOCKS_128x128)]
