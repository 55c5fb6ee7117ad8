"""Self-attention: fused QKV (column-parallel), rotary embedding, causal SDPA, output projection
(row-parallel).

The fused QKV weight is laid out by query group: for each group g, the rows of its
``heads / groups`` query heads, then its key head, then its value head. Splitting the rows
evenly over TP ranks then hands every rank whole groups, so attention needs no communication.
"""
import contextlib

import torch
import torch.nn.functional as F

from megatron.core import parallel_state
from megatron.core.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    checkpoint,
    get_rng_tracker,
)
from megatron.core.transformer.rope import apply_rotary
from megatron.core.utils import divide, init_method_normal, scaled_init_method_normal

_SDPA_HAS_GQA = tuple(int(v) for v in torch.__version__.split(".")[:2]) >= (2, 5)


def check_attention_partition(config, tp_size: int) -> None:
    """Clear errors for head counts that TP cannot split into whole heads and groups."""
    if config.num_attention_heads % tp_size != 0:
        raise ValueError(f"num_attention_heads {config.num_attention_heads} is not divisible by "
                         f"tensor-model-parallel size {tp_size}; choose a TP size that divides it.")
    if config.num_query_groups % tp_size != 0:
        raise ValueError(f"num_query_groups {config.num_query_groups} is not divisible by "
                         f"tensor-model-parallel size {tp_size}; each TP rank must hold whole "
                         f"key/value groups.")


class SelfAttention(torch.nn.Module):
    def __init__(self, config, layer_number: int):
        super().__init__()
        tp_size = parallel_state.get_tensor_model_parallel_world_size()
        check_attention_partition(config, tp_size)
        self.config = config
        self.layer_number = layer_number
        self.head_dim = config.kv_channels
        self.heads_per_group = config.num_attention_heads // config.num_query_groups
        self.local_groups = divide(config.num_query_groups, tp_size)
        self.local_heads = self.local_groups * self.heads_per_group
        qkv_size = (config.num_attention_heads + 2 * config.num_query_groups) * self.head_dim
        out_init = (scaled_init_method_normal(config.init_method_std, config.num_layers)
                    if config.scaled_output_init else init_method_normal(config.init_method_std))
        self.linear_qkv = ColumnParallelLinear(
            config.hidden_size, qkv_size, config=config, bias=config.add_qkv_bias,
            init_method=init_method_normal(config.init_method_std))
        self.linear_proj = RowParallelLinear(
            config.num_attention_heads * self.head_dim, config.hidden_size, config=config,
            bias=config.add_bias_linear, input_is_parallel=True, skip_bias_add=True,
            init_method=out_init)

    def forward(self, hidden, attention_mask=None, rotary_cos=None, rotary_sin=None):
        """hidden [s, b, h] (sequence-sharded under SP) -> (output [s, b, h], bias or None)."""
        qkv, _ = self.linear_qkv(hidden)
        s, b = qkv.shape[:2]
        qkv = qkv.view(s, b, self.local_groups, self.heads_per_group + 2, self.head_dim)
        qkv = qkv.transpose(0, 1)  # [b, s, groups, per-group, d]
        query = qkv[:, :, :, :self.heads_per_group].reshape(b, s, self.local_heads, self.head_dim)
        key, value = qkv[:, :, :, -2], qkv[:, :, :, -1]
        if rotary_cos is not None:
            query = apply_rotary(query, rotary_cos, rotary_sin)
            key = apply_rotary(key, rotary_cos, rotary_sin)
        if self.config.recompute_granularity == "selective":
            context = checkpoint(self._core_attention, False, query, key, value, attention_mask)
        else:
            context = self._core_attention(query, key, value, attention_mask)
        return self.linear_proj(context)

    def _core_attention(self, query, key, value, attention_mask):
        """[b, s, heads|groups, d] -> [s, b, heads * d]; causal unless a mask is given
        (Megatron's convention: True marks positions that may NOT be attended)."""
        b, s = query.shape[:2]
        query, key, value = (t.transpose(1, 2) for t in (query, key, value))
        kwargs = {}
        if self.heads_per_group > 1:
            if _SDPA_HAS_GQA:
                kwargs["enable_gqa"] = True
            else:
                key = key.repeat_interleave(self.heads_per_group, dim=1)
                value = value.repeat_interleave(self.heads_per_group, dim=1)
        dropout = self.config.attention_dropout if self.training else 0.0
        # Heads are sharded over TP, so dropout draws from the per-TP-rank stream.
        rng = get_rng_tracker().fork() if dropout > 0 else contextlib.nullcontext()
        with rng:
            if attention_mask is None:
                out = F.scaled_dot_product_attention(query, key, value, dropout_p=dropout,
                                                     is_causal=True, **kwargs)
            else:
                out = F.scaled_dot_product_attention(query, key, value, attn_mask=~attention_mask,
                                                     dropout_p=dropout, **kwargs)
        return out.permute(2, 0, 1, 3).reshape(s, b, self.local_heads * self.head_dim)
