"""Token dispatch over the expert-parallel (EP) ranks: all-to-all, and all-gather as the
simple reference. Each of the EP ranks holds E / EP consecutive experts (rank r: experts
r*E/EP ... (r+1)*E/EP - 1), and with expert tensor parallelism (ETP) each of the ETP ranks
of an EP rank holds a slice of those experts' f (experts.py): every ETP rank computes every
row of its experts, partially, and the partial outputs are summed over the ETP group.

Same API as LocalDispatcher (EP=1), so the MoE layer can hold either:
    expert_input, tokens_per_local_expert, state = dispatcher.permute(hidden, indices, probs)
    output = dispatcher.unpermute(expert_output, state)
hidden [T, h] (T may differ between ranks, and be 0), indices/probs [T, k] with GLOBAL expert
ids. Capacity, dropping and padding are decided on this rank's own tokens first
(capacity.sort_choices, as at EP = 1). expert_input holds the rows this rank's experts receive,
grouped by local expert and, within an expert, by source rank (global rank order of the
ETP x EP group) then the source's token order: the order LocalDispatcher gives on those
ranks' tokens concatenated (with capacity: each rank's plan, merged by expert), so EP > 1
computes exactly what EP = 1 does. unpermute takes the (ETP-partial) expert output and returns
this rank's tokens, each the gate-weighted sum of its kept expert outputs. Both are
differentiable (hidden and probs): every collective is an autograd function whose backward is
the reverse collective. state.num_dropped (0-dim, on the device): T*k minus the choices
kept on this rank. Host syncs: one copy of split sizes per permute (all the sizes the layer
needs, gathered into one tensor first); the expert loop reuses it (state.host_tokens_per_expert).
"""
from dataclasses import dataclass
from typing import List

import torch
import torch.distributed as dist

from megatron.core import collectives, parallel_state
from megatron.core.transformer.moe.capacity import (
    Choices,
    RowPlan,
    combine,
    plan_from_choices,
    sort_choices,
    source_rows,
)


def _all_to_all(x: torch.Tensor, output_splits: List[int], input_splits: List[int],
                group) -> torch.Tensor:
    if dist.get_world_size(group) == 1:
        return x.clone()
    out = x.new_empty((sum(output_splits), *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), output_splits, input_splits, group=group)
    return out


class _AllToAll(torch.autograd.Function):
    """Rows to ranks by split sizes; backward sends the gradients back the same way."""

    @staticmethod
    def forward(ctx, x, output_splits, input_splits, group):
        ctx.splits, ctx.group = (output_splits, input_splits), group
        return _all_to_all(x, output_splits, input_splits, group)

    @staticmethod
    def backward(ctx, grad):
        output_splits, input_splits = ctx.splits
        return _all_to_all(grad, input_splits, output_splits, ctx.group), None, None, None


def _gather_rows(x: torch.Tensor, sizes: List[int], group) -> torch.Tensor:
    """Every rank's rows (rank r has sizes[r]) concatenated in rank order."""
    width = max(max(sizes), 1)  # all_gather needs equal shapes: pad to the longest
    padded = torch.cat([x, x.new_zeros((width - x.shape[0], *x.shape[1:]))])
    out = x.new_empty((width * len(sizes), *x.shape[1:]))
    collectives.all_gather_into_tensor(out, padded.contiguous(), group=group)
    return torch.cat([out[r * width:r * width + n] for r, n in enumerate(sizes)])


def _reduce_scatter_rows(x: torch.Tensor, sizes: List[int], rank: int, group) -> torch.Tensor:
    """x holds rows for every rank (sizes[r] each, rank order): sum over ranks, keep mine."""
    width = max(max(sizes), 1)
    padded = x.new_zeros((width * len(sizes), *x.shape[1:]))
    for r, chunk in enumerate(torch.split(x, sizes)):
        padded[r * width:r * width + sizes[r]] = chunk
    out = x.new_empty((width, *x.shape[1:]))
    collectives.reduce_scatter_tensor(out, padded, group=group)
    return out[:sizes[rank]]


class _GatherRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, sizes, rank, group):
        ctx.args = (sizes, rank, group)
        return _gather_rows(x, sizes, group)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter_rows(grad.contiguous(), *ctx.args), None, None, None


