"""The compiled quantization (``quantize(..., compile=True)``: inductor's kernel for the
scale-clamp-cast pass, on CPU here as on CUDA) writes the same FP8 bytes and scales as the
eager one, for every recipe, e4m3 and e5m2, margins 0 and 1, bf16 and fp32 inputs, sizes that
are and are not multiples of 128, transposed inputs, all-zero groups and groups whose largest
value lands on the format's largest; and the compiled copies stay within dynamo's recompile
limit across the many shapes of a model's linears."""
import pytest
import torch

from megatron.core.fp8.config import E4M3, E5M2
from megatron.core.fp8.quantize import (
    BLOCKS_128x128,
    ROWWISE,
    SCALINGS,
    TENSORWISE,
    TILES_1x128,
    quantize,
)


def _input(rows, cols, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    # Rows six decades apart (per-row and per-tile scales differ), an all-zero row and an
    # all-zero 128 x 128 block where there is room, and values near the dtype's largest.
    x = torch.randn(rows, cols, generator=g) * torch.logspace(-3, 3, rows)[:, None]
    x[min(1, rows - 1)] = 0.0
    if rows > 128 and cols > 256:
        x[128:, 128:256] = 0.0
    x[-1, :3] = torch.tensor([3e37, -2e37, 1e37])
    return x.to(dtype)


def _same(a, b):
    assert a.data.dtype == b.data.dtype and a.data.shape == b.data.shape
    assert a.data.is_contiguous() and b.data.is_contiguous()
    assert torch.equal(a.data.view(torch.uint8), b.data.view(torch.uint8))
    assert a.scale.shape == b.scale.shape and torch.equal(a.scale, b.scale)


NAMES = {E4M3: "e4m3", E5M2: "e5m2", torch.bfloat16: "bf16", torch.float32: "fp32"}
# Each case compiles a few graphs on CPU (5-20 s a case on 2 cores): every recipe with both
# formats and both input dtypes, in two pairs (e4m3 from bf16, e5m2 from fp32). The format and
# the input dtype are values of the same compiled code; the recipe is its shape of groups.
# Two stay in the quick tier.
QUICK = {(TILES_1x128, E4M3, torch.bfloat16), (TENSORWISE, E5M2, torch.float32)}
CASES = [pytest.param(s, d, i, marks=() if (s, d, i) in QUICK else pytest.mark.slow,
                      id=f"{s}-{NAMES[d]}-{NAMES[i]}")
         for s in SCALINGS for d, i in ((E4M3, torch.bfloat16), (E5M2, torch.float32))]


@pytest.mark.parametrize("scaling,dtype,in_dtype", CASES)
def test_compiled_quantize_is_bitwise_the_eager_one(scaling, dtype, in_dtype):
    for shape in ((256, 384), (200, 300), (3, 130)):
        x = _input(*shape, in_dtype)
        for margin in (0, 1):
            for operand in (x, x.t()):  # the weight gradient quantizes x.t()
                eager = quantize(operand, dtype, scaling, margin)
                _same(quantize(operand, dtype, scaling, margin, compile=True), eager)
                if margin == 0 and scaling != TENSORWISE:
                    # the group maxima land on the format's largest value
                    top = torch.finfo(dtype).max
                    assert eager.data.float().abs().max() == top


@pytest.mark.parametrize("compile", [False, True], ids=["eager", "compiled"])
def test_the_transposed_copy_is_the_data_transposed(compile):
    for shape in ((256, 384), (200, 300)):
        x = _input(*shape, torch.bfloat16)
        q = quantize(x, E4M3, TENSORWISE, compile=compile, transpose=True)
        _same(q, quantize(x, E4M3, TENSORWISE))
        assert q.transposed.scale is q.scale
        assert torch.equal(q.transposed.data.view(torch.uint8),
                           q.data.t().contiguous().view(torch.uint8))
    with pytest.raises(ValueError, match="rowwise groups do not transpose"):
        quantize(x, E4M3, ROWWISE, transpose=True)


def test_many_shapes_compile_once_per_recipe_and_dtype(monkeypatch):
    """Nine shapes (past dynamo's recompile limit of 8 for static shapes): with the limit
    made an error, none falls back, and each compiled copy holds few graphs."""
    import torch._dynamo

    monkeypatch.setattr(torch._dynamo.config, "fail_on_recompile_limit_hit", True)
    shapes = [(128 * (1 + i % 3), 128 * (1 + i // 3)) for i in range(9)]
    for scaling in (TILES_1x128, BLOCKS_128x128):
        for rows, cols in shapes:
            x = _input(rows, cols, torch.bfloat16, seed=rows + cols)
            _same(quantize(x, E4M3, scaling, compile=True), quantize(x, E4M3, scaling))
