"""Hand-fused element-wise work: RMSNorm's autograd function, RoPE's single cast, the TP
all-reduce without a copy. Reference: the previous formulation (plain torch ops and autograd),
bitwise: the arithmetic is the same op for op."""
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from megatron.core.tensor_parallel import reduce_from_tensor_model_parallel_region
from megatron.core.transformer.norms import RMSNorm
from megatron.core.transformer.rope import _rotate_half, apply_rotary
from tests.distributed import run_distributed


class _Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def _saved(fn, *args):
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = fn(*args)
    return out, saved


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_equals_autograd_and_keeps_only_input_and_rstd(dtype):
    torch.manual_seed(0)
    x = (torch.randn(8, 3, 64) * 3).to(dtype)
    weight = (torch.rand(64) + 0.5).to(dtype)
    grad = torch.randn(8, 3, 64).to(dtype)
    ref_x, ref_w = x.clone().requires_grad_(), weight.clone().requires_grad_()
    ref = F.rms_norm(ref_x.float(), (64,), eps=1e-5).to(dtype) * ref_w  # the old module
    ref.backward(grad)

    norm = RMSNorm(64, 1e-5, dtype)
    norm.weight.data.copy_(weight)
    new_x = x.clone().requires_grad_()
    out, saved = _saved(norm, new_x)
    out.backward(grad)
    assert torch.equal(out, ref) and torch.equal(new_x.grad, ref_x.grad)
    assert torch.equal(norm.weight.grad, ref_w.grad)
    # Saved: the input itself, rstd (fp32, one a token) and the weight; no fp32 copy of the
    # input and no normalized output.
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in saved}
    assert storages == {new_x.untyped_storage().data_ptr(): x.numel() * x.element_size(),
                        next(t for t in saved if t.shape == (8, 3, 1)).data_ptr(): 8 * 3 * 4,
                        norm.weight.data_ptr(): 64 * x.element_size()}


def _old_apply_rotary(x, cos, sin):
    rot_dim = cos.shape[-1]
    x_rot, x_pass = x[..., :rot_dim], x[..., rot_dim:]
    x_rot = (x_rot.float() * cos + _rotate_half(x_rot.float()) * sin).to(x.dtype)
    return torch.cat((x_rot, x_pass), dim=-1) if x_pass.shape[-1] else x_rot


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rotary_dim", [16, 8])
def test_rope_equals_before_with_one_cast(dtype, rotary_dim):
    torch.manual_seed(0)
    x = torch.randn(2, 5, 4, 16).to(dtype)
    angles = torch.rand(1, 5, 1, rotary_dim // 2) * 6
    emb = torch.cat((angles, angles), dim=-1)
    cos, sin = emb.cos(), emb.sin()
    grad = torch.randn(2, 5, 4, 16).to(dtype)
    ref_x, new_x = x.clone().requires_grad_(), x.clone().requires_grad_()
    ref = _old_apply_rotary(ref_x, cos, sin)
    ref.backward(grad)
    with _Ops() as ops:
        out = apply_rotary(new_x, cos, sin)
    out.backward(grad)
    assert torch.equal(out, ref)
    if dtype == torch.bfloat16:
        # One cast means the two gradient paths are summed in fp32 and rounded once (before:
        # each rounded to bf16, then summed in bf16): the fp32 gradient, rounded.
        fp32_x = x.float().requires_grad_()
        _old_apply_rotary(fp32_x, cos, sin).backward(grad.float())
        assert torch.equal(new_x.grad, fp32_x.grad.to(dtype))
    else:
        assert torch.equal(new_x.grad, ref_x.grad)
    # bf16: one cast in (x to fp32) and one out; before, x was cast twice.
    assert ops.names.count("_to_copy") == (2 if dtype == torch.bfloat16 else 0)


def _reduce_in_place():
    rank = dist.get_rank()
    x = torch.full((4, 3), float(rank + 1), requires_grad=True)
    partial = x * 2  # a fresh partial sum, as a GEMM output is
    out = reduce_from_tensor_model_parallel_region(partial)
    out.backward(torch.ones(4, 3))
    return (out.data_ptr() == partial.data_ptr(), out.detach().clone(), x.grad.clone())


def test_reduce_from_tp_region_reduces_in_place():
    """No copy before the TP all-reduce (a [s, b, h] activation per RowParallelLinear)."""
    for same_storage, out, grad in run_distributed(_reduce_in_place, world_size=2, tp=2):
        assert same_storage
        assert torch.equal(out, torch.full((4, 3), 6.0))  # 2 * 1 + 2 * 2
        assert torch.equal(grad, torch.full((4, 3), 2.0))


def _mlp_case(dtype):
    from megatron.core.models import llama_config
    from megatron.core.transformer.mlp import MLP, _swiglu

    config = llama_config(num_layers=1, hidden_size=32, num_attention_heads=4,
                          ffn_hidden_size=48, params_dtype=dtype)
    mlp = MLP(config)
    torch.manual_seed(1)
    x = torch.randn(6, 2, 32).to(dtype).requires_grad_()
    grad = torch.randn(6, 2, 32).to(dtype)
    (out, _), saved = _saved(mlp, x)
    out.backward(grad)
    # Reference: the same weights with autograd's SwiGLU (F.silu(gate) * up).
    ref_x = x.detach().clone().requires_grad_()
    fc1 = ref_x.matmul(mlp.linear_fc1.weight.detach().t())
    ref = _swiglu(fc1).matmul(mlp.linear_fc2.weight.detach().t())
    ref.backward(grad)
    params = {p.untyped_storage().data_ptr() for p in mlp.parameters()}
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in saved
                if t.untyped_storage().data_ptr() not in params}
    return out, ref, x.grad, ref_x.grad, sorted(storages.values())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_swiglu_keeps_fc1_output_only_and_equals_autograd(dtype):
    """SiLU's output is recomputed in backward instead of kept (f per token less), and the
    gradient halves are written into one buffer instead of concatenated: same kernels, so
    bitwise autograd's numbers."""
    out, ref, grad, ref_grad, storages = run_distributed(_mlp_case, world_size=1, tp=1,
                                                         dtype=dtype)[0]
    assert torch.equal(out, ref) and torch.equal(grad, ref_grad)
    e, tokens = torch.finfo(dtype).bits // 8, 12
    # the MLP input, the fc1 output [gate | up] and the product (fc2's input)
    assert storages == sorted([e * tokens * 32, e * tokens * 96, e * tokens * 48])
