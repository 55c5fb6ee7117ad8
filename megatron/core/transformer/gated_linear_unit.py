"""Gated activations of an fc1 output x = [gate | up]: SwiGLU's silu gate, or quick-GeGLU's
gate * sigmoid(1.702 * gate), with gpt-oss's two changes as options: both halves clamped
(gate from above, up on both sides) and a constant added to up before the product.

Megatron's settings: ``activation`` "swiglu" / "quick_geglu", ``activation_func_clamp_value``
and ``glu_linear_offset``. gpt-oss is quick_geglu, clamp 7, offset 1.

A leaf module (torch only): TransformerConfig, the dense MLP and the MoE experts all read it.
The plain "swiglu" without clamp or offset stays the MLP's SwiGLUFunction.
"""
import functools
from typing import Optional

import torch
import torch.nn.functional as F

GATED_ACTIVATIONS = ("swiglu", "quick_geglu")
QUICK_GELU_ALPHA = 1.702


def _halves(x, clamp):
    gate, up = x.chunk(2, dim=-1)
    if clamp is not None:
        gate = gate.clamp(max=clamp)
        up = up.clamp(-clamp, clamp)
    return gate, up


def _gate_activation(gate, quick):
    if quick:
        return gate * torch.sigmoid(gate * QUICK_GELU_ALPHA)
    return F.silu(gate)


def gated_linear_unit(x, quick: bool, clamp: Optional[float], offset: float):
    """The plain expression (what autograd and torch.compile see)."""
    gate, up = _halves(x, clamp)
    if offset:
        up = up + offset
    return _gate_activation(gate, quick) * up


class GatedLinearUnitFunction(torch.autograd.Function):
    """gated_linear_unit keeping only x for backward (autograd would also keep the clamped
    halves, the sigmoid and the activated gate), both halves of the gradient written into one
    buffer. The backward uses the kernels autograd would (sigmoid_backward, silu_backward,
    where for the clamps), in the same order, so the numbers are bitwise autograd's."""

    @staticmethod
    def forward(ctx, x, quick, clamp, offset):
        ctx.save_for_backward(x)
        ctx.settings = (quick, clamp, offset)
        return gated_linear_unit(x, quick, clamp, offset)

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        quick, clamp, offset = ctx.settings
        gate, up = _halves(x, clamp)
        if offset:
            up = up + offset
        grad_x = torch.empty_like(x)
        grad_gate, grad_up = grad_x.chunk(2, dim=-1)
        grad_activated = grad * up
        if quick:
            scaled = torch.sigmoid(gate * QUICK_GELU_ALPHA)
            gate_grad = grad_activated * scaled + torch.ops.aten.sigmoid_backward(
                grad_activated * gate, scaled) * QUICK_GELU_ALPHA
            activated = gate * scaled
        else:
            gate_grad = torch.ops.aten.silu_backward(grad_activated, gate)
            activated = F.silu(gate)
        up_grad = grad * activated
        if clamp is None:
            grad_gate.copy_(gate_grad)
            grad_up.copy_(up_grad)
        else:  # clamp passes the gradient where the input is within the bounds, ends included
            gate_in, up_in = x.chunk(2, dim=-1)
            zero = x.new_zeros(())
            torch.where(gate_in <= clamp, gate_grad, zero, out=grad_gate)
            torch.where((up_in >= -clamp) & (up_in <= clamp), up_grad, zero, out=grad_up)
        return grad_x, None, None, None


@functools.lru_cache(maxsize=None)
def glu_function(activation: str, clamp: Optional[float] = None, offset: float = 0.0,
                 plain: bool = False):
    """x [..., 2f] -> [..., f] for a gated ``activation`` with clamp and offset: the
    memory-lean autograd function, or the ``plain`` expression (for torch.compile). One
    object per setting, so compiled() compiles it once for all layers."""
    if activation not in GATED_ACTIVATIONS:
        raise ValueError(f"activation {activation!r} is not gated; use one of "
                         f"{GATED_ACTIVATIONS}.")
    quick = activation == "quick_geglu"
    clamp = None if clamp is None else float(clamp)
    offset = float(offset)
    if plain:
        return functools.partial(gated_linear_unit, quick=quick, clamp=clamp, offset=offset)

    def apply(x):
        return GatedLinearUnitFunction.apply(x, quick, clamp, offset)
    return apply
