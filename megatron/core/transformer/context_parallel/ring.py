"""Ring (p2p) context-parallel attention.

Each CP rank holds chunks r and 2*CP-1-r of the sequence. K/V blocks (only the hkv key/value
heads) pass around the ring: at step i a rank holds the block of rank (r - i) mod CP, and the
send/recv of the next block is posted before this block's attention is computed (overlap).
With the head-tail layout every step is half a block of work:
  step 0, own block:        all local queries x all local keys, causal;
  block of rank j < r:      all local queries x its first chunk (all earlier), no mask;
  block of rank j > r:      the second local query chunk x its whole block, no mask.
Partial outputs are merged by log-sum-exp. Under a sliding window a block wholly outside it
is not computed (its K/V still pass on). Backward walks the ring again: dQ accumulates
locally; each block's dK/dV buffer travels one hop behind its K/V and, after CP hops, is back
at its owner. Saved for backward: local q, k, v, out and lse only (no gathered K/V, no
s x s tensor), i.e. per rank (2*b*hq*s*d + 2*b*hkv*s*d) * itemsize + b*hq*s * 4 bytes.
"""
import torch
import torch.distributed as dist
from torch.distributed import batch_isend_irecv

from megatron.core.transformer.context_parallel.blocks import (
    BlockSettings,
    CPLayout,
    add_sinks_,
    block_backward,
    block_forward,
    merge_partial_,
    sinks_grad,
)

_KV_TAG, _DKV_TAG = 17, 18  # two streams between the same peers; tags keep them apart (gloo)


def _exchange(send: torch.Tensor, recv: torch.Tensor, layout: CPLayout, tag: int):
    """Post: send ``send`` to the next rank, receive ``recv`` from the previous one."""
    ops = [dist.P2POp(dist.isend, send, layout.next_peer, layout.group, tag),
           dist.P2POp(dist.irecv, recv, layout.prev_peer, layout.group, tag)]
    return batch_isend_irecv(ops)


def _wait(works) -> None:
    for work in works:
        work.wait()


def block_plan(rank: int, src: int, s_local: int):
    """(query rows, key rows, causal) of this rank's queries against the block of ``src``."""
    half = s_local // 2
    if src == rank:
        return slice(0, s_local), slice(0, s_local), True
    if src < rank:  # its first chunk precedes all our positions, its second follows them
        return slice(0, s_local), slice(0, half), False
    return slice(half, s_local), slice(0, s_local), False  # only our tail chunk follows it


def _outside_window(layout: CPLayout, st: BlockSettings, src: int, rows: slice, cols: slice,
                    s_local: int) -> bool:
    return st.block_is_empty(layout.position(layout.rank, rows.start, s_local),
                             layout.position(src, cols.stop - 1, s_local))


def ring_forward(q, k, v, layout: CPLayout, st: BlockSettings, sinks=None):
    """-> (out [b, hq, s, d] in q's dtype, lse fp32 [b, hq, s]); ``sinks`` [hq] (or None):
    one more logit per head in the softmax (add_sinks_)."""
    s_local = q.shape[2]
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    lse = torch.full(q.shape[:3], float("-inf"), dtype=torch.float32, device=q.device)
    kv = torch.stack([k, v])  # one message per hop
    for step in range(layout.size):
        src = (layout.rank - step) % layout.size
        pending, incoming = None, None
        if step < layout.size - 1:
            incoming = torch.empty_like(kv)
            pending = _exchange(kv, incoming, layout, _KV_TAG)
        rows, cols, causal = block_plan(layout.rank, src, s_local)
        if not _outside_window(layout, st, src, rows, cols, s_local):
            part_out, part_lse = block_forward(
                q[:, :, rows], kv[0][:, :, cols], kv[1][:, :, cols],
                layout.positions[layout.rank][rows], layout.positions[src][cols], causal, st)
            merge_partial_(out[:, :, rows], lse[:, :, rows], part_out, part_lse)
            del part_out, part_lse  # before the next block allocates its own
        if pending is not None:
            _wait(pending)
            kv = incoming
    if sinks is not None:
        add_sinks_(out, lse, sinks)
    return out.to(q.dtype), lse


def ring_backward(dout, q, k, v, out, lse, layout: CPLayout, st: BlockSettings):
    """-> (dq, dk, dv) of this rank's q, k, v."""
    s_local = q.shape[2]
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    kv = torch.stack([k, v])
    dkv_pending, dkv_incoming = None, None
    for step in range(layout.size):
        src = (layout.rank - step) % layout.size
        kv_pending, kv_incoming = None, None
        if step < layout.size - 1:
            kv_incoming = torch.empty_like(kv)
            kv_pending = _exchange(kv, kv_incoming, layout, _KV_TAG)
        rows, cols, causal = block_plan(layout.rank, src, s_local)
        parts = None
        if not _outside_window(layout, st, src, rows, cols, s_local):
            parts = block_backward(
                dout[:, :, rows], q[:, :, rows], kv[0][:, :, cols], kv[1][:, :, cols],
                out[:, :, rows], lse[:, :, rows],
                layout.positions[layout.rank][rows], layout.positions[src][cols], causal, st)
            dq[:, :, rows] += parts[0]
        if dkv_pending is None:  # step 0: start the buffer of our own block
            dkv = torch.zeros(kv.shape, dtype=torch.float32, device=kv.device)
        else:  # the buffer of block src, filled by the ranks it visited before us
            _wait(dkv_pending)
            dkv = dkv_incoming
        if parts is not None:
            dkv[0][:, :, cols] += parts[1]
            dkv[1][:, :, cols] += parts[2]
        del parts  # before the next block allocates its own
        if layout.size > 1:  # one hop on; after the last step it reaches its owner
            dkv_incoming = torch.empty_like(dkv)
            dkv_pending = _exchange(dkv, dkv_incoming, layout, _DKV_TAG)
        if kv_pending is not None:
            _wait(kv_pending)
            kv = kv_incoming
    if dkv_pending is not None:
        _wait(dkv_pending)
        dkv = dkv_incoming
    return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype)


class RingAttention(torch.autograd.Function):
    """Autograd wrapper: saves only q, k, v, out, lse (and the sinks, [hq])."""

    @staticmethod
    def forward(ctx, q, k, v, sinks, layout: CPLayout, st: BlockSettings):
        out, lse = ring_forward(q, k, v, layout, st, sinks)
        ctx.save_for_backward(q, k, v, out, lse, sinks)
        ctx.layout, ctx.settings = layout, st
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, sinks = ctx.saved_tensors
        dq, dk, dv = ring_backward(dout, q, k, v, out, lse, ctx.layout, ctx.settings)
        dsinks = None if sinks is None else sinks_grad(dout, out, lse, sinks)
        return dq, dk, dv, dsinks, None, None