class _ReduceScatterRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, sizes, rank, group):
        ctx.args = (sizes, group)
        return _reduce_scatter_rows(x, sizes, rank, group)

    @staticmethod
    def backward(ctx, grad):
        sizes, group = ctx.args
        return _gather_rows(grad.contiguous(), sizes, group), None, None, None


def _gather_counts(counts: torch.Tensor, group) -> torch.Tensor:
    """[group size, *counts.shape]: every rank's counts (same shape everywhere)."""
    out = counts.new_empty((dist.get_world_size(group) * counts.numel(),))
    collectives.all_gather_into_tensor(out, counts.reshape(-1).contiguous(), group=group)
    return out.view(-1, *counts.shape)


@dataclass
class AllToAllState:
    plan: RowPlan             # this rank's rows, in the order they are sent
    send_splits: List[int]    # rows sent to / received from each EP rank
    recv_splits: List[int]
    etp_sizes: List[int]      # rows each ETP rank received from its EP all-to-all
    expert_order: torch.Tensor  # arrival order -> local-expert order
    host_tokens_per_expert: List[int]  # rows per local expert (from the one host copy)

    @property
    def num_dropped(self):
        return self.plan.num_dropped


@dataclass
class AllGatherState:
    plan: RowPlan             # this rank's rows
    rows: RowPlan             # the local experts' rows, tokens indexed over the whole group
    token_sizes: List[int]    # every group rank's T

    @property
    def num_dropped(self):
        return self.plan.num_dropped

    @property
    def host_tokens_per_expert(self):
        return self.rows.host_tokens_per_expert


def _sums(values: List[int], width: int) -> List[int]:
    """Sums of consecutive runs of ``width`` values."""
    return [sum(values[i:i + width]) for i in range(0, len(values), width)]


class _EPDispatcher:
    def __init__(self, num_experts: int, capacity_factor=None, drop_policy="probs",
                 pad_to_capacity=False):
        self.ep_group = parallel_state.get_expert_model_parallel_group()
        self.etp_group = parallel_state.get_expert_tensor_parallel_group()
        self.ep_size = dist.get_world_size(self.ep_group)
        self.ep_rank = dist.get_rank(self.ep_group)
        self.etp_size = dist.get_world_size(self.etp_group)
        self.etp_rank = dist.get_rank(self.etp_group)
        if num_experts % self.ep_size != 0:
            raise ValueError(f"num_moe_experts ({num_experts}) must be divisible by "
                             f"expert-model-parallel-size ({self.ep_size}): each EP rank "
                             f"holds the same number of experts.")
        self.num_experts = num_experts
        self.num_local = num_experts // self.ep_size
        self.first_local = self.ep_rank * self.num_local
        self.capacity_args = (capacity_factor, drop_policy)
        self.pad_to_capacity = pad_to_capacity

    def _sort(self, indices, probs) -> Choices:
        return sort_choices(indices, probs, self.num_experts, *self.capacity_args)


class AllToAllDispatcher(_EPDispatcher):
    """Megatron's alltoall dispatcher: each rank sends its kept rows to the EP rank of their
    expert (counts first, so the receivers know the split sizes); with ETP > 1 the received
    rows are all-gathered over the ETP group and the partial outputs reduce-scattered back;
    the answers return the same way. The counts travel on the device; every size the layer
    needs on the host (its kept rows, the splits, the rows per local expert) comes from one
    copy of this rank's counts and the counts it receives."""

    def permute(self, hidden, indices, probs):
        choices = self._sort(indices, probs)
        ep, etp, local = self.ep_size, self.etp_size, self.num_local
        counts = choices.rows_per_expert(self.pad_to_capacity)
        per_rank = [local] * ep
        # received[r, l]: rows EP rank r sends to my local expert l
        received = _all_to_all(counts, per_rank, per_rank, self.ep_group)
        every = received.view(1, ep, local)  # [ETP source, EP source, local expert]
        if etp > 1:
            every = _gather_counts(received.view(ep, local), self.etp_group)
        host = torch.cat([counts, every.reshape(-1)]).tolist()  # the layer's one host copy
        mine, every_host = host[:self.num_experts], host[self.num_experts:]
        plan = plan_from_choices(choices, self.pad_to_capacity, mine)
        send_splits = _sums(mine, local)
        recv_splits = _sums(every_host[self.etp_rank * ep * local:][:ep * local], local)
        arrived = _AllToAll.apply(source_rows(hidden, plan), recv_splits, send_splits,
                                  self.ep_group)
        etp_sizes = _sums(every_host, ep * local)
        if etp > 1:
            arrived = _GatherRows.apply(arrived, etp_sizes, self.etp_rank, self.etp_group)
        # Regroup by local expert, then source rank in the ETP x EP group (ep * ETP + etp).
        dev = hidden.device
        key = (torch.arange(local, device=dev).view(1, 1, local) * (ep * etp)
               + torch.arange(ep, device=dev).view(1, ep, 1) * etp
               + torch.arange(etp, device=dev).view(etp, 1, 1))
        expert_order = torch.argsort(
            torch.repeat_interleave(key.reshape(-1), every.reshape(-1),
                                    output_size=sum(every_host)), stable=True)
        per_local_expert = [sum(every_host[l::local]) for l in range(local)]
        state = AllToAllState(plan, send_splits, recv_splits, etp_sizes, expert_order,
                              per_local_expert)
        return arrived.index_select(0, expert_order), every.sum((0, 1)), state

    def unpermute(self, expert_output, state: AllToAllState):
        order = state.expert_order
        back_to_arrival = torch.empty_like(order)
        back_to_arrival[order] = torch.arange(order.numel(), device=order.device)
        rows = expert_output.index_select(0, back_to_arrival)
        if self.etp_size > 1:  # sum the partial outputs, keep the rows this rank received
            rows = _ReduceScatterRows.apply(rows, state.etp_sizes, self.etp_rank,
                                            self.etp_group)
        rows = _AllToAll.apply(rows, state.send_splits, state.recv_splits, self.ep_group)
        return combine(rows, state.plan)


