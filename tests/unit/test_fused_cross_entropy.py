"""The cross entropy of the compiled element-wise path (``fused=True``, CUDA's default):
compiled on CPU (inductor's C++ backend) against the same functions run eagerly, which
test_tensor_parallel_layers checks against F.cross_entropy at every TP size; and what backward
keeps: the logits in their own dtype, never an fp32 copy of them (the unfused path's buffer).

Tolerances: compiled reductions sum a row in another order than eager ones (fp32 rounding,
~1e-7 relative here, bound 1e-6); a bf16 gradient is the same fp32 value rounded once, so a
compiled and an eager result may land one bf16 step (2^-8 relative) apart.
"""
import torch

from megatron.core.tensor_parallel import vocab_parallel_cross_entropy
from tests.distributed import run_distributed

ROWS, VOCAB, PADDED = 48, 250, 256  # 6 padding columns: left out of the softmax


def _case(dtype, label_smoothing):
    g = torch.Generator().manual_seed(3)
    logits = (torch.randn(ROWS, 2, PADDED, generator=g) * 3).to(dtype)
    target = torch.randint(0, VOCAB, (ROWS, 2), generator=g)
    dloss = torch.rand(ROWS, 2, generator=g)
    out = {}
    for compile in (False, True):
        x = logits.clone().requires_grad_()
        loss = vocab_parallel_cross_entropy(x, target, label_smoothing, vocab_size=VOCAB,
                                            fused=True, compile=compile)
        (grad,) = torch.autograd.grad(loss, x, dloss)
        out[compile] = (loss, grad)
    return out


def test_compiled_cross_entropy_equals_its_eager_functions():
    """bf16 logits with label smoothing: every compiled pass (each is compiled per variant,
    a cost on a cold cache, so one case covers them)."""
    dtype = torch.bfloat16
    (out,) = run_distributed(_case, world_size=1, tp=1, dtype=dtype, label_smoothing=0.1)
    (loss_e, grad_e), (loss_c, grad_c) = out[False], out[True]
    assert loss_c.dtype == torch.float32 and grad_c.dtype == dtype
    torch.testing.assert_close(loss_c, loss_e, rtol=1e-6, atol=0)
    step = 2.0 ** -8 if dtype == torch.bfloat16 else 1e-6
    torch.testing.assert_close(grad_c.float(), grad_e.float(), rtol=0,
                               atol=step * grad_e.abs().max().item())
    assert torch.all(grad_c[..., VOCAB:] == 0)  # padding columns get no gradient


def _saved_for_backward(fused):
    """(dtype, numel) of every tensor autograd keeps for the loss's backward."""
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(ROWS, 2, PADDED, generator=g).to(torch.bfloat16).requires_grad_()
    target = torch.randint(0, VOCAB, (ROWS, 2), generator=g)
    saved = []

    def pack(t):
        saved.append((t.dtype, t.numel()))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        vocab_parallel_cross_entropy(logits * 1, target, vocab_size=VOCAB, inplace=True,
                                     fused=fused, compile=False)
    return saved, logits.numel()


def test_fused_keeps_the_bf16_logits_not_an_fp32_copy():
    (result,) = run_distributed(_saved_for_backward, world_size=1, tp=1, fused=True)
    saved, logits_numel = result
    large = [s for s in saved if s[1] >= logits_numel]
    assert large == [(torch.bfloat16, logits_numel)], saved
    (unfused,) = run_distributed(_saved_for_backward, world_size=1, tp=1, fused=False)
    assert (torch.float32, logits_numel) in unfused[0]  # what the fused path saves
