"""The context-parallel block kernel on CUDA, checked on CPU (issue 36):

- the kernel is decided once from what the kernels accept (dtype, head dim, mask, dropout, the
  private op's registered arguments); a kernel's errors (out of memory included) propagate and
  nothing switches to the fp32 reference kernel at run time;
- the CUDA flash block takes grouped-query K/V unexpanded: a CPU stand-in for the private CUDA
  op, built on torch's CPU flash op (which takes hq != hkv itself), records what it is given;
  results equal the old expand-and-sum path.
"""
import pytest
import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from megatron.core.transformer import context_parallel as cp_module
from megatron.core.transformer.context_parallel import blocks, context_parallel_attention

ATOL = RTOL = 2e-5  # as test_context_parallel_attention.py: block merges re-associate fp32 sums
HQ, HKV, S, D = 6, 2, 16, 8


def _block_inputs():
    g = torch.Generator().manual_seed(3)
    q, dout = (torch.randn(2, HQ, S, D, generator=g) for _ in range(2))
    k, v = (torch.randn(2, HKV, S, D, generator=g) for _ in range(2))
    return q, k, v, dout, torch.arange(S)


# --- the kernel is decided up front; its errors propagate ---------------------------------

@pytest.mark.parametrize("dtype, head_dim, mask, dropout, want", [
    (torch.bfloat16, 64, False, False, "cuda_flash"),
    (torch.float16, 256, False, False, "cuda_flash"),
    (torch.bfloat16, 60, False, False, "reference"),  # the op needs a multiple of 8 (no padding)
    (torch.bfloat16, 264, False, False, "reference"),  # above 256
    (torch.float32, 64, False, False, "reference"),  # fp16/bf16 only
    (torch.bfloat16, 64, True, False, "reference"),  # packed documents: no mask argument
    (torch.bfloat16, 64, False, True, "reference"),  # no hash dropout
])
def test_cuda_block_kernel_is_what_the_op_accepts(dtype, head_dim, mask, dropout, want):
    assert blocks.choose_block_kernel("cuda", dtype, head_dim, mask, dropout) == want


def test_cuda_flash_op_signature_is_checked_once():
    assert blocks._cuda_flash_op_matches()  # torch registers the op (CPU builds too)
    assert blocks._CUDA_FLASH_AVAILABLE
    original = blocks._CUDA_FLASH_ARGS
    try:  # a torch whose private op changed its arguments: the reference kernel, up front
        blocks._CUDA_FLASH_ARGS = original[:-1]
        assert not blocks._cuda_flash_op_matches()
    finally:
        blocks._CUDA_FLASH_ARGS = original


def test_kernel_errors_propagate_and_nothing_switches(monkeypatch):
    calls = []

    def out_of_memory(*args):
        calls.append("cuda_flash forward")
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 8.00 GiB")

    def refused(*args):
        calls.append("cuda_flash backward")
        raise RuntimeError("FlashAttention only supports Ampere GPUs or newer.")

    def spy(name, table):
        real = table["reference"]
        return lambda *args: calls.append(name) or real(*args)

    monkeypatch.setitem(blocks._FORWARD, "reference", spy("reference forward", blocks._FORWARD))
    monkeypatch.setitem(blocks._BACKWARD, "reference",
                        spy("reference backward", blocks._BACKWARD))
    monkeypatch.setitem(blocks._FORWARD, "cuda_flash", out_of_memory)
    monkeypatch.setitem(blocks._BACKWARD, "cuda_flash", refused)
    q, k, v, dout, pos = _block_inputs()
    st = blocks.BlockSettings(scale=D ** -0.5, kernel="cuda_flash")
    with pytest.raises(torch.OutOfMemoryError):
        blocks.block_forward(q, k, v, pos, pos, True, st)
    out, lse = torch.zeros_like(q), torch.zeros(q.shape[:3])
    with pytest.raises(RuntimeError, match="Ampere"):
        blocks.block_backward(dout, q, k, v, out, lse, pos, pos, True, st)
    # Through the entry point, after both errors: the same kernel is chosen and tried again.
    monkeypatch.setattr(cp_module, "choose_block_kernel", lambda *args: "cuda_flash")
    with pytest.raises(torch.OutOfMemoryError):
        context_parallel_attention(q, k, v, group=None)
    assert calls == ["cuda_flash forward", "cuda_flash backward", "cuda_flash forward"]
    assert blocks.choose_block_kernel("cuda", torch.bfloat16, 64, False, False) == "cuda_flash"


# --- grouped-query K/V reach the CUDA flash op unexpanded ---------------------------------