class AllGatherDispatcher(_EPDispatcher):
    """Megatron's allgather dispatcher: every rank of the ETP x EP group gathers all the
    group's tokens and kept rows, keeps the rows of its local experts, and unpermute
    reduce-scatters (sums) the partial outputs back to the tokens' ranks. Simple, and more
    traffic than all-to-all. Every rank's token count and rows per expert are gathered on
    the device and copied to the host once."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.group = parallel_state.get_expert_tensor_and_model_parallel_group()
        self.rank = dist.get_rank(self.group)

    def permute(self, hidden, indices, probs):
        choices = self._sort(indices, probs)
        counts = choices.rows_per_expert(self.pad_to_capacity)
        sizes = _gather_counts(torch.cat([counts.new_full((1,), choices.num_tokens), counts]),
                               self.group)  # [group size, 1 + E]
        host = sizes.tolist()  # the layer's one host copy
        token_sizes = [row[0] for row in host]
        row_sizes = [sum(row[1:]) for row in host]
        plan = plan_from_choices(choices, self.pad_to_capacity, host[self.rank][1:])
        total = sum(token_sizes)
        offset = sum(token_sizes[:self.rank])
        # Tokens indexed over the group; padding rows read the zero row at index `total`.
        row_token = torch.where(plan.row_token == plan.num_tokens, total,
                                plan.row_token + offset)
        every_token = _gather_rows(row_token, row_sizes, self.group)
        every_expert = _gather_rows(plan.row_expert, row_sizes, self.group)
        every_probs = _GatherRows.apply(plan.row_probs, row_sizes, self.rank, self.group)
        every_hidden = _GatherRows.apply(hidden, token_sizes, self.rank, self.group)
        mine = slice(1 + self.first_local, 1 + self.first_local + self.num_local)
        per_local_expert = [sum(row[mine][l] for row in host) for l in range(self.num_local)]
        local = every_expert - self.first_local
        is_mine = (local >= 0) & (local < self.num_local)
        # Other ranks' experts sort after every local expert (key num_local) and are cut off.
        order = torch.argsort(torch.where(is_mine, local, self.num_local),
                              stable=True)[:sum(per_local_expert)]
        tokens_per_local_expert = sizes[:, mine].sum(0)
        rows = RowPlan(every_token[order], every_probs[order], every_expert[order],
                       tokens_per_local_expert, total, True, plan.num_dropped.new_zeros(()),
                       per_local_expert)
        state = AllGatherState(plan, rows, token_sizes)
        return source_rows(every_hidden, rows), tokens_per_local_expert, state

    def unpermute(self, expert_output, state: AllGatherState):
        partial = combine(expert_output, state.rows)
        return _ReduceScatterRows.apply(partial, state.token_sizes, self.rank, self.group)


DISPATCHERS = {"alltoall": AllToAllDispatcher, "allgather": AllGatherDispatcher}
