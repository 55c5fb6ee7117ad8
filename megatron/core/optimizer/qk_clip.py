"""QK-clip (MuonClip, Kimi K2): the building blocks, not yet wired into training.

Per attention head h, S_max^h = the max over the allowed (mask) entries of
(q_i . k_j) * softmax_scale. After the optimizer step, each head with S_max^h > tau gets
gamma_h = tau / S_max^h: its query rows of W_q are scaled by gamma_h^alpha and its key rows of
W_k by gamma^(1 - alpha). Under GQA a key head is shared by the group's query heads: its gamma
is the min over the group (the strongest clip, so every head's max logit ends <= tau).
"""
from typing import Optional

import torch


@torch.no_grad()
def max_attention_logits(query: torch.Tensor, key: torch.Tensor, softmax_scale: float,
                         allowed: Optional[torch.Tensor] = None, causal: bool = True,
                         block: int = 256) -> torch.Tensor:
    """query [b, s_q, heads, d], key [b, s_k, groups, d] (heads a multiple of groups; query
    head h uses key group h // (heads // groups)) -> [heads] fp32 max pre-softmax logit over
    the entries allowed: ``allowed`` [s_q, s_k] or [b, s_q, s_k] bool (True = attended), else
    causal (query i sees keys j <= i + s_k - s_q) or everything. Computed a block of query
    rows at a time (never the whole s_q x s_k per head at once). -inf for a head that attends
    nothing."""
    b, s_q, heads, d = query.shape
    groups = key.size(2)
    per_group = heads // groups
    q = query.float().reshape(b, s_q, groups, per_group, d)
    k = key.float()
    out = torch.full((heads,), float("-inf"), device=query.device)
    s_k = k.size(1)
    cols = torch.arange(s_k, device=query.device)
    for start in range(0, s_q, block):
        stop = min(start + block, s_q)
        # [b, groups, per_group, rows, s_k]
        logits = torch.einsum("bigpd,bjgd->bgpij", q[:, start:stop], k) * softmax_scale
        if allowed is not None:
            mask = allowed[..., start:stop, :]
            mask = mask.unsqueeze(-3).unsqueeze(-3) if mask.dim() == 3 else mask
        elif causal:
            rows = torch.arange(start, stop, device=query.device) + (s_k - s_q)
            mask = cols[None, :] <= rows[:, None]
        else:
            mask = None
        if mask is not None:
            logits = logits.masked_fill(~mask, float("-inf"))
        out = torch.maximum(out, logits.amax(dim=(0, 3, 4)).reshape(heads))
    return out


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
