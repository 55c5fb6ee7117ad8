"""Feed-forward block: column-parallel up projection, activation, row-parallel down projection.

SwiGLU's gate and up projections are one GEMM: the full weight is [gate; up] and is split with
stride 2, so each TP rank holds [its gate rows; its up rows] and applies the gate locally.
"""
import torch
import torch.nn.functional as F

from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.compiled import compiled
from megatron.core.transformer.gated_linear_unit import GATED_ACTIVATIONS, glu_function
from megatron.core.utils import init_method_normal, scaled_init_method_normal


def _swiglu(x):
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


class SwiGLUFunction(torch.autograd.Function):
    """silu(gate) * up of x = [gate | up], keeping only x for backward (autograd would also
    keep silu(gate), recomputed here) and writing both halves of the gradient straight into
    one buffer (autograd concatenates them). The kernels are autograd's (silu, silu_backward,
    mul), so the numbers are bitwise the same."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        gate, up = x.chunk(2, dim=-1)
        grad_x = torch.empty_like(x)
        grad_gate, grad_up = grad_x.chunk(2, dim=-1)
        torch.ops.aten.silu_backward.grad_input(grad * up, gate, grad_input=grad_gate)
        torch.mul(grad, F.silu(gate), out=grad_up)
        return grad_x


def _gelu_tanh(x):
    return F.gelu(x, approximate="tanh")


_ACTIVATIONS = {"swiglu": _swiglu, "gelu_tanh": _gelu_tanh, "gelu": F.gelu}


def gated_activation_func(activation, clamp=None, offset=0.0, compile=False):
    """The function of fc1's [gate | up] output for a gated activation (gated_linear_unit.py):
    plain SwiGLU keeps SwiGLUFunction (and its compiled form), the others, and SwiGLU with a
    clamp or offset, the gated-linear-unit function. Shared by the MLP and the MoE experts."""
    if activation == "swiglu" and clamp is None and not offset:
        return compiled(_swiglu) if compile else SwiGLUFunction.apply
    if compile:
        return compiled(glu_function(activation, clamp, offset, plain=True))
    return glu_function(activation, clamp, offset)


class MLP(torch.nn.Module):
    def __init__(self, config, ffn_hidden_size=None):
        """``ffn_hidden_size`` overrides the config's (an MoE layer's shared expert)."""
        super().__init__()
        ffn_hidden_size = ffn_hidden_size or config.ffn_hidden_size
        self.activation = config.activation
        gated = config.activation in GATED_ACTIVATIONS
        # --torch-compile: SwiGLU's chunk, SiLU and product become one kernel.
        if gated:
            self.activation_func = gated_activation_func(
                config.activation, config.activation_func_clamp_value,
                config.glu_linear_offset, config.torch_compile)
        elif config.torch_compile:
            self.activation_func = compiled(_ACTIVATIONS[config.activation])
        else:
            self.activation_func = _ACTIVATIONS[config.activation]
        out_init = (scaled_init_method_normal(config.init_method_std, config.num_layers)
                    if config.scaled_output_init else init_method_normal(config.init_method_std))
        self.linear_fc1 = ColumnParallelLinear(
            config.hidden_size, ffn_hidden_size * (2 if gated else 1), config=config,
            bias=config.add_bias_linear, stride=2 if gated else 1,
            init_method=init_method_normal(config.init_method_std))
        self.linear_fc2 = RowParallelLinear(
            ffn_hidden_size, config.hidden_size, config=config,
            bias=config.add_bias_linear, input_is_parallel=True, skip_bias_add=True,
            init_method=out_init)

    def forward(self, hidden):
        """hidden [s, b, h] -> (output [s, b, h], bias or None)."""
        x, _ = self.linear_fc1(hidden)
        return self.linear_fc2(self.activation_func(x))
