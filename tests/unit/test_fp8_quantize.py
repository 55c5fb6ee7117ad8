"""megatron/core/fp8: each recipe's quantization equals a plain-torch reference that walks the
scaling groups one by one (scales, FP8 bytes, partial tiles at dimensions that are not
multiples of 128, all-zero groups, saturation, e4m3 and e5m2) bit for bit, and each FP8 GEMM
equals the fp64 product of its dequantized operands within fp32 accumulation's rounding."""
import pytest
import torch

from megatron.core.fp8 import Fp8Config, dequantize, fp8_gemm, quantize
from megatron.core.fp8.config import E4M3, E5M2, TILE, fp8_max
from megatron.core.fp8.quantize import (
    BLOCKS_128x128,
    ROWWISE,
    TENSORWISE,
    TILES_1x128,
    expanded_scale,
)


def _reference(x, dtype, scaling, margin):
    """(fp8 data, decode scales) group by group: the rule of quantize.py's docstring."""
    rows, cols = x.shape
    if scaling == TENSORWISE:
        groups = [((0, rows), (0, cols))]
    elif scaling == ROWWISE:
        groups = [((r, r + 1), (0, cols)) for r in range(rows)]
    elif scaling == TILES_1x128:
        groups = [((r, r + 1), (c, min(c + TILE, cols)))
                  for r in range(rows) for c in range(0, cols, TILE)]
    else:
        groups = [((r, min(r + TILE, rows)), (c, min(c + TILE, cols)))
                  for r in range(0, rows, TILE) for c in range(0, cols, TILE)]
    top = fp8_max(dtype)
    data = torch.empty(rows, cols, dtype=dtype)
    scales = []
    for (r0, r1), (c0, c1) in groups:
        block = x[r0:r1, c0:c1].float()
        amax = block.abs().max()
        encode = top / amax / (2.0 ** margin) if amax > 0 else torch.tensor(1.0)
        data[r0:r1, c0:c1] = (block * encode).clamp(-top, top).to(dtype)
        scales.append(torch.reciprocal(encode))
    return data, torch.stack(scales)


def _input(rows, cols, seed=0):
    g = torch.Generator().manual_seed(seed)
    # Rows of very different magnitudes, so per-row and per-tile scales differ.
    x = torch.randn(rows, cols, generator=g) * torch.logspace(-3, 3, rows)[:, None]
    x[1] = 0.0  # an all-zero row: its groups get scale 1
    return x


