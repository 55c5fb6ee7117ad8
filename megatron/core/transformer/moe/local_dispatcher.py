"""Token dispatch without expert parallelism: permute tokens into expert order, and back.

The API the expert-parallel dispatchers share:
    expert_input, tokens_per_expert, state = dispatcher.permute(hidden, indices, probs)
    output = dispatcher.unpermute(expert_output, state)
expert_input holds one row per kept (token, choice) pair, grouped by expert (ascending) and,
within an expert, in token order. No Python loop over tokens: one stable argsort, index_select
to gather and index_add to combine (weighted by the gate probabilities, summed over choices).
"""
import math
from dataclasses import dataclass

import torch


@dataclass
class PermuteState:
    row_token: torch.Tensor  # [N] the token each row came from (num_tokens for a padding row)
    row_probs: torch.Tensor  # [N] the gate weight of each row (0 for a padding row)
    num_tokens: int
    padded: bool
    num_dropped: int


def expert_capacity(num_tokens, topk, num_experts, capacity_factor):
    """Megatron's capacity: ceil(T*k/E * factor) rows per expert."""
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


class LocalDispatcher:
    def __init__(self, num_experts, capacity_factor=None, drop_policy="probs",
                 pad_to_capacity=False):
        self.num_experts = num_experts
        self.capacity_factor = capacity_factor
        self.drop_policy = drop_policy
        self.pad_to_capacity = pad_to_capacity

    def permute(self, hidden, indices, probs):
        """hidden [T, h], indices/probs [T, k] -> (expert_input [N, h], tokens_per_expert [E]
        (rows each expert receives, padding included), state)."""
        num_tokens, topk = indices.shape
        flat_expert = indices.reshape(-1)
        flat_probs = probs.reshape(-1)
        flat_token = torch.arange(num_tokens, device=hidden.device).repeat_interleave(topk)
        capacity = None
        if self.capacity_factor is not None:
            capacity = expert_capacity(num_tokens, topk, self.num_experts, self.capacity_factor)
            keep = kept_mask(flat_expert, flat_probs.detach(), self.num_experts, capacity,
                             self.drop_policy)
        else:
            keep = torch.ones_like(flat_expert, dtype=torch.bool)
        # Dropped choices sort after every expert (key E) and are cut off.
        sort_key = torch.where(keep, flat_expert, self.num_experts)
        num_kept = int(keep.sum())
        order = torch.argsort(sort_key, stable=True)[:num_kept]
        tokens_per_expert = torch.bincount(flat_expert[order], minlength=self.num_experts)
        row_token, row_probs = flat_token[order], flat_probs[order]
        if self.pad_to_capacity:
            row_token, row_probs = self._pad(row_token, row_probs, tokens_per_expert, capacity,
                                             num_tokens)
            tokens_per_expert = torch.full_like(tokens_per_expert, capacity)
            hidden = torch.cat([hidden, hidden.new_zeros(1, hidden.shape[1])])
        state = PermuteState(row_token, row_probs, num_tokens, self.pad_to_capacity,
                             flat_expert.numel() - num_kept)
        return hidden.index_select(0, row_token), tokens_per_expert, state

    def _pad(self, row_token, row_probs, tokens_per_expert, capacity, num_tokens):
        """Place each expert's rows at the start of its `capacity` slots; the rest point at a
        zero row (index num_tokens) with weight 0."""
        starts = torch.cumsum(tokens_per_expert, 0) - tokens_per_expert
        row_expert = torch.repeat_interleave(
            torch.arange(self.num_experts, device=row_token.device), tokens_per_expert)
        rank = torch.arange(row_token.numel(), device=row_token.device) - starts[row_expert]
        slot = row_expert * capacity + rank
        padded_token = row_token.new_full((self.num_experts * capacity,), num_tokens)
        padded_token[slot] = row_token
        padded_probs = row_probs.new_zeros(self.num_experts * capacity).index_copy(
            0, slot, row_probs)
        return padded_token, padded_probs

    def unpermute(self, expert_output, state):
        """expert_output [N, h] -> [T, h]: each row times its gate weight, summed per token."""
        weighted = expert_output * state.row_probs.to(expert_output.dtype).unsqueeze(-1)
        rows = state.num_tokens + (1 if state.padded else 0)
        out = expert_output.new_zeros(rows, expert_output.shape[1])
        out = out.index_add(0, state.row_token, weighted)
        return out[:state.num_tokens] if state.padded else out
