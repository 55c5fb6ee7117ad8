"""Multi-latent attention (MLA: DeepSeek-V2/V3; Megatron's MLASelfAttention), equal to Hugging
Face's DeepseekV3Attention.

Per token, the queries come from the hidden states, or through a small latent
(``linear_q_down_proj`` [q_lora_rank], its norm, ``linear_q_up_proj``); keys and values come
from one latent (``linear_kv_down_proj`` [kv_lora_rank + qk_pos_emb_head_dim], its norm on
the first kv_lora_rank channels, ``linear_kv_up_proj``, which gives every head its key part
without position [qk_head_dim] and its value [v_head_dim]). The last qk_pos_emb_head_dim
channels of the down projection are one more key part, rotated by RoPE and shared by all
heads; each query head has its own rotated part. So a query/key head has qk_head_dim +
qk_pos_emb_head_dim channels and a value head v_head_dim: the attention below is
SelfAttention's (SDPA, packed documents, context parallelism), with values zero-padded to the
query/key head dim where a kernel needs one head dim (``_pads_values``).

Tensor parallelism splits the heads: ``linear_q_proj`` / ``linear_q_up_proj`` and
``linear_kv_up_proj`` are column-parallel (their rows are whole heads), ``linear_proj``
row-parallel. The down projections and their norms are whole on every rank
(``ReplicatedLinear``) and run on this rank's tokens, as Megatron's do: under sequence
parallelism its sequence shard, and the up projections gather the (small) latents; their
weights are then marked ``sequence_parallel`` and finalize_model_grads sums them over TP.
The rotated key part goes to every rank's heads, so its gradient is summed over TP (gathered
from the sequence shards under sequence parallelism, else copied into the TP region).

The softmax scale is 1 / sqrt(qk_head_dim + qk_pos_emb_head_dim), times YaRN's temperature
for ``mscale_all_dim`` squared when the rotary embedding is YaRN with it (DeepSeek-V3's rule).
"""
import torch
import torch.nn.functional as F

from megatron.core.tensor_parallel import (
    ColumnParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
)
from megatron.core.transformer.attention import SelfAttention
from megatron.core.transformer.attention_logits import LatentRows
from megatron.core.transformer.norms import build_norm
from megatron.core.transformer.rope import yarn_mscale
from megatron.core.utils import divide, init_method_normal, scaled_init_method_normal


def latent_attention_softmax_scale(config) -> float:
    """1 / sqrt(query head dim), times mscale(factor, mscale_all_dim)^2 under YaRN with
    ``mscale_all_dim`` set (Hugging Face's ``yarn_apply_mscale``, in its operation order)."""
    scale = (config.qk_head_dim + config.qk_pos_emb_head_dim) ** -0.5
    if config.rope_type == "yarn" and config.mscale_all_dim:
        temperature = yarn_mscale(config.rotary_scaling_factor, config.mscale_all_dim)
        scale = scale * temperature * temperature
    return scale


