"""QK-clip (MuonClip, Kimi K2; Megatron-LM's --qk-clip): keeps every attention head's largest
pre-softmax logit under a threshold tau by rescaling its query and key projections after each
optimizer step.

Per attention head h, S_max^h = the max over the allowed (mask) entries of
(q_i . k_j) * softmax_scale, over the iteration's microbatches (recorded by the attention:
transformer/attention_logits.py). After the optimizer step, each head with S_max^h > tau gets
gamma_h = tau / S_max^h: its query rows of W_q are scaled by gamma_h^alpha and its key rows of
W_k by gamma^(1 - alpha). Under GQA a key head is shared by the group's query heads: its gamma
is the min over the group (the strongest clip, so every head's max logit ends <= tau). Value
rows are never touched.

``QKClip`` is the training step's part (training.train_step): reset the layers' maxima before
the forward passes, reduce them over DP x CP afterwards (TP ranks own their heads, pipeline
stages their layers), and hand the optimizer each layer's row factors, which it applies to
its main params between the update and their copy to the model (``MegatronOptimizer.step``'s
``row_scales``): so the fp32 main params, the distributed optimizer's shards and the model's
(bf16) params all hold the clipped weights, and the all-gather spreads them.
"""
from typing import Dict, List, Optional

import torch
import torch.distributed as dist

from megatron.core import device, parallel_state
from megatron.core.pipeline_parallel.model_chunks import get_model_config
# max_attention_logits lives with the attention that records it; re-exported beside the math
# it feeds.
from megatron.core.transformer.attention_logits import (  # noqa: F401
    FusedQKVRows,
    LatentRows,
    max_attention_logits,
)


def clip_factors(max_logits: torch.Tensor, threshold: float) -> torch.Tensor:
    """[heads] max logits -> [heads] gamma = min(1, threshold / max)."""
    return torch.where(max_logits > threshold, threshold / max_logits,
                       torch.ones_like(max_logits))


@torch.no_grad()
def scale_fused_qkv_(weight: torch.Tensor, gamma: torch.Tensor, alpha: float,
                     heads_per_group: int, head_dim: int, bias: Optional[torch.Tensor] = None
                     ) -> None:
    """Rescale in place the fused QKV weight [groups * (heads_per_group + 2) * head_dim, in]
    (per group: its query heads, then its key, then its value; a TP rank's local groups with
    ``gamma`` its local heads'): query head h's rows by gamma_h^alpha, the group's key rows by
    (min over the group's gamma)^(1 - alpha); value rows untouched. A bias, if given, alike."""
    groups = weight.size(0) // ((heads_per_group + 2) * head_dim)
    g = gamma.to(torch.float32).reshape(groups, heads_per_group)
    q_scale = g.pow(alpha)
    k_scale = g.amin(dim=1).pow(1.0 - alpha)
    scale = torch.cat([q_scale, k_scale[:, None], torch.ones_like(k_scale)[:, None]], dim=1)
    rows = scale.repeat_interleave(head_dim, dim=1).reshape(-1).to(weight.dtype)
    for t in (weight, bias):
        if t is not None:
            t.mul_(rows.view(-1, *([1] * (t.dim() - 1))))


@torch.no_grad()
def scale_mla_(q_weight: torch.Tensor, kv_up_weight: torch.Tensor, gamma: torch.Tensor,
               alpha: float, nope_dim: int, rope_dim: int, v_head_dim: int) -> None:
    """Multi-latent attention (Kimi K2's MuonClip): per local head h, the query projection's
    [heads * (nope_dim + rope_dim), in] rows: the non-rotary part by gamma_h^alpha, the rotary
    part by gamma_h; the KV up-projection's [heads * (nope_dim + v_head_dim), kv_lora_rank]
    rows: the non-rotary key part by gamma_h^(1 - alpha), the value untouched. The shared
    rotary key (from the down-projection) is left alone."""
    g = gamma.to(torch.float32)[:, None]
    q_rows = torch.cat([g.pow(alpha).expand(-1, nope_dim), g.expand(-1, rope_dim)], dim=1)
    k_rows = torch.cat([g.pow(1.0 - alpha).expand(-1, nope_dim),
                        torch.ones_like(g).expand(-1, v_head_dim)], dim=1)
    q_weight.mul_(q_rows.reshape(-1, 1).to(q_weight.dtype))
    kv_up_weight.mul_(k_rows.reshape(-1, 1).to(kv_up_weight.dtype))