def _cpu_stand_in(seen):
    """(forward, backward) with the CUDA flash op's signature and outputs, computed by torch's
    CPU flash op (which takes hq != hkv itself); ``seen`` records the head counts given."""
    cpu_forward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    cpu_backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward

    def forward(q, k, v, dropout_p, is_causal, return_debug_mask, *, scale):
        seen.append(("forward", q.shape[1], k.shape[1], v.shape[1]))
        out, lse = cpu_forward(q, k, v, dropout_p, is_causal, scale=scale)
        return out, lse, None, None, q.shape[2], k.shape[2], None, None, None

    def backward(dout, q, k, v, out, lse, cum_q, cum_k, max_q, max_k, dropout_p, is_causal,
                 philox_seed, philox_offset, *, scale):
        seen.append(("backward", q.shape[1], k.shape[1], v.shape[1]))
        return cpu_backward(dout, q, k, v, out, lse, dropout_p, is_causal, scale=scale)

    return forward, backward


class _ExpandSpy(TorchFunctionMode):
    """Records every repeat / expand call (how K/V would be widened to the query heads)."""
    WIDENING = {torch.repeat_interleave, torch.Tensor.repeat_interleave, torch.Tensor.repeat,
                torch.Tensor.expand, torch.Tensor.expand_as}

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in self.WIDENING:
            self.calls.append(func.__name__)
        return func(*args, **(kwargs or {}))


def _old_expanded_path(ops, q, k, v, dout, causal, scale):
    """The code before the fix: K/V repeated to every query head, dK/dV summed per group."""
    forward, backward = ops
    groups = q.shape[1] // k.shape[1]
    k_wide, v_wide = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    res = forward(q, k_wide, v_wide, 0.0, causal, False, scale=scale)
    out, lse = res[0].float(), res[1].float()
    no_rng = torch.zeros((), dtype=torch.int64)
    dq, dk, dv = backward(dout, q, k_wide, v_wide, out.to(q.dtype), lse, None, None,
                          q.shape[2], k.shape[2], 0.0, causal, no_rng, no_rng, scale=scale)
    b, _, s, d = dk.shape
    return out, lse, dq, dk.view(b, -1, groups, s, d).sum(2), dv.view(b, -1, groups, s, d).sum(2)


@pytest.mark.parametrize("causal", [True, False])
def test_cuda_flash_block_takes_gqa_kv_unexpanded(monkeypatch, causal):
    seen = []
    ops = _cpu_stand_in(seen)
    monkeypatch.setattr(blocks, "_cuda_flash_ops", lambda: ops)
    q, k, v, dout, pos = _block_inputs()
    st = blocks.BlockSettings(scale=D ** -0.5, kernel="cuda_flash")
    with _ExpandSpy() as spy:
        out, lse = blocks.block_forward(q, k, v, pos, pos, causal, st)
        grads = blocks.block_backward(dout, q, k, v, out, lse, pos, pos, causal, st)
    assert spy.calls == []
    assert seen == [("forward", HQ, HKV, HKV), ("backward", HQ, HKV, HKV)]
    want = _old_expanded_path(ops, q, k, v, dout, causal, st.scale)
    # Forward and dQ: the same arithmetic per query head, bitwise. dK/dV: the op sums each
    # group's query heads inside its kernel, the old path summed the per-head results after
    # it, another association of 3 fp32 terms: rounding only (measured <= 1.5e-6 absolute).
    for name, got, expected in zip(["out", "lse", "dq", "dk", "dv"], (out, lse, *grads), want):
        if name in ("dk", "dv"):
            torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-6, msg=name)
        else:
            assert torch.equal(got, expected), name


def test_cuda_flash_gqa_attention_equals_sdpa(monkeypatch):
    """The whole (one-rank) CP attention on the stand-in op against SDPA with enable_gqa."""
    monkeypatch.setattr(blocks, "_cuda_flash_ops", lambda: _cpu_stand_in([]))
    monkeypatch.setattr(cp_module, "choose_block_kernel", lambda *args: "cuda_flash")
    q, k, v, dout, _ = _block_inputs()
    args = [t.clone().requires_grad_() for t in (q, k, v)]
    out = context_parallel_attention(*args, group=None)
    ref_args = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = F.scaled_dot_product_attention(*ref_args, is_causal=True, enable_gqa=True)
    torch.testing.assert_close(out, ref, atol=ATOL, rtol=RTOL)
    got = torch.autograd.grad(out, args, dout)
    for g, w in zip(got, torch.autograd.grad(ref, ref_args, dout)):
        torch.testing.assert_close(g, w, atol=ATOL, rtol=RTOL)
