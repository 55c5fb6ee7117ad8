"""Token dispatch over the expert-parallel (EP) ranks: all-to-all, and all-gather as the
simple reference. Each of the EP ranks holds E / EP consecutive experts (rank r: experts
r*E/EP ... (r+1)*E/EP - 1).

Same API as LocalDispatcher (EP=1), so the MoE layer can hold either:
    expert_input, tokens_per_local_expert, state = dispatcher.permute(hidden, indices, probs)
    output = dispatcher.unpermute(expert_output, state)
hidden [T, h] (T may differ between ranks, and be 0), indices/probs [T, k] with GLOBAL expert
ids. expert_input holds the rows this rank's experts receive, grouped by local expert and,
within an expert, by source rank then token: the order LocalDispatcher gives on the EP ranks'
tokens concatenated, so EP > 1 computes exactly what EP = 1 does. unpermute returns this
rank's tokens, each the gate-weighted sum of its k expert outputs. Both are differentiable
(hidden and probs): every collective is an autograd function whose backward is the reverse
collective. No capacity dropping here yet.
"""
from dataclasses import dataclass
from typing import List, Optional

import torch
import torch.distributed as dist

from megatron.core import collectives, parallel_state


def _all_to_all(x: torch.Tensor, output_splits: List[int], input_splits: List[int],
                group) -> torch.Tensor:
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


@dataclass
class EPState:
    row_token: torch.Tensor  # [rows] the token (of this rank, or of all for all-gather) of a row
    row_probs: torch.Tensor  # [rows] its gate weight
    num_tokens: int          # T on this rank
    # all-to-all: rows sent to / received from each rank, and the sort into local-expert order
    send_splits: Optional[List[int]] = None
    recv_splits: Optional[List[int]] = None
    expert_order: Optional[torch.Tensor] = None
    # all-gather: every EP rank's T
    rank_sizes: Optional[List[int]] = None


class _EPDispatcher:
    def __init__(self, num_experts: int, group=None):
        self.group = group if group is not None else \
            parallel_state.get_expert_model_parallel_group()
        self.ep_size = dist.get_world_size(self.group)
        self.ep_rank = dist.get_rank(self.group)
        if num_experts % self.ep_size != 0:
            raise ValueError(f"num_moe_experts ({num_experts}) must be divisible by "
                             f"expert-model-parallel-size ({self.ep_size}): each EP rank "
                             f"holds the same number of experts.")
        self.num_experts = num_experts
        self.num_local = num_experts // self.ep_size
        self.first_local = self.ep_rank * self.num_local

    @staticmethod
    def _flat(indices: torch.Tensor, probs: torch.Tensor):
        """(expert, token, prob) of every routing choice, token-major."""
        tokens, topk = indices.shape
        flat_token = torch.arange(tokens, device=indices.device).repeat_interleave(topk)
        return indices.reshape(-1), flat_token, probs.reshape(-1)


class AllToAllDispatcher(_EPDispatcher):
    """Megatron's alltoall dispatcher: each rank sends every routing choice to the rank of its
    expert (counts first, so the receivers know the split sizes), and the answers come back
    the same way."""

    def permute(self, hidden, indices, probs):
        flat_expert, flat_token, flat_probs = self._flat(indices, probs)
        # Sorting by global expert also groups the rows by destination rank.
        order = torch.argsort(flat_expert, stable=True)
        counts = torch.bincount(flat_expert, minlength=self.num_experts)
        per_rank = [self.num_local] * self.ep_size
        # received[r, l]: rows rank r sends to my local expert l
        received = _all_to_all(counts, per_rank, per_rank, self.group).view(self.ep_size, -1)
        send_splits = counts.view(self.ep_size, -1).sum(1).tolist()
        recv_splits = received.sum(1).tolist()
        row_token = flat_token[order]
        arrived = _AllToAll.apply(hidden.index_select(0, row_token), recv_splits, send_splits,
                                  self.group)
        # Rows arrive by source rank, each source's by local expert: regroup by local expert.
        local_ids = torch.arange(self.num_local, device=hidden.device).repeat(self.ep_size)
        arrived_expert = torch.repeat_interleave(local_ids, received.reshape(-1))
        expert_order = torch.argsort(arrived_expert, stable=True)
        state = EPState(row_token, flat_probs[order], hidden.shape[0], send_splits,
                        recv_splits, expert_order)
        return arrived.index_select(0, expert_order), received.sum(0), state

    def unpermute(self, expert_output, state: EPState):
        back_to_arrival = torch.empty_like(state.expert_order)
        back_to_arrival[state.expert_order] = torch.arange(
            state.expert_order.numel(), device=state.expert_order.device)
        rows = _AllToAll.apply(expert_output.index_select(0, back_to_arrival),
                               state.send_splits, state.recv_splits, self.group)
        weighted = rows * state.row_probs.to(rows.dtype).unsqueeze(-1)
        out = rows.new_zeros(state.num_tokens, rows.shape[1])
        return out.index_add(0, state.row_token, weighted)


class AllGatherDispatcher(_EPDispatcher):
    """Megatron's allgather dispatcher: every rank gathers all EP ranks' tokens, probs and
    choices, keeps the choices of its experts, and unpermute reduce-scatters (sums) the
    partial outputs back to the tokens' ranks. Simple, and more traffic than all-to-all."""

    def permute(self, hidden, indices, probs):
        mine = torch.tensor([hidden.shape[0]], device=hidden.device)
        sizes_t = mine.new_empty(self.ep_size)
        collectives.all_gather_into_tensor(sizes_t, mine, group=self.group)
        sizes = sizes_t.tolist()
        every_hidden = _GatherRows.apply(hidden, sizes, self.ep_rank, self.group)
        every_probs = _GatherRows.apply(probs, sizes, self.ep_rank, self.group)
        every_indices = _gather_rows(indices, sizes, self.group)
        flat_expert, flat_token, flat_probs = self._flat(every_indices, every_probs)
        local = flat_expert - self.first_local
        is_mine = (local >= 0) & (local < self.num_local)
        # Other ranks' choices sort after every local expert (key num_local) and are cut off.
        key = torch.where(is_mine, local, self.num_local)
        order = torch.argsort(key, stable=True)[:int(is_mine.sum())]
        tokens_per_local_expert = torch.bincount(local[order], minlength=self.num_local)
        row_token = flat_token[order]
        state = EPState(row_token, flat_probs[order], hidden.shape[0], rank_sizes=sizes)
        return every_hidden.index_select(0, row_token), tokens_per_local_expert, state

    def unpermute(self, expert_output, state: EPState):
        weighted = expert_output * state.row_probs.to(expert_output.dtype).unsqueeze(-1)
        partial = expert_output.new_zeros(sum(state.rank_sizes), expert_output.shape[1])
        partial = partial.index_add(0, state.row_token, weighted)
        return _ReduceScatterRows.apply(partial, state.rank_sizes, self.ep_rank, self.group)


DISPATCHERS = {"alltoall": AllToAllDispatcher, "allgather": AllGatherDispatcher}
