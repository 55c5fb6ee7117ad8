"""The experts' rowwise FP8 GEMMs grouped: one ``torch._scaled_grouped_mm`` over every local
expert per direction (CUDA, sm90), where experts.py otherwise runs one ``_scaled_mm`` each.

Rowwise groups are a row of the activation (each token's x, or dy) and a row of a weight:
neither depends on how tokens are grouped into experts. So the whole x (dy) is quantized in
one pass and the stacked weight [E, N, K] (its transpose for dgrad) as E x N rows, giving the
bytes and scales the per-expert path computes, and expert e's rows ``[offs[e-1], offs[e])``
are contracted with its own weight: forward ``x_e @ W[e].T`` and dgrad ``dy_e @ W[e]`` (2-D
by 3-D, the ``offs`` cumulative row counts). The weight gradient (``dy_e.T @ x_e``, the
tokens contracted) stays per expert.

The kernel is used only where a probe agrees (``grouped_kernel``): once per device, with an
empty expert and counts that are not multiples of 16, its output against the same
contraction done per expert (fp32 sums in another order, then one bf16 rounding). Elsewhere,
CPU included, ``grouped_by_loop`` runs the contraction with one ``_scaled_mm`` per expert:
bitwise the per-expert path (tests/unit/test_fp8_grouped.py), whose arguments the tests also
pass through the kernel's meta checks.
"""
import functools
import itertools
from typing import List

import torch

from megatron.core.fp8.gemm import fp8_gemm
from megatron.core.fp8.quantize import ROWWISE, Quantized

GROUPED_WHY: dict = {}  # device type -> the probe's finding


def stacked_rows(q: Quantized, experts: int) -> tuple:
    """(data [E, N, K], decode scales [E, N]) of a rowwise-quantized [E x N, K] weight."""
    rows, k = q.data.shape
    return q.data.view(experts, rows // experts, k), q.scale.reshape(experts, rows // experts)


def offsets(counts: List[int], device) -> torch.Tensor:
    """The kernel's ``offs``: each expert's end row, int32."""
    return torch.tensor(list(itertools.accumulate(counts)), dtype=torch.int32, device=device)


def grouped_by_loop(a: Quantized, b_data: torch.Tensor, b_scale: torch.Tensor,
                    counts: List[int], out_dtype: torch.dtype) -> torch.Tensor:
    """``a`` [M, K] rows by expert times ``b`` [E, N, K]: gemm.py's rowwise GEMM per expert,
    experts.py's per-expert arithmetic."""
    out = torch.zeros(a.data.shape[0], b_data.shape[1], dtype=out_dtype, device=a.data.device)
    start = 0
    for e, n in enumerate(counts):
        if n:
            rows = slice(start, start + n)
            out[rows] = fp8_gemm(Quantized(a.data[rows], a.scale[rows], ROWWISE),
                                 Quantized(b_data[e], b_scale[e], ROWWISE), out_dtype)
        start += n
    return out


def _kernel_call(a: Quantized, b_data: torch.Tensor, b_scale: torch.Tensor,
                 offs: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    # b as [E, K, N] column-major per expert (a transposed view of the row-major [E, N, K]),
    # the layout the kernel takes for its second operand
    return torch._scaled_grouped_mm(a.data, b_data.transpose(-2, -1), a.scale.reshape(-1),
                                    b_scale, offs=offs, out_dtype=out_dtype)


def grouped_gemm(a: Quantized, b_data: torch.Tensor, b_scale: torch.Tensor,
                 counts: List[int], out_dtype: torch.dtype) -> torch.Tensor:
    """``a`` [M, K] (rows grouped by expert, ``counts`` each) times the experts' ``b`` [E, N,
    K] with rowwise scales: [M, N] in ``out_dtype``."""
    if a.scaling != ROWWISE:
        raise ValueError(f"grouped FP8 GEMMs are rowwise, not {a.scaling}")
    if grouped_kernel(a.data.device.type) and out_dtype == torch.bfloat16:
        return _kernel_call(a, b_data, b_scale, offsets(counts, a.data.device), out_dtype)
    return grouped_by_loop(a, b_data, b_scale, counts, out_dtype)


@functools.lru_cache(maxsize=None)
def grouped_kernel(device_type: str) -> bool:
    """Whether ``torch._scaled_grouped_mm`` runs here AND gives what the loop gives (checked
    once on random operands: a wrong layout or offset convention could be silent). Why not,
    or how close: ``GROUPED_WHY``."""
    if device_type != "cuda" or not hasattr(torch, "_scaled_grouped_mm"):
        GROUPED_WHY[device_type] = "no CUDA, or no torch._scaled_grouped_mm"
        return False
    from megatron.core.fp8.quantize import quantize

    g = torch.Generator(device="cuda").manual_seed(0)
    counts = [40, 0, 129, 23]  # an idle expert, sizes off any 16-row alignment
    experts, n, k = len(counts), 64, 96
    x = torch.randn(sum(counts), k, device="cuda", generator=g)
    w = torch.randn(experts * n, k, device="cuda", generator=g)
    a = quantize(x, torch.float8_e4m3fn, ROWWISE)
    b_data, b_scale = stacked_rows(quantize(w, torch.float8_e4m3fn, ROWWISE), experts)
    want = grouped_by_loop(a, b_data, b_scale, counts, torch.float32)
    try:
        got = _kernel_call(a, b_data, b_scale, offsets(counts, "cuda"), torch.bfloat16).float()
    except (RuntimeError, NotImplementedError, ValueError, TypeError) as exc:
        GROUPED_WHY[device_type] = (f"refused: {type(exc).__name__}: "
                                    f"{' '.join(str(exc).split())[:400]}")
        return False
    error = float((got - want).abs().max() / want.abs().max())
    ok = error <= 2.0 ** -8  # bf16's one rounding (2^-9), fp32 sums in another order
    GROUPED_WHY[device_type] = (f"{'agrees' if ok else 'DISAGREES'}: max error / max |value| "
                                f"{error:.1e} (bf16 out)")
    return ok
