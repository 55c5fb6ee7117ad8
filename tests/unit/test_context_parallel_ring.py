"""How the ring runs: communication posted before compute (overlap), and what autograd saves."""
import pytest
import torch
import torch.distributed as dist

from megatron.core.transformer.context_parallel import context_parallel_attention
from megatron.core.transformer.context_parallel import ring as cp_ring
from tests.distributed import run_distributed

B, HQ, HKV, S_LOCAL, D = 2, 6, 2, 8, 8
KV, DKV = cp_ring._KV_TAG, cp_ring._DKV_TAG


class _RecordedWork:
    def __init__(self, works, tag, events):
        self.works, self.tag, self.events = works, tag, events

    def wait(self):
        self.events.append(("wait", self.tag))
        for work in self.works:
            work.wait()


def _rank_event_order():
    events = []
    originals = (cp_ring.batch_isend_irecv, cp_ring.block_forward, cp_ring.block_backward)
    post, forward, backward = originals

    def recording_post(ops):
        events.append(("post", ops[0].tag))
        return [_RecordedWork(post(ops), ops[0].tag, events)]

    def recording_forward(*args):
        events.append(("forward", None))
        return forward(*args)

    def recording_backward(*args):
        events.append(("backward", None))
        return backward(*args)

    cp_ring.batch_isend_irecv = recording_post
    cp_ring.block_forward, cp_ring.block_backward = recording_forward, recording_backward
    try:
        q = torch.randn(B, HQ, S_LOCAL, D, requires_grad=True)
        kv = torch.randn(2, B, HKV, S_LOCAL, D, requires_grad=True)
        out = context_parallel_attention(q, kv[0], kv[1], group=dist.group.WORLD)
        out.sum().backward()
    finally:
        cp_ring.batch_isend_irecv, cp_ring.block_forward, cp_ring.block_backward = originals
    return events


def expected_events(cp):
    forward = []
    for step in range(cp):
        last = step == cp - 1
        forward += ([] if last else [("post", KV)]) + [("forward", None)]
        forward += [] if last else [("wait", KV)]
    backward = []
    for step in range(cp):
        last = step == cp - 1
        backward += ([] if last else [("post", KV)]) + [("backward", None)]
        backward += ([] if step == 0 else [("wait", DKV)]) + [("post", DKV)]
        backward += [] if last else [("wait", KV)]
    return forward + backward + [("wait", DKV)]


@pytest.mark.parametrize("cp", [2, 4])
def test_ring_posts_next_block_before_computing_this_one(cp):
    """Step i+1's K/V send/recv is posted before step i's block is computed and waited after
    it; in backward each dK/dV buffer moves on after its block and is back home at the end."""
    for events in run_distributed(_rank_event_order, world_size=cp):
        assert events == expected_events(cp)


def _rank_saved_tensors(comm_type):
    saved = []

    def pack(tensor):
        saved.append((tuple(tensor.shape), tensor.numel() * tensor.element_size()))
        return tensor

    q = torch.randn(B, HQ, S_LOCAL, D, requires_grad=True)
    k = torch.randn(B, HKV, S_LOCAL, D, requires_grad=True)
    v = torch.randn(B, HKV, S_LOCAL, D, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        out = context_parallel_attention(q, k, v, group=dist.group.WORLD, comm_type=comm_type)
    out.sum().backward()  # the saved tensors suffice for backward
    return saved


@pytest.mark.parametrize("cp", [2, 4])
def test_ring_saves_only_local_q_k_v_out_lse(cp):
    q_bytes = B * HQ * S_LOCAL * D * 4  # fp32; out has the same size
    kv_bytes = B * HKV * S_LOCAL * D * 4
    lse_bytes = B * HQ * S_LOCAL * 4
    for saved in run_distributed(_rank_saved_tensors, world_size=cp, comm_type="p2p"):
        shapes = [shape for shape, _ in saved]
        assert sum(nbytes for _, nbytes in saved) == 2 * q_bytes + 2 * kv_bytes + lse_bytes
        assert len(saved) == 5, shapes  # q, k, v, out, lse
        # no dim spans the global sequence: no gathered K/V and no s_global x s_global scores
        assert all(S_LOCAL * cp not in shape for shape in shapes), shapes


def test_all_gather_saves_the_gathered_kv():
    """all_gather trades memory for simplicity: it keeps the whole sequence's K/V."""
    cp = 2
    expected = (2 * B * HQ * S_LOCAL * D + 2 * B * HKV * S_LOCAL * cp * D + B * HQ * S_LOCAL) * 4
    for saved in run_distributed(_rank_saved_tensors, world_size=cp, comm_type="all_gather"):
        assert sum(nbytes for _, nbytes in saved) == expected
