"""LayerNorm and RMSNorm over the last dimension, statistics in fp32.

With ``compile=True`` (--torch-compile) a norm runs as one torch.compile'd function of plain
ops (inductor fuses the statistics, the scaling and the casts, and picks what to save), and
``residual_forward`` also fuses the residual add that precedes it.
"""
import torch
import torch.nn.functional as F

from megatron.core import device
from megatron.core.compiled import compiled


def _rms_norm(x, weight, eps):
    return F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype) * weight


def _layer_norm(x, weight, bias, eps):
    return F.layer_norm(x.float(), (x.shape[-1],), weight.float(), bias.float(),
                        eps).to(x.dtype)


def _add_residual_rms_norm(residual, out, bias, weight, eps):
    hidden = residual + (out if bias is None else out + bias)
    return hidden, _rms_norm(hidden, weight, eps)


def _add_residual_layer_norm(residual, out, bias, weight, norm_bias, eps):
    hidden = residual + (out if bias is None else out + bias)
    return hidden, _layer_norm(hidden, weight, norm_bias, eps)


class _RMSNormFunction(torch.autograd.Function):
    """``(x * rstd).to(x.dtype) * weight`` with rstd = 1 / sqrt(mean(x^2) + eps) in fp32.

    Keeps for backward only the input (in its own dtype) and rstd (one float a token); the
    normalized output the weight gradient needs is recomputed from them (one multiply), instead
    of autograd keeping an fp32 copy of the input and the normalized output as well. The
    arithmetic is that of F.rms_norm and autograd's backward of it, op for op, so fp32 results
    are bitwise the same.
    """

    @staticmethod
    def forward(ctx, x, weight, eps):
        xf = x.float()
        rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True).add_(eps))
        normed = (xf * rstd).to(x.dtype)
        ctx.save_for_backward(x, rstd, weight)
        return normed * weight

    @staticmethod
    def backward(ctx, grad):
        x, rstd, weight = ctx.saved_tensors
        xf = x.float()
        grad_weight = None
        if ctx.needs_input_grad[1]:
            grad_weight = (grad * (xf * rstd).to(x.dtype)).sum_to_size(weight.shape)
        grad_input = None
        if ctx.needs_input_grad[0]:
            g = (grad * weight).float()
            # d/dx of x * rstd(x): g * rstd + x * (2 / n) * (-rstd^3 / 2) * sum(g * x)
            grad_rstd = (g * xf).sum(-1, keepdim=True)
            grad_mean_sq = (grad_rstd * (rstd.pow(3) * -0.5)).expand_as(xf) / xf.shape[-1]
            grad_input = (g * rstd + grad_mean_sq * (xf * 2)).to(x.dtype)
        return grad_input, grad_weight, None


class RMSNorm(torch.nn.Module):
    def __init__(self, hidden_size: int, eps: float, params_dtype=torch.float32,
                 compile: bool = False):
        super().__init__()
        self.eps = eps
        self.compile = compile
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=params_dtype,
                                                    device=device.current_device()))

    def forward(self, x):
        if self.compile:
            return compiled(_rms_norm)(x, self.weight, self.eps)
        return _RMSNormFunction.apply(x, self.weight, self.eps)

    def residual_forward(self, residual, out, bias=None):
        """(residual + out + bias, its norm), one compiled function."""
        return compiled(_add_residual_rms_norm)(residual, out, bias, self.weight, self.eps)


class LayerNorm(torch.nn.Module):
    def __init__(self, hidden_size: int, eps: float, params_dtype=torch.float32,
                 compile: bool = False):
        super().__init__()
        self.eps = eps
        self.compile = compile
        dev = device.current_device()
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=params_dtype, device=dev))
        self.bias = torch.nn.Parameter(torch.zeros(hidden_size, dtype=params_dtype, device=dev))

    def forward(self, x):
        fn = compiled(_layer_norm) if self.compile else _layer_norm
        return fn(x, self.weight, self.bias, self.eps)

    def residual_forward(self, residual, out, bias=None):
        """(residual + out + bias, its norm), one compiled function."""
        return compiled(_add_residual_layer_norm)(residual, out, bias, self.weight, self.bias,
                                                  self.eps)


def build_norm(config, hidden_size=None):
    """The config's norm; under sequence parallelism its parameters see only a sequence shard,
    so they are marked for the TP all-reduce of their gradients."""
    cls = RMSNorm if config.normalization == "RMSNorm" else LayerNorm
    norm = cls(hidden_size or config.hidden_size, config.layernorm_epsilon, config.params_dtype,
               compile=config.torch_compile)
    for p in norm.parameters():
        p.sequence_parallel = config.sequence_parallel
    return norm
