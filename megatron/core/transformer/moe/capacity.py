"""Expert capacity and token dropping, decided on one rank's own tokens (as Megatron's router
does), and the row plan every dispatcher builds from it.

Routing happens on each rank's T tokens before any dispatch, so the drop decision is made
there: EP > 1 keeps exactly the choices EP = 1 keeps for the same rank's tokens, whichever
dispatcher runs. The plan lists the rows this rank contributes, grouped by global expert
(ascending) and, within an expert, in token order; with padding every expert gets exactly
`capacity` rows (the extra ones read a zero row, index T, with gate weight 0), so shapes are
static and an expert at EP > 1 receives EP x capacity rows.

No host syncs (a device-to-host read stalls the CPU on CUDA): `sort_choices` is device work
only, and `RowPlan`s are built from it with sizes the host already knows. The one size the
host cannot know is the number of kept rows when dropping without padding: the caller copies
the kept counts once (`Choices.needs_host_counts`), with any other sizes its layer needs.
"""
import math
from dataclasses import dataclass
from typing import List, Optional

import torch


def expert_capacity(num_tokens, topk, num_experts, capacity_factor):
    """Megatron's capacity: ceil(T*k/E * factor) rows per expert, T this rank's tokens."""
    return math.ceil(num_tokens * topk / num_experts * capacity_factor)


def count_per_expert(expert_ids, num_experts):
    """[num_experts] int64: how often each id occurs. bincount's numbers without its host
    syncs (on CUDA it reads the max id and the output size)."""
    flat = expert_ids.reshape(-1)
    counts = torch.zeros(num_experts, dtype=torch.long, device=flat.device)
    return counts.scatter_add_(0, flat, torch.ones_like(flat))


def kept_mask(flat_expert, flat_probs, num_experts, capacity, drop_policy):
    """[T*k] bool: which routing choices survive when each expert keeps at most `capacity`,
    the highest-probability ones ("probs") or the earliest tokens ("position"); ties keep the
    earlier token."""
    if drop_policy == "probs":
        by_prob = torch.argsort(flat_probs, descending=True, stable=True)
        order = by_prob[torch.argsort(flat_expert[by_prob], stable=True)]
    else:
        order = torch.argsort(flat_expert, stable=True)
    counts = count_per_expert(flat_expert, num_experts)
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
    num_dropped: torch.Tensor  # 0-dim: T*k minus the kept choices, on this rank's device
    # tokens_per_expert on the host where it is known without another sync, else None
    host_tokens_per_expert: Optional[List[int]] = None


@dataclass
class Choices:
    """This rank's T*k routing choices sorted for dispatch, on the device (no host sync)."""
    sort_key: torch.Tensor  # [T*k] the expert of a kept choice, E for a dropped one
    order: torch.Tensor  # [T*k] stable argsort of sort_key: kept by expert, dropped last
    key_counts: torch.Tensor  # [E + 1] choices per key (the last: dropped ones)
    flat_token: torch.Tensor  # [T*k] the token of each choice
    flat_probs: torch.Tensor  # [T*k] its gate weight, differentiable
    num_tokens: int
    capacity: Optional[int]

    @property
    def num_experts(self):
        return self.key_counts.numel() - 1

    @property
    def kept_per_expert(self):
        return self.key_counts[:-1]

    @property
    def num_dropped(self):
        return self.key_counts[-1]

    def needs_host_counts(self, pad_to_capacity):
        """Whether the plan's row count is data-dependent (dropping without padding)."""
        return self.capacity is not None and not pad_to_capacity

    def rows_per_expert(self, pad_to_capacity):
        """[E] the rows each expert gets in the plan (device), padding included."""
        if pad_to_capacity:
            return torch.full_like(self.kept_per_expert, _padded_capacity(self))
        return self.kept_per_expert


def _padded_capacity(choices):
    if choices.capacity is None:
        raise ValueError("moe_pad_expert_input_to_capacity needs moe_expert_capacity_factor")
    return choices.capacity


def sort_choices(indices, probs, num_experts, capacity_factor=None,
                 drop_policy="probs") -> Choices:
    """Capacity, then one stable sort of the choices by expert (dropped ones last)."""
    num_tokens, topk = indices.shape
    keep, capacity = apply_capacity(indices, probs, num_experts, capacity_factor, drop_policy)
    flat_expert = indices.reshape(-1)
    flat_token = torch.arange(num_tokens, device=indices.device).repeat_interleave(
        topk, output_size=num_tokens * topk)
    sort_key = torch.where(keep.reshape(-1), flat_expert, num_experts)
    order = torch.argsort(sort_key, stable=True)
    return Choices(sort_key, order, count_per_expert(sort_key, num_experts + 1), flat_token,
                   probs.reshape(-1), num_tokens, capacity)