@pytest.mark.parametrize("dtype", [E4M3, E5M2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("scaling", [TENSORWISE, ROWWISE, TILES_1x128, BLOCKS_128x128])
@pytest.mark.parametrize("shape", [(256, 384), (200, 300), (3, 130)])
@pytest.mark.parametrize("margin", [0, 2])
def test_quantize_equals_the_group_by_group_reference(dtype, scaling, shape, margin):
    x = _input(*shape)
    q = quantize(x, dtype, scaling, margin)
    data, scales = _reference(x, dtype, scaling, margin)
    assert q.data.dtype == dtype and q.data.shape == x.shape and q.data.is_contiguous()
    assert torch.equal(q.data.view(torch.uint8), data.view(torch.uint8))
    assert torch.equal(q.scale.reshape(-1), scales.reshape(-1))
    rows, cols = shape
    want_shape = {TENSORWISE: (), ROWWISE: (rows, 1), TILES_1x128: (rows, -(-cols // TILE)),
                  BLOCKS_128x128: (-(-rows // TILE), -(-cols // TILE))}[scaling]
    assert tuple(q.scale.shape) == want_shape
    # Round trip: each element within half a unit in the last place of its FP8 value:
    # relative 2^-4 (e4m3, 3 mantissa bits) or 2^-3 (e5m2) for normal values, half the
    # smallest subnormal (times the decode scale) for values the group's scale makes tiny.
    back = dequantize(q)
    mantissa = {E4M3: 3, E5M2: 2}[dtype]
    subnormal = torch.finfo(dtype).smallest_normal * 2.0 ** -mantissa
    bound = 2.0 ** -(mantissa + 1) * x.abs() + subnormal / 2 * expanded_scale(q)
    assert torch.all((back - x).abs() <= bound * (1 + 2 ** -20))
    assert torch.all(back[1] == 0)


@pytest.mark.parametrize("dtype", [E4M3, E5M2], ids=["e4m3", "e5m2"])
def test_the_group_maximum_lands_on_the_formats_largest_value_less_the_margin(dtype):
    x = _input(64, 256)
    for margin in (0, 1, 3):
        q = quantize(x, dtype, ROWWISE, margin)
        top = q.data[2:].float().abs().amax(dim=1)
        assert torch.all(top == fp8_max(dtype) / 2 ** margin)


def test_quantize_takes_any_strides_and_gives_contiguous_data():
    x = _input(384, 256)
    q_t = quantize(x.t(), E4M3, TILES_1x128)
    q = quantize(x.t().contiguous(), E4M3, TILES_1x128)
    assert torch.equal(q_t.data.view(torch.uint8), q.data.view(torch.uint8))
    assert torch.equal(q_t.scale, q.scale) and q_t.data.is_contiguous()


GEMM_CASES = [  # (a's scaling, b's scaling, a's dtype, b's dtype)
    (TENSORWISE, TENSORWISE, E4M3, E4M3), (ROWWISE, ROWWISE, E4M3, E4M3),
    (TILES_1x128, BLOCKS_128x128, E4M3, E4M3), (TILES_1x128, TILES_1x128, E4M3, E4M3),
    (TENSORWISE, TENSORWISE, E5M2, E4M3), (ROWWISE, ROWWISE, E5M2, E4M3),
    (TILES_1x128, BLOCKS_128x128, E5M2, E4M3), (TILES_1x128, TILES_1x128, E5M2, E5M2),
]


@pytest.mark.parametrize("a_scaling,b_scaling,a_dtype,b_dtype", GEMM_CASES)
@pytest.mark.parametrize("m,n,k", [(64, 96, 256), (48, 200, 300)])
def test_fp8_gemm_equals_the_product_of_the_dequantized_operands(a_scaling, b_scaling,
                                                                 a_dtype, b_dtype, m, n, k):
    a = quantize(_input(m, k, 1), a_dtype, a_scaling)
    b = quantize(_input(n, k, 2), b_dtype, b_scaling)
    got = fp8_gemm(a, b, torch.float32)
    want = dequantize(a).double() @ dequantize(b).double().t()
    # fp32 accumulation of k products (exact in fp32: FP8 x FP8 has at most 8 significant
    # bits), each scale applied once per element (per K slice for blockwise): a few fp32
    # roundings of the partial sums, bounded by k ulps of the sum of |products|.
    bound = k * 2.0 ** -23 * (dequantize(a).double().abs() @ dequantize(b).double().abs().t())
    assert torch.all((got.double() - want).abs() <= bound + 1e-30)
    assert got.dtype == torch.float32 and got.shape == (m, n)


def test_fp8_gemm_in_bf16_is_the_fp32_result_rounded():
    a = quantize(_input(32, 256, 1), E4M3, ROWWISE)
    b = quantize(_input(64, 256, 2), E4M3, ROWWISE)
    assert torch.equal(fp8_gemm(a, b, torch.bfloat16), fp8_gemm(a, b, torch.float32).bfloat16())


def test_mismatched_operands_are_refused():
    a = quantize(_input(8, 128), E4M3, ROWWISE)
    with pytest.raises(ValueError, match="contraction sizes differ"):
        fp8_gemm(a, quantize(_input(8, 256), E4M3, ROWWISE), torch.float32)
    with pytest.raises(ValueError, match="no GEMM for rowwise x tensorwise"):
        fp8_gemm(a, quantize(_input(8, 128), E4M3, TENSORWISE), torch.float32)


def test_config_formats_and_layers():
    assert Fp8Config().gradient_dtype == E4M3
    assert Fp8Config(format="hybrid").gradient_dtype == E5M2
    assert Fp8Config(format="hybrid").forward_dtype == E4M3
    config = Fp8Config(layers_at_start_in_high_precision=1, layers_at_end_in_high_precision=2)
    assert [config.layer_in_fp8(i, 6) for i in range(1, 7)] == [False, True, True, True, False,
                                                                False]
    with pytest.raises(ValueError, match="recipe 'mxfp8'"):
        Fp8Config(recipe="mxfp8")
