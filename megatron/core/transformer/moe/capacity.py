"""Expert capacity and token dropping, decided on one rank's own tokens (as Megatron's router
does), and the row plan every dispatcher builds from it.

Routing happens on each rank's T tokens before any dispatch, so the drop decision is made
there: EP > 1 keeps exactly the choices EP = 1 keeps for the same rank's tokens, whichever
dispatcher runs. The plan lists the rows this rank contributes, grouped by global expert
(ascending) and, within an expert, in token order; with padding every expert gets exactly
`capacity` rows (the extra ones read a zero row, index T, with gate weight 0), so shapes are
static and an expert at EP > 1 receives EP x capacity rows.
"""
import math
from dataclasses import dataclass
from typing import Optional

import torch


def expert_capacity(num_tokens, topk, num_experts, capacity_factor):
    """Megatron's capacity: ceil(T*k/E * factor) rows per expert, T this rank's tokens."""
    return math.ceil(num_tokens * topk / num_experts * capacity_factor)


def kept_mask(flat_expert, flat_probs, num_experts, capacity, drop_policy):
    """[T*k] bool: which routing choices survive when each expert keeps at most `capacity`,
    the highest-probability ones ("probs") or the earliest tokens ("position"); ties keep the
    earlier token."""
    if drop_policy == "probs":
        by_prob = torch.argsort(flat_probs, descending=True, stable=True)
        order = by_prob[torch.argsort(flat_expert[by_prob], stable=True)]
    else:
        order = torch.argsort(flat_expert, stable=True)
    counts = torch.bincount(flat_expert, minlength=num_experts)
    starts = torch.cumsum(counts, 0) - counts
    sorted_expert = flat_expert[order]
    rank_in_expert = torch.arange(order.numel(), device=order.device) - starts[sorted_expert]
    keep = torch.empty_like(flat_expert, dtype=torch.bool)
    keep[order] = rank_in_expert < capacity
    return keep


def apply_capacity(indices, probs, num_experts, capacity_factor, drop_policy="probs"):
    """indices/probs [T, k] of this rank -> (keep [T, k] bool, capacity or None). Without a
    capacity factor every choice is kept."""
    if capacity_factor is None:
        return torch.ones_like(indices, dtype=torch.bool), None
    num_tokens, topk = indices.shape
    capacity = expert_capacity(num_tokens, topk, num_experts, capacity_factor)
    keep = kept_mask(indices.reshape(-1), probs.detach().reshape(-1), num_experts, capacity,
                     drop_policy)
    return keep.view_as(indices), capacity


@dataclass
class RowPlan:
    row_token: torch.Tensor  # [N] the local token of each row (num_tokens for a padding row)
    row_probs: torch.Tensor  # [N] its gate weight (0 for a padding row), differentiable
    row_expert: torch.Tensor  # [N] its global expert
    tokens_per_expert: torch.Tensor  # [E] rows per expert, padding included
    num_tokens: int
    padded: bool
    num_dropped: int  # T*k minus the kept choices, on this rank


def plan_rows(indices, probs, num_experts, capacity_factor=None, drop_policy="probs",
              pad_to_capacity=False) -> RowPlan:
    """The rows this rank sends to the experts (see the module docstring)."""
    num_tokens, topk = indices.shape
    keep, capacity = apply_capacity(indices, probs, num_experts, capacity_factor, drop_policy)
    flat_expert, flat_probs = indices.reshape(-1), probs.reshape(-1)
    flat_token = torch.arange(num_tokens, device=indices.device).repeat_interleave(topk)
    keep = keep.reshape(-1)
    # Dropped choices sort after every expert (key E) and are cut off.
    num_kept = int(keep.sum())
    order = torch.argsort(torch.where(keep, flat_expert, num_experts), stable=True)[:num_kept]
    row_expert, row_token, row_probs = flat_expert[order], flat_token[order], flat_probs[order]
    counts = torch.bincount(row_expert, minlength=num_experts)
    if pad_to_capacity:
        if capacity is None:
            raise ValueError("moe_pad_expert_input_to_capacity needs "
                             "moe_expert_capacity_factor")
        row_token, row_probs = _pad(row_token, row_probs, row_expert, counts, capacity,
                                    num_tokens)
        row_expert = torch.arange(num_experts, device=indices.device).repeat_interleave(capacity)
        counts = torch.full_like(counts, capacity)
    return RowPlan(row_token, row_probs, row_expert, counts, num_tokens, pad_to_capacity,
                   flat_expert.numel() - num_kept)


def _pad(row_token, row_probs, row_expert, counts, capacity, num_tokens):
    """Place each expert's rows at the start of its `capacity` slots; the rest point at the
    zero row (index num_tokens) with weight 0."""
    num_experts = counts.numel()
    starts = torch.cumsum(counts, 0) - counts
    rank = torch.arange(row_token.numel(), device=row_token.device) - starts[row_expert]
    slot = row_expert * capacity + rank
    padded_token = row_token.new_full((num_experts * capacity,), num_tokens)
    padded_token[slot] = row_token
    padded_probs = row_probs.new_zeros(num_experts * capacity).index_copy(0, slot, row_probs)
    return padded_token, padded_probs


def source_rows(hidden, plan: RowPlan):
    """hidden [T, h] -> the plan's rows [N, h] (padding rows are zeros)."""
    if plan.padded:
        hidden = torch.cat([hidden, hidden.new_zeros(1, hidden.shape[1])])
    return hidden.index_select(0, plan.row_token)


def combine(rows, plan: RowPlan, num_tokens: Optional[int] = None):
    """rows [N, h] (the experts' answers in plan order) -> [T, h]: each row times its gate
    weight, summed per token (padding rows land on a dropped extra row)."""
    num_tokens = plan.num_tokens if num_tokens is None else num_tokens
    weighted = rows * plan.row_probs.to(rows.dtype).unsqueeze(-1)
    out = rows.new_zeros(num_tokens + 1, rows.shape[1]).index_add(0, plan.row_token, weighted)
    return out[:num_tokens]
