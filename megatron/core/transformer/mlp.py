"""Feed-forward block: column-parallel up projection, activation, row-parallel down projection.

SwiGLU's gate and up projections are one GEMM: the full weight is [gate; up] and is split with
stride 2, so each TP rank holds [its gate rows; its up rows] and applies the gate locally.
"""
import torch
import torch.nn.functional as F

from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.utils import init_method_normal, scaled_init_method_normal


class MLP(torch.nn.Module):
    def __init__(self, config):
        super().__init__()
        self.activation = config.activation
        gated = config.activation == "swiglu"
        out_init = (scaled_init_method_normal(config.init_method_std, config.num_layers)
                    if config.scaled_output_init else init_method_normal(config.init_method_std))
        self.linear_fc1 = ColumnParallelLinear(
            config.hidden_size, config.ffn_hidden_size * (2 if gated else 1), config=config,
            bias=config.add_bias_linear, stride=2 if gated else 1,
            init_method=init_method_normal(config.init_method_std))
        self.linear_fc2 = RowParallelLinear(
            config.ffn_hidden_size, config.hidden_size, config=config,
            bias=config.add_bias_linear, input_is_parallel=True, skip_bias_add=True,
            init_method=out_init)

    def forward(self, hidden):
        """hidden [s, b, h] -> (output [s, b, h], bias or None)."""
        x, _ = self.linear_fc1(hidden)
        if self.activation == "swiglu":
            gate, up = x.chunk(2, dim=-1)
            x = F.silu(gate) * up
        elif self.activation == "gelu_tanh":
            x = F.gelu(x, approximate="tanh")
        else:
            x = F.gelu(x)
        return self.linear_fc2(x)
