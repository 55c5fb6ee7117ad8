"""Context-parallel attention (ring p2p and all-gather) against the unsharded computation.

Every rank builds the same full q/k/v/grad-out (fixed seed), shards them with shard_sequence,
runs context_parallel_attention over the WORLD group and returns its local output and grads;
the test unshards them and compares with attention on the full tensors.

Tolerance: fp32, ATOL = RTOL = 2e-5. The CP result sums the same terms in another order
(per-block softmax merged by log-sum-exp, grads summed over blocks and ranks), so it differs
from the reference by rounding only; measured max abs error is ~1e-6 (printed with -s).
"""
import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron.core.transformer import context_parallel as cp_module
from megatron.core.transformer.context_parallel import (
    attention_dropout_keep,
    context_parallel_attention,
    shard_sequence,
    unshard_sequence,
)
from tests.distributed import run_distributed

ATOL = RTOL = 2e-5
BATCH, HEAD_DIM = 2, 8
HEADS = {"mha": (4, 4), "gqa": (6, 2), "odd": (3, 1)}


def full_inputs(hq, hkv, s, with_docs, seed=7):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(BATCH, hq, s, HEAD_DIM, generator=gen)
    k = torch.randn(BATCH, hkv, s, HEAD_DIM, generator=gen)
    v = torch.randn(BATCH, hkv, s, HEAD_DIM, generator=gen)
    dout = torch.randn(BATCH, hq, s, HEAD_DIM, generator=gen)
    docs = None
    if with_docs:  # random document starts (~1 in 6 positions), different per sample
        starts = torch.rand(BATCH, s, generator=gen) < 0.17
        docs = starts.long().cumsum(1)
    return q, k, v, dout, docs


def reference_attention(q, k, v, dropout_p=0.0, seed=None, docs=None, head_offset=0):
    """Unsharded attention: SDPA when it can, else the plain s x s formula (fine in a test)."""
    hq, hkv, s = q.shape[1], k.shape[1], q.shape[2]
    if dropout_p == 0 and docs is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=hq != hkv)
    k, v = k.repeat_interleave(hq // hkv, 1), v.repeat_interleave(hq // hkv, 1)
    pos = torch.arange(s)
    mask = (pos[None, :] <= pos[:, None])[None, None]
    if docs is not None:
        mask = mask & (docs[:, :, None] == docs[:, None, :])[:, None]
    scores = (q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])).masked_fill(~mask, -math.inf)
    probs = scores.softmax(-1)
    if dropout_p > 0:
        keep = attention_dropout_keep(seed, torch.arange(q.shape[0])[:, None, None, None],
                                      torch.arange(hq)[None, :, None, None] + head_offset,
                                      pos[None, None, :, None], pos[None, None, None, :],
                                      dropout_p)
        probs = probs * keep / (1 - dropout_p)
    return probs @ v


def _rank_attention(comm_type, hq, hkv, s, dropout_p, seed, with_docs, force_reference):
    rank, size = dist.get_rank(), dist.get_world_size()
    q, k, v, dout, docs = full_inputs(hq, hkv, s, with_docs)
    local = [shard_sequence(t, 2, size, rank).requires_grad_() for t in (q, k, v)]
    original = cp_module.choose_block_kernel
    if force_reference:  # the plain-torch block kernel, which CPU otherwise uses for dropout
        cp_module.choose_block_kernel = lambda *args: "reference"
    try:
        out = context_parallel_attention(*local, group=dist.group.WORLD, comm_type=comm_type,
                                         dropout_p=dropout_p, dropout_seed=seed,
                                         document_ids=docs)
    finally:
        cp_module.choose_block_kernel = original
    out.backward(shard_sequence(dout, 2, size, rank))
    return out.detach(), [t.grad for t in local]


def check_against_reference(cp, comm_type, heads, dropout_p=0.0, with_docs=False,
                            force_reference=False, s=32):
    hq, hkv = HEADS[heads]
    seed = 1234 if dropout_p > 0 else None
    results = run_distributed(_rank_attention, world_size=cp, comm_type=comm_type, hq=hq,
                              hkv=hkv, s=s, dropout_p=dropout_p, seed=seed,
                              with_docs=with_docs, force_reference=force_reference)
    got_out = unshard_sequence([r[0] for r in results], 2)
    got_grads = [unshard_sequence([r[1][i] for r in results], 2) for i in range(3)]
    q, k, v, dout, docs = full_inputs(hq, hkv, s, with_docs)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    ref = reference_attention(q, k, v, dropout_p, seed, docs)
    if with_docs:  # the documents must matter, or ignoring them would pass
        assert (ref - reference_attention(q, k, v, dropout_p, seed)).abs().max() > 0.1
    ref_grads = torch.autograd.grad(ref, (q, k, v), dout)
    errors = {"out": (got_out - ref).abs().max().item()}
    for name, got, want in zip("qkv", got_grads, ref_grads):
        errors["d" + name] = (got - want).abs().max().item()
    print(f"cp={cp} {comm_type} {heads} p={dropout_p} docs={with_docs} max abs err {errors}")
    torch.testing.assert_close(got_out, ref.detach(), atol=ATOL, rtol=RTOL)
    for got, want in zip(got_grads, ref_grads):
        torch.testing.assert_close(got, want, atol=ATOL, rtol=RTOL)
    return errors