class MultiLatentAttention(SelfAttention):
    """hidden [s, b, h] (sequence-sharded under SP) -> (output [s, b, h], bias or None)."""

    def _build_projections(self, config, tp_size: int) -> None:
        self.heads_for_sdpa = None  # the compiled layout of a fused QKV: not ours
        self.nope_dim, self.rope_dim = config.qk_head_dim, config.qk_pos_emb_head_dim
        self.head_dim = self.nope_dim + self.rope_dim  # of Q and K (config.kv_channels)
        self.v_head_dim = config.v_head_dim
        self.kv_lora_rank = config.kv_lora_rank
        self.heads_per_group = 1  # a key and a value per head
        self.local_groups = self.local_heads = divide(config.num_attention_heads, tp_size)
        self.softmax_scale = latent_attention_softmax_scale(config)
        heads, h = config.num_attention_heads, config.hidden_size
        init = init_method_normal(config.init_method_std)
        out_init = (scaled_init_method_normal(config.init_method_std, config.num_layers)
                    if config.scaled_output_init else init)

        def column(rows_per_head, input_size):
            return ColumnParallelLinear(input_size, heads * rows_per_head, config=config,
                                        bias=False, init_method=init)

        def norm(size):  # Megatron's: the latents' norms come with --qk-layernorm
            return build_norm(config, size) if config.qk_layernorm else None

        if config.q_lora_rank is None:
            self.linear_q_proj = column(self.head_dim, h)
        else:
            self.linear_q_down_proj = ReplicatedLinear(h, config.q_lora_rank, config=config,
                                                       init_method=init)
            self.q_layernorm = norm(config.q_lora_rank)
            self.linear_q_up_proj = column(self.head_dim, config.q_lora_rank)
        self.linear_kv_down_proj = ReplicatedLinear(h, self.kv_lora_rank + self.rope_dim,
                                                    config=config, init_method=init)
        self.kv_layernorm = norm(self.kv_lora_rank)
        self.linear_kv_up_proj = column(self.nope_dim + self.v_head_dim, self.kv_lora_rank)
        self.linear_proj = RowParallelLinear(
            heads * self.v_head_dim, h, config=config, bias=config.add_bias_linear,
            input_is_parallel=True, skip_bias_add=True, init_method=out_init)

    def qk_clip_layout(self) -> LatentRows:
        """QK-clip's rows: each head's query rows (from the hidden states or the query latent)
        and its key part of the KV up-projection; the shared rotary key is left alone."""
        q = self.linear_q_proj if self.config.q_lora_rank is None else self.linear_q_up_proj
        return LatentRows(q.weight, self.linear_kv_up_proj.weight, self.nope_dim,
                          self.rope_dim, self.v_head_dim)

    def forward(self, hidden, attention_mask=None, rotary_cos=None, rotary_sin=None,
                packed_seq_params=None):
        if rotary_cos is None:
            raise ValueError("multi-latent attention rotates part of every query and key: it "
                             "needs the rotary embedding's cos and sin.")
        query = self._queries(hidden)  # [s, b, heads, nope + rope]
        latent, key_rope = torch.split(self.linear_kv_down_proj(hidden)[0],
                                       [self.kv_lora_rank, self.rope_dim], dim=-1)
        if self.kv_layernorm is not None:
            latent = self.kv_layernorm(latent)
        keys_values, _ = self.linear_kv_up_proj(latent)  # the whole sequence, this rank's heads
        s, b = keys_values.shape[:2]
        keys_values = keys_values.view(s, b, self.local_heads, self.nope_dim + self.v_head_dim)
        key_nope, value = torch.split(keys_values, [self.nope_dim, self.v_head_dim], dim=-1)
        query_nope, query_rope = torch.split(query, [self.nope_dim, self.rope_dim], dim=-1)
        # Everything in [s, b, heads, d] memory (cos/sin [b|1, s, 1, rope] -> [s, b|1, 1,
        # rope]); the kernels see [b, s, heads, d] views of it and write their output in that
        # layout, which the output projection takes as [s, b, heads * d] without a re-layout
        # (dropping V's padding, where there is some, is the one copy).
        cos, sin = rotary_cos.transpose(0, 1), rotary_sin.transpose(0, 1)
        query_rope = self.apply_rotary(query_rope, cos, sin)
        key_rope = self.apply_rotary(self._for_every_head(key_rope)[:, :, None], cos, sin)
        query = torch.cat([query_nope, query_rope], dim=-1)
        key = torch.cat([key_nope, key_rope.expand(s, b, self.local_heads, self.rope_dim)],
                        dim=-1)
        return self._attend(*(t.transpose(0, 1) for t in (query, key, value)), attention_mask,
                            packed_seq_params)

    def _queries(self, hidden):
        """[s', b, h] -> [s, b, local heads, nope + rope] over the whole sequence."""
        if self.config.q_lora_rank is None:
            query, _ = self.linear_q_proj(hidden)
        else:
            latent, _ = self.linear_q_down_proj(hidden)
            if self.q_layernorm is not None:
                latent = self.q_layernorm(latent)
            query, _ = self.linear_q_up_proj(latent)
        return query.view(*query.shape[:2], self.local_heads, self.head_dim)

    def _for_every_head(self, key_rope):
        """[s', b, rope] of this rank's tokens -> [s, b, rope] of the whole sequence. Every
        TP rank's heads use it, so backward sums its gradient over TP (a reduce-scatter back to
        the sequence shards under SP, else an all-reduce)."""
        if self.config.sequence_parallel:
            return gather_from_sequence_parallel_region(key_rope)
        return copy_to_tensor_model_parallel_region(key_rope)

    def _pads_values(self, query, attention_mask, packed_seq_params) -> bool:
        """Whether the kernel that will run needs V's head dim to be Q's and K's: the context-
        parallel blocks always (their kernels and saved buffers assume one head dim), SDPA's
        fused kernels (CPU's and CUDA's flash, the variable-length one; CUDA's memory-
        efficient one could take them unequal, but one rule is simpler and costs only the
        padding). Only SDPA's math kernel (CPU with attention dropout), which keeps the
        s x s scores anyway, takes the narrower V as it is."""
        if self.config.context_parallel_size > 1:
            return True
        dropout = self.config.attention_dropout if self.training else 0.0
        kernel, _ = self._kernel(query, attention_mask if packed_seq_params is None else None,
                                 dropout)
        return kernel != "math"

    def _attention(self, query, key, value, attention_mask, packed_seq_params):
        """SelfAttention's, with V zero-padded to the Q/K head dim where the kernel needs it
        and the padding's (zero) output channels dropped again."""
        pad = self.head_dim - self.v_head_dim  # >= 0: TransformerConfig checks it
        if pad == 0 or not self._pads_values(query, attention_mask, packed_seq_params):
            return super()._attention(query, key, value, attention_mask, packed_seq_params)
        # Padded in [s, b] memory, as Q and K are (see forward).
        value = F.pad(value.transpose(0, 1), (0, pad)).transpose(0, 1)
        context = super()._attention(query, key, value, attention_mask, packed_seq_params)
        s, b = context.shape[:2]
        return context.view(s, b, self.local_heads, self.head_dim)[..., :self.v_head_dim] \
            .reshape(s, b, self.local_heads * self.v_head_dim)