def plan_from_choices(choices: Choices, pad_to_capacity=False,
                      host_kept_per_expert: Optional[List[int]] = None) -> RowPlan:
    """The rows of the sorted choices. host_kept_per_expert (kept_per_expert on the host) is
    needed where `choices.needs_host_counts(pad_to_capacity)`, ignored otherwise."""
    if pad_to_capacity:
        return _padded_plan(choices)
    counts, host_counts = choices.kept_per_expert, host_kept_per_expert
    if choices.capacity is None:
        num_kept = choices.order.numel()  # nothing dropped: every choice is a row
    elif host_kept_per_expert is None:
        raise ValueError("dropping without padding needs the kept counts on the host")
    else:
        num_kept = sum(host_kept_per_expert)
    order = choices.order[:num_kept]
    return RowPlan(choices.flat_token[order], choices.flat_probs[order],
                   choices.sort_key[order], counts, choices.num_tokens, False,
                   choices.num_dropped, host_counts)


def _padded_plan(choices: Choices) -> RowPlan:
    """Each expert's kept rows at the start of its `capacity` slots; the rest point at the
    zero row (index T) with weight 0. Only the first min(T*k, E*capacity) sorted choices can
    be kept; any dropped ones among them write past the E*capacity slots and are cut off, so
    no host needs the kept count."""
    num_experts, capacity = choices.num_experts, _padded_capacity(choices)
    slots = num_experts * capacity
    candidates = choices.order[:min(choices.order.numel(), slots)]
    key = choices.sort_key[candidates]
    starts = torch.cumsum(choices.key_counts, 0) - choices.key_counts
    rank = torch.arange(candidates.numel(), device=key.device) - starts[key]
    slot = key * capacity + rank  # dropped ones (key E): E*capacity + their distinct rank
    total = slots + candidates.numel()
    padded_token = choices.flat_token.new_full((total,), choices.num_tokens)
    padded_token[slot] = choices.flat_token[candidates]
    padded_probs = choices.flat_probs.new_zeros(total).index_copy(
        0, slot, choices.flat_probs[candidates])
    row_expert = torch.arange(num_experts, device=key.device).repeat_interleave(
        capacity, output_size=slots)
    counts = torch.full_like(choices.kept_per_expert, capacity)
    # Copies of the E*capacity slots: autograd then keeps [E*capacity], not the cut-off tail.
    return RowPlan(padded_token[:slots].clone(), padded_probs[:slots].clone(), row_expert,
                   counts, choices.num_tokens, True, choices.num_dropped,
                   [capacity] * num_experts)


def plan_rows(indices, probs, num_experts, capacity_factor=None, drop_policy="probs",
              pad_to_capacity=False) -> RowPlan:
    """The rows this rank sends to the experts (see the module docstring). Copies the kept
    counts to the host only when dropping without padding (the plan's row count)."""
    choices = sort_choices(indices, probs, num_experts, capacity_factor, drop_policy)
    host_counts = None
    if choices.needs_host_counts(pad_to_capacity):
        host_counts = choices.kept_per_expert.tolist()  # the one copy
    return plan_from_choices(choices, pad_to_capacity, host_counts)


def source_rows(hidden, plan: RowPlan):
    """hidden [T, h] -> the plan's rows [N, h] (padding rows are zeros)."""
    if plan.padded:
        hidden = torch.cat([hidden, hidden.new_zeros(1, hidden.shape[1])])
    return hidden.index_select(0, plan.row_token)


def combine(rows, plan: RowPlan, num_tokens: Optional[int] = None):
    """rows [N, h] (the experts' answers in plan order) -> [T, h]: each row times its gate
    weight, summed per token (padding rows land on a dropped extra row). The products and
    the sum are fp32 (the bf16 rows are saved for backward, not an fp32 copy), cast back to
    the rows' dtype once: fp32 rows give exactly the numbers of the plain expression."""
    num_tokens = plan.num_tokens if num_tokens is None else num_tokens
    accumulate = torch.promote_types(rows.dtype, torch.float32)
    weighted = rows * plan.row_probs.to(accumulate).unsqueeze(-1)  # promotes bf16 rows
    out = torch.zeros(num_tokens + 1, rows.shape[1], dtype=accumulate, device=rows.device)
    out = out.index_add(0, plan.row_token, weighted)
    return out[:num_tokens].to(rows.dtype)
