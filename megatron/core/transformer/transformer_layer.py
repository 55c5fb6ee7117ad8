"""Pre-norm transformer layer: x + Attn(Norm(x)), then x + MLP(Norm(x)) (or the MoE layer in
its place, where config.moe says)."""
import contextlib

import torch
import torch.nn.functional as F

from megatron.core.fp8.config import layer_fp8
from megatron.core.tensor_parallel import get_rng_tracker
from megatron.core.transformer.attention import SelfAttention
from megatron.core.transformer.fp8_layers import use_fp8
from megatron.core.transformer.mlp import MLP
from megatron.core.transformer.multi_latent_attention import MultiLatentAttention
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.norms import build_norm


def hidden_dropout_rng(config):
    """Under sequence parallelism activations are sharded across TP ranks, so their dropout
    draws from the per-TP-rank stream; otherwise they are replicated and use the shared one."""
    if config.sequence_parallel and config.hidden_dropout > 0:
        return get_rng_tracker().fork()
    return contextlib.nullcontext()


class TransformerLayer(torch.nn.Module):
    def __init__(self, config, layer_number: int, moe=None):
        """``moe``: whether the MLP is an MoE layer (None: as config.moe says for this
        layer; a multi-token-prediction layer, numbered past the model's, says it)."""
        super().__init__()
        self.config = config
        self.layer_number = layer_number  # 1-based, global across pipeline stages
        self.input_layernorm = build_norm(config)
        attention = MultiLatentAttention if config.multi_latent_attention else SelfAttention
        self.self_attention = attention(config, layer_number)
        self.pre_mlp_layernorm = build_norm(config)
        if moe is None:
            moe = config.moe is not None and config.moe.is_moe_layer(layer_number)
        if moe:
            self.mlp = MoELayer(config, layer_number)
        else:
            self.mlp = MLP(config)
        fp8 = layer_fp8(config, layer_number)
        if fp8 is not None:
            use_fp8(self, fp8, config.torch_compile)

    def _residual(self, residual, output, bias):
        if bias is not None:
            output = output + bias
        with hidden_dropout_rng(self.config):
            output = F.dropout(output, self.config.hidden_dropout, self.training)
        return residual + output

    def forward(self, hidden, attention_mask=None, rotary_cos=None, rotary_sin=None,
                packed_seq_params=None):
        out, bias = self.self_attention(self.input_layernorm(hidden), attention_mask,
                                        rotary_cos, rotary_sin, packed_seq_params)
        if self.config.torch_compile and not (self.training and self.config.hidden_dropout > 0):
            # One compiled kernel for the bias and residual adds and the norm after them
            # (dropout stays eager: it draws from our RNG tracker).
            hidden, normed = self.pre_mlp_layernorm.residual_forward(hidden, out, bias)
        else:
            hidden = self._residual(hidden, out, bias)
            normed = self.pre_mlp_layernorm(hidden)
        out, bias = self.mlp(normed)
        return self._residual(hidden, out, bias)