@pytest.mark.parametrize("dropout_p", [0.0, 0.3])
@pytest.mark.parametrize("heads", sorted(HEADS))
@pytest.mark.parametrize("comm_type", ["p2p", "all_gather"])
@pytest.mark.parametrize("cp", [2, 4])
def test_matches_unsharded_attention(cp, comm_type, heads, dropout_p):
    check_against_reference(cp, comm_type, heads, dropout_p)


@pytest.mark.parametrize("dropout_p", [0.0, 0.3])
@pytest.mark.parametrize("comm_type", ["p2p", "all_gather"])
@pytest.mark.parametrize("cp", [2, 4])
def test_packed_documents_match_unsharded(cp, comm_type, dropout_p):
    check_against_reference(cp, comm_type, "gqa", dropout_p, with_docs=True, s=48)


@pytest.mark.parametrize("comm_type", ["p2p", "all_gather"])
def test_reference_block_kernel_matches(comm_type):
    """The plain-torch block kernel without dropout (CPU picks torch's flash op there)."""
    check_against_reference(4, comm_type, "odd", 0.0, with_docs=True)
    check_against_reference(2, comm_type, "mha", 0.0)


def test_cp1_is_plain_causal_attention():
    q, k, v, dout, _ = full_inputs(5, 5, 15, False)  # odd heads and odd length: no chunks
    for comm_type in ("p2p", "all_gather"):
        args = [t.clone().requires_grad_() for t in (q, k, v)]
        out = context_parallel_attention(*args, group=None, comm_type=comm_type)
        ref_args = [t.clone().requires_grad_() for t in (q, k, v)]
        ref = F.scaled_dot_product_attention(*ref_args, is_causal=True)
        torch.testing.assert_close(out, ref, atol=ATOL, rtol=RTOL)
        grads = torch.autograd.grad(out, args, dout)
        for got, want in zip(grads, torch.autograd.grad(ref, ref_args, dout)):
            torch.testing.assert_close(got, want, atol=ATOL, rtol=RTOL)


def test_dropout_drops_and_head_offset_is_the_global_head():
    q, k, v, _, _ = full_inputs(4, 2, 32, False)
    kwargs = dict(group=None, dropout_p=0.3, dropout_seed=99)
    full = context_parallel_attention(q, k, v, **kwargs)
    assert (full - context_parallel_attention(q, k, v, group=None)).abs().max() > 0.1
    # TP shards heads: heads 2..3 with head_offset 2 (their kv head 1) reproduce the full call
    tail = context_parallel_attention(q[:, 2:], k[:, 1:], v[:, 1:], head_offset=2, **kwargs)
    torch.testing.assert_close(tail, full[:, 2:], atol=ATOL, rtol=RTOL)
    keep = attention_dropout_keep(99, torch.arange(4)[:, None, None, None],
                                  torch.arange(8)[:, None, None], torch.arange(64)[:, None],
                                  torch.arange(64), 0.3)
    # 131072 draws: the keep rate is 0.7 within 5 standard deviations (0.0063)
    assert abs(keep.float().mean().item() - 0.7) < 0.0063
    other_seed = attention_dropout_keep(100, 0, 0, torch.arange(64)[:, None], torch.arange(64),
                                        0.3)
    assert not torch.equal(other_seed, keep[0, 0])


def test_bad_inputs_raise_clear_errors():
    q, k, v, _, _ = full_inputs(4, 4, 8, False)
    with pytest.raises(ValueError, match="unknown context-parallel comm_type 'ring'"):
        context_parallel_attention(q, k, v, group=None, comm_type="ring")
    with pytest.raises(ValueError, match="query heads 4 are not a multiple of key/value heads 3"):
        context_parallel_attention(q, k[:, :3], v[:, :3], group=None)
    with pytest.raises(ValueError, match="needs dropout_seed"):
        context_parallel_attention(q, k, v, group=None, dropout_p=0.1)


def _rank_odd_length():
    q = torch.randn(1, 2, 3, 8)  # 3 local x 2 ranks = 6, not a multiple of 2*CP = 4
    try:
        context_parallel_attention(q, q, q, group=dist.group.WORLD)
    except ValueError as error:
        return str(error)
    return None


def test_sequence_not_divisible_by_2cp_raises():
    messages = run_distributed(_rank_odd_length, world_size=2)
    assert all(m is not None and "sequence length 6" in m and "2*CP = 4" in m
               for m in messages), messages
