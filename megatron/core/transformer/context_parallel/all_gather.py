"""All-gather context-parallel attention.

K/V (only the hkv key/value heads) are gathered once over the CP group and put in global
order; each local query chunk (global chunk m) attends to the keys before its chunk (one
fully visible block) and to its own chunk (one causal block), merged by log-sum-exp. Backward
sums dK/dV over the gathered sequence and reduce-scatters them back to their owners.

Under a sliding window (and for masked blocks on one rank) each chunk's queries go in blocks of
WINDOW_QUERY_BLOCK rows against only the keys their window reaches: memory O(s (block + W)),
never s x s.

Simpler than the ring and one collective each way, but it holds the whole sequence's K/V:
saved for backward per rank are local q and out, the gathered K and V and lse, i.e.
2*b*hq*s_local*d * itemsize + 2*b*hkv*s_global*d * itemsize + b*hq*s_local * 4 bytes
(the ring saves local K/V instead of the gathered ones).
"""
import functools

import torch

from megatron.core import collectives
from megatron.core.transformer.context_parallel.blocks import (
    BlockSettings,
    CPLayout,
    add_sinks_,
    block_backward,
    block_forward,
    merge_partial_,
    sinks_grad,
)

WINDOW_QUERY_BLOCK = 256


def _chunk_sources(cp_size: int) -> torch.Tensor:
    """For each global chunk m, its index in the gathered [rank, half] order (host tensor)."""
    return torch.tensor([2 * m if m < cp_size else 2 * (2 * cp_size - 1 - m) + 1
                         for m in range(2 * cp_size)])


@functools.lru_cache(maxsize=None)
def _chunk_sources_on(cp_size: int, device: torch.device) -> torch.Tensor:
    """_chunk_sources on ``device``, built and copied once per (CP size, device): it depends on
    neither the sequence length nor the layer (a copy from pageable host memory per layer,
    forward and backward, is a stall on CUDA)."""
    return _chunk_sources(cp_size).to(device)


