"""Token dispatch without expert parallelism: permute tokens into expert order, and back.

The API the expert-parallel dispatchers share:
    expert_input, tokens_per_expert, state = dispatcher.permute(hidden, indices, probs)
    output = dispatcher.unpermute(expert_output, state)
expert_input holds one row per kept (token, choice) pair, grouped by expert (ascending) and,
within an expert, in token order (capacity.plan_rows; with padding, `capacity` rows per
expert). No Python loop over tokens: one stable argsort, index_select to gather and index_add
to combine (weighted by the gate probabilities, summed over choices). state.num_dropped is
T*k minus the kept choices (0-dim, on the device). Host syncs: none, except one copy of the
kept counts when dropping without padding (the row count depends on them), which
state.host_tokens_per_expert hands on to the expert loop.
"""
from megatron.core.transformer.moe.capacity import (  # noqa: F401 - re-exported
    RowPlan,
    combine,
    count_per_expert,
    expert_capacity,
    kept_mask,
    plan_rows,
    source_rows,
)

PermuteState = RowPlan  # the state LocalDispatcher hands from permute to unpermute


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
        plan = plan_rows(indices, probs, self.num_experts, self.capacity_factor,
                         self.drop_policy, self.pad_to_capacity)
        return source_rows(hidden, plan), plan.tokens_per_expert, plan

    def unpermute(self, expert_output, state: RowPlan):
        """expert_output [N, h] -> [T, h]: each row times its gate weight, summed per token."""
        return combine(expert_output, state)
