"""The experts' grouped rowwise FP8 GEMMs (megatron/core/fp8/grouped.py): quantizing the whole
x (dy) and the stacked weights once gives the bytes and scales of the per-expert path, so the
grouped forward and dgrad are bitwise the per-expert GEMMs (here through grouped_by_loop, the
CPU path; tests/unit/test_fp8_experts.py compares both against fp64), idle experts and row
counts off any alignment included; the kernel's arguments pass torch's own meta checks; and
on CPU the probe says why the kernel is not used."""
import pytest
import torch

from megatron.core.fp8 import Fp8Config
from megatron.core.fp8 import grouped
from megatron.core.fp8.experts import fp8_expert_linear
from megatron.core.fp8.linear import Fp8Gemms
from megatron.core.fp8.quantize import ROWWISE, Quantized, quantize

COUNTS = [5, 0, 19, 8]  # an idle expert, sizes not multiples of 16
E, N, K = len(COUNTS), 32, 48


def _operands(dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(sum(COUNTS), K, generator=g) * torch.logspace(-2, 2, K)).to(dtype)
    weight = (torch.randn(E, N, K, generator=g) * 0.02).to(dtype)
    grad = torch.randn(sum(COUNTS), N, generator=g).to(dtype)
    return x, weight, grad


@pytest.mark.parametrize("fmt", ["e4m3", "hybrid"])
def test_grouped_experts_are_bitwise_the_per_expert_gemms(fmt):
    gemms = Fp8Gemms(Fp8Config(format=fmt, recipe="rowwise"))
    x, weight, grad = _operands()
    xi, wi = x.clone().requires_grad_(), weight.clone().requires_grad_()
    out = fp8_expert_linear(xi, wi, COUNTS, gemms)
    out.backward(grad)
    want_out, want_dx, want_dw = torch.zeros_like(out), torch.zeros_like(x), torch.zeros_like(weight)
    start = 0
    for e, n in enumerate(COUNTS):  # the per-expert path's GEMMs, one expert at a time
        rows = slice(start, start + n)
        if n:
            want_out[rows] = gemms.forward(x[rows], weight[e])
            want_dx[rows] = gemms.dgrad(grad[rows], weight[e])
            want_dw[e] = gemms.wgrad(grad[rows], x[rows], weight.dtype)
        start += n
    assert torch.equal(out, want_out) and torch.equal(xi.grad, want_dx)
    assert torch.equal(wi.grad, want_dw) and torch.all(wi.grad[1] == 0)


def _on_meta(q: Quantized) -> Quantized:
    return Quantized(q.data.to("meta"), q.scale.to("meta"), q.scaling)


@pytest.mark.parametrize("transpose", [False, True], ids=["forward", "dgrad"])
def test_the_kernel_takes_our_layouts(transpose):
    """torch's meta kernel for _scaled_grouped_mm checks dtypes, shapes, strides and the
    scales' sizes as the CUDA kernel does: our forward ([M, K] x [E, N, K]) and dgrad
    ([M, N] x [E, K, N]) arguments pass them and give [M, N] ([M, K])."""
    x, weight, grad = _operands()
    a = quantize(grad if transpose else x, torch.float8_e4m3fn, ROWWISE)
    stacked = weight.transpose(1, 2) if transpose else weight
    b_data, b_scale = grouped.stacked_rows(
        quantize(stacked.reshape(-1, stacked.shape[-1]), torch.float8_e4m3fn, ROWWISE), E)
    out = grouped._kernel_call(_on_meta(a), b_data.to("meta"), b_scale.to("meta"),
                               grouped.offsets(COUNTS, "meta"), torch.bfloat16)
    assert out.shape == (sum(COUNTS), K if transpose else N) and out.dtype == torch.bfloat16


def test_on_cpu_the_probe_says_why_not():
    assert not grouped.grouped_kernel("cpu")
    assert "no CUDA" in grouped.GROUPED_WHY["cpu"]
    assert grouped.offsets(COUNTS, "cpu").tolist() == [5, 5, 24, 32]