def _to_global_order(gathered: torch.Tensor, cp_size: int) -> torch.Tensor:
    """[cp, 2(kv), b, h, s_local, d] in rank order -> [2, b, h, s_global, d] in global order."""
    c, two, b, h, s, d = gathered.shape
    chunks = gathered.view(c, two, b, h, 2, s // 2, d).permute(0, 4, 1, 2, 3, 5, 6)
    chunks = chunks.reshape(2 * c, two, b, h, s // 2, d)
    chunks = chunks[_chunk_sources_on(cp_size, gathered.device)]
    return chunks.permute(1, 2, 3, 0, 4, 5).reshape(two, b, h, c * s, d)


def _to_rank_order(full: torch.Tensor, cp_size: int) -> torch.Tensor:
    """Inverse of _to_global_order: [2, b, h, s_global, d] -> [cp, 2, b, h, s_local, d]."""
    two, b, h, s_global, d = full.shape
    c, chunk = cp_size, s_global // (2 * cp_size)
    chunks = full.view(two, b, h, 2 * c, chunk, d).permute(3, 0, 1, 2, 4, 5)
    in_rank_order = torch.empty_like(chunks)
    in_rank_order[_chunk_sources_on(cp_size, full.device)] = chunks
    in_rank_order = in_rank_order.view(c, 2, two, b, h, chunk, d).permute(0, 2, 3, 4, 1, 5, 6)
    return in_rank_order.reshape(c, two, b, h, 2 * chunk, d)


def _blocks(layout: CPLayout, s_local: int, st: BlockSettings):
    """(query rows, key range in global order, causal) for both local query chunks."""
    chunk = s_local if layout.size == 1 else s_local // 2
    starts = (layout.rank,) if layout.size == 1 else \
        (layout.rank, 2 * layout.size - 1 - layout.rank)
    plan = []
    for half, m in enumerate(starts):
        if st.window is not None or (layout.size == 1 and st.masked):
            plan += _query_blocks(half * chunk, m * chunk, chunk, st.window)
            continue
        rows = slice(half * chunk, (half + 1) * chunk)
        if m > 0:
            plan.append((rows, slice(0, m * chunk), False))
        plan.append((rows, slice(m * chunk, (m + 1) * chunk), True))
    return plan


def _query_blocks(first_row: int, first_position: int, rows: int, window):
    """Blocks of WINDOW_QUERY_BLOCK queries of one chunk (rows from ``first_row``, global
    positions from ``first_position``), each against the keys from its window's start (or the
    sequence's) to its last query; the mask (positions) does the rest."""
    plan = []
    for start in range(0, rows, WINDOW_QUERY_BLOCK):
        stop = min(start + WINDOW_QUERY_BLOCK, rows)
        first, last = first_position + start, first_position + stop
        lo = 0 if window is None else max(0, first - window)
        plan.append((slice(first_row + start, first_row + stop), slice(lo, last), True))
    return plan


def _gather_kv(k, v, layout: CPLayout) -> torch.Tensor:
    kv = torch.stack([k, v])
    if layout.size == 1:
        return kv
    gathered = torch.empty((layout.size,) + kv.shape, dtype=kv.dtype, device=kv.device)
    collectives.all_gather_into_tensor(gathered.view(-1), kv.view(-1), group=layout.group)
    return _to_global_order(gathered, layout.size)


def all_gather_forward(q, k, v, layout: CPLayout, st: BlockSettings, sinks=None):
    """-> (out in q's dtype, lse fp32, gathered kv [2, b, hkv, s_global, d]); ``sinks`` [hq]
    (or None): one more logit per head in the softmax (add_sinks_)."""
    kv = _gather_kv(k, v, layout)
    key_pos = torch.arange(kv.shape[3], device=q.device)
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    lse = torch.full(q.shape[:3], float("-inf"), dtype=torch.float32, device=q.device)
    q_pos = layout.positions[layout.rank]
    for rows, cols, causal in _blocks(layout, q.shape[2], st):
        part_out, part_lse = block_forward(q[:, :, rows], kv[0][:, :, cols], kv[1][:, :, cols],
                                           q_pos[rows], key_pos[cols], causal, st)
        merge_partial_(out[:, :, rows], lse[:, :, rows], part_out, part_lse)
        del part_out, part_lse  # before the next block allocates its own
    if sinks is not None:
        add_sinks_(out, lse, sinks)
    return out.to(q.dtype), lse, kv


def all_gather_backward(dout, q, kv, out, lse, layout: CPLayout, st: BlockSettings):
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    dkv = torch.zeros(kv.shape, dtype=torch.float32, device=q.device)
    key_pos = torch.arange(kv.shape[3], device=q.device)
    q_pos = layout.positions[layout.rank]
    for rows, cols, causal in _blocks(layout, q.shape[2], st):
        dq_part, dk_part, dv_part = block_backward(
            dout[:, :, rows], q[:, :, rows], kv[0][:, :, cols], kv[1][:, :, cols],
            out[:, :, rows], lse[:, :, rows], q_pos[rows], key_pos[cols], causal, st)
        dq[:, :, rows] += dq_part
        dkv[0][:, :, cols] += dk_part
        dkv[1][:, :, cols] += dv_part
        del dq_part, dk_part, dv_part  # before the next block allocates its own
    if layout.size > 1:
        per_rank = _to_rank_order(dkv, layout.size).contiguous()
        mine = torch.empty(per_rank.shape[1:], dtype=dkv.dtype, device=dkv.device)
        collectives.reduce_scatter_tensor(mine.view(-1), per_rank.view(-1), group=layout.group)
        dkv = mine
    return dq.to(q.dtype), dkv[0].to(kv.dtype), dkv[1].to(kv.dtype)


class AllGatherAttention(torch.autograd.Function):
    """Autograd wrapper: saves q, the gathered K/V, out and lse (and the sinks, [hq])."""

    @staticmethod
    def forward(ctx, q, k, v, sinks, layout: CPLayout, st: BlockSettings):
        out, lse, kv = all_gather_forward(q, k, v, layout, st, sinks)
        ctx.save_for_backward(q, kv, out, lse, sinks)
        ctx.layout, ctx.settings = layout, st
        return out

    @staticmethod
    def backward(ctx, dout):
        q, kv, out, lse, sinks = ctx.saved_tensors
        dq, dk, dv = all_gather_backward(dout, q, kv, out, lse, ctx.layout, ctx.settings)
        dsinks = None if sinks is None else sinks_grad(dout, out, lse, sinks)
        return dq, dk, dv, dsinks, None, None