def row_factors(layout, gamma: torch.Tensor, alpha: float) -> Dict[torch.nn.Parameter,
                                                                    torch.Tensor]:
    """{param: fp32 [rows] factor of each of its rows (dim 0)} of one attention layer's
    ``layout`` (FusedQKVRows or LatentRows) for its heads' ``gamma``: the scale_* functions
    above applied to a column of ones, so the factors are theirs exactly."""
    if isinstance(layout, FusedQKVRows):
        rows = torch.ones(layout.weight.size(0), 1, device=gamma.device)
        scale_fused_qkv_(rows, gamma, alpha, layout.heads_per_group, layout.head_dim)
        factors = {layout.weight: rows[:, 0]}
        if layout.bias is not None:
            factors[layout.bias] = rows[:, 0]
        return factors
    q_rows = torch.ones(layout.q_weight.size(0), 1, device=gamma.device)
    kv_rows = torch.ones(layout.kv_up_weight.size(0), 1, device=gamma.device)
    scale_mla_(q_rows, kv_rows, gamma, alpha, layout.nope_dim, layout.rope_dim,
               layout.v_head_dim)
    return {layout.q_weight: q_rows[:, 0], layout.kv_up_weight: kv_rows[:, 0]}


def _all_reduce_max(tensor: torch.Tensor, group) -> None:
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=group)


class QKClip:
    """One training run's QK-clip (or only the max-logit log, ``clip=False``) over this rank's
    attention layers: every module of ``model_chunks`` with a ``qk_clip_layout()``."""

    def __init__(self, model_chunks: List[torch.nn.Module], threshold: float, alpha: float,
                 clip: bool = True):
        self.layers = [m for chunk in model_chunks for m in chunk.modules()
                       if callable(getattr(m, "qk_clip_layout", None))]
        self.threshold, self.alpha, self.clip = threshold, alpha, clip
        # The last iteration's max over every layer and head of the model (all ranks), a
        # device scalar: the logger reads it at the log interval.
        self.max_logit: Optional[torch.Tensor] = None

    @classmethod
    def for_model(cls, model_chunks: List[torch.nn.Module]) -> Optional["QKClip"]:
        """As the model's config says (--qk-clip, --log-max-attention-logit), or None."""
        config = get_model_config(model_chunks[0])
        if not (getattr(config, "qk_clip", False) or
                getattr(config, "log_max_attention_logit", False)):
            return None  # (a model config of another kind has neither)
        return cls(model_chunks, config.qk_clip_threshold, config.qk_clip_alpha,
                   config.qk_clip)

    def reset(self) -> None:
        """Before an iteration's forward passes: the running maxima start again."""
        for layer in self.layers:
            layer.max_logits = None

    def reduced_maxima(self) -> List[torch.Tensor]:
        """Each layer's [local heads] max over the iteration, reduced over DP x CP (the same
        heads on other data and other parts of the sequence); sets ``max_logit``, reduced
        over the model-parallel ranks too. Collective: every rank calls it."""
        local = [layer.max_logits if layer.max_logits is not None
                 else device.empty(layer.local_heads).fill_(float("-inf"))
                 for layer in self.layers]  # a layer that ran no forward clips nothing
        flat = torch.cat(local) if local else device.empty(0)
        _all_reduce_max(flat, parallel_state.get_data_parallel_group(with_context_parallel=True))
        top = flat.max().reshape(1) if flat.numel() else \
            device.empty(1).fill_(float("-inf"))  # a stage without attention layers
        _all_reduce_max(top, parallel_state.get_model_parallel_group())
        self.max_logit = top[0]
        return list(flat.split([t.numel() for t in local]))

    def row_scales(self) -> Dict[torch.nn.Parameter, torch.Tensor]:
        """After the forward and backward passes, before the optimizer step: {model param:
        [rows] factor} for the step to apply (empty when only logging). Every layer's factors,
        1 where nothing is clipped: no host read decides which (x * 1.0 is x, bitwise)."""
        maxima = self.reduced_maxima()
        scales = {}
        if self.clip:
            for layer, layer_max in zip(self.layers, maxima):
                scales.update(row_factors(layer.qk_clip_layout(),
                                          clip_factors(layer_max, self.threshold), self.alpha))
        return scales
