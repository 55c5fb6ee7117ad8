"""Attention sinks (gpt-oss: one learned logit per head in the softmax's denominator) and
sliding windows under context parallelism, against a plain-torch reference that builds the
whole [s, s] mask and appends the sink as an extra column, as Hugging Face's eager gpt-oss
attention does (outputs, and gradients of Q, K, V and the sinks).

On one rank (group None) the blocked path runs: query blocks against only the keys their
window reaches; at CP = 2 and 4 the ring (blocks wholly outside the window are skipped) and
the all-gather path. With packed documents, GQA, windows shorter than a CP chunk and longer
than the sequence, and attention dropout (the reference block kernel's hash mask).

Tolerance 2e-5 (fp32): the blocks merge partial softmaxes by log-sum-exp where the reference
takes one softmax; the rounding differs, nothing else (a wrong mask or sink is off by > 0.01).
"""
import math

import pytest
import torch
import torch.distributed as dist

from megatron.core.transformer.context_parallel import (
    attention_dropout_keep,
    context_parallel_attention,
    shard_sequence,
    unshard_sequence,
)
from tests.distributed import run_distributed

ATOL = RTOL = 2e-5
BATCH, HQ, HKV, HEAD_DIM = 2, 4, 2, 8


def _inputs(s, with_docs, seed=3):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(BATCH, HQ, s, HEAD_DIM, generator=gen)
    k = torch.randn(BATCH, HKV, s, HEAD_DIM, generator=gen)
    v = torch.randn(BATCH, HKV, s, HEAD_DIM, generator=gen)
    dout = torch.randn(BATCH, HQ, s, HEAD_DIM, generator=gen)
    sinks = torch.randn(HQ, generator=gen)
    docs = (torch.rand(BATCH, s, generator=gen) < 0.1).long().cumsum(1) if with_docs else None
    return q, k, v, dout, sinks, docs


def _reference(q, k, v, sinks=None, window=None, docs=None, dropout_p=0.0, seed=None):
    """Whole-mask attention; the sink is a last column of the scores, dropped after the
    softmax (HF's eager_attention_forward for gpt-oss)."""
    s = q.shape[2]
    k, v = (t.repeat_interleave(HQ // HKV, 1) for t in (k, v))
    pos = torch.arange(s)
    mask = (pos[None, :] <= pos[:, None])
    if window is not None:
        mask = mask & (pos[:, None] - pos[None, :] <= window)
    mask = mask[None, None]
    if docs is not None:
        mask = mask & (docs[:, :, None] == docs[:, None, :])[:, None]
    scores = (q @ k.transpose(-1, -2) / math.sqrt(HEAD_DIM)).masked_fill(~mask, -math.inf)
    if sinks is not None:
        column = sinks.reshape(1, -1, 1, 1).expand(q.shape[0], -1, s, 1)
        scores = torch.cat([scores, column], dim=-1)
    probs = scores.softmax(-1)
    if sinks is not None:
        probs = probs[..., :-1]
    if dropout_p > 0:
        keep = attention_dropout_keep(seed, torch.arange(q.shape[0])[:, None, None, None],
                                      torch.arange(HQ)[None, :, None, None],
                                      pos[None, None, :, None], pos[None, None, None, :],
                                      dropout_p)
        probs = probs * keep / (1 - dropout_p)
    return probs @ v


def _rank_run(comm_type, s, window, with_sinks, with_docs, dropout_p):
    rank, size = dist.get_rank(), dist.get_world_size()
    q, k, v, dout, sinks, docs = _inputs(s, with_docs)
    local = [shard_sequence(t, 2, size, rank).requires_grad_() for t in (q, k, v)]
    sinks = sinks.requires_grad_() if with_sinks else None
    out = context_parallel_attention(*local, group=dist.group.WORLD, comm_type=comm_type,
                                     document_ids=docs, window=window, sinks=sinks,
                                     dropout_p=dropout_p,
                                     dropout_seed=77 if dropout_p else None)
    out.backward(shard_sequence(dout, 2, size, rank))
    return out.detach(), [t.grad for t in local], None if sinks is None else sinks.grad


def _check(cp, comm_type, s, window, with_sinks, with_docs, dropout_p=0.0):
    kwargs = dict(comm_type=comm_type, s=s, window=window, with_sinks=with_sinks,
                  with_docs=with_docs, dropout_p=dropout_p)
    if cp == 1:
        results = [_single_rank(**kwargs)]
    else:
        results = run_distributed(_rank_run, world_size=cp, **kwargs)
    got = unshard_sequence([r[0] for r in results], 2)
    got_grads = [unshard_sequence([r[1][i] for r in results], 2) for i in range(3)]
    q, k, v, dout, sinks, docs = _inputs(s, with_docs)
    leaves = [t.requires_grad_() for t in (q, k, v)]
    if with_sinks:
        leaves.append(sinks.requires_grad_())
    ref = _reference(q, k, v, sinks if with_sinks else None, window, docs, dropout_p,
                     77 if dropout_p else None)
    want_grads = torch.autograd.grad(ref, leaves, dout)
    torch.testing.assert_close(got, ref.detach(), atol=ATOL, rtol=RTOL)
    for name, got_grad, want in zip("qkv", got_grads, want_grads):
        torch.testing.assert_close(got_grad, want, atol=ATOL, rtol=RTOL, msg=f"d{name}")
    if with_sinks:  # every CP rank's share of the sinks' gradient sums to the whole
        got_sinks = sum(r[2] for r in results)
        torch.testing.assert_close(got_sinks, want_grads[3], atol=ATOL, rtol=RTOL)
    return ref.detach()


def _single_rank(comm_type, s, window, with_sinks, with_docs, dropout_p):
    q, k, v, dout, sinks, docs = _inputs(s, with_docs)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    sinks = sinks.clone().requires_grad_() if with_sinks else None
    out = context_parallel_attention(*leaves, group=None, comm_type=comm_type,
                                     document_ids=docs, window=window, sinks=sinks,
                                     dropout_p=dropout_p,
                                     dropout_seed=77 if dropout_p else None)
    out.backward(dout)
    return out.detach(), [t.grad for t in leaves], None if sinks is None else sinks.grad


@pytest.mark.parametrize("with_docs", [False, True], ids=["batch", "packed"])
@pytest.mark.parametrize("window", [None, 5, 300], ids=["full", "w5", "w300"])
def test_one_rank_sinks_equal_the_reference(window, with_docs):
    """s = 600: three query blocks of 256, windows inside one block and across blocks."""
    ref = _check(1, "p2p", 600, window, True, with_docs)
    q, k, v, _, _, docs = _inputs(600, with_docs)
    plain = _reference(q, k, v, None, window, docs)
    assert (ref - plain).abs().max() > 0.01  # the sinks matter


def test_off_by_one_is_a_zero_sink():
    q, k, v, _, _, _ = _inputs(40, False)
    got = context_parallel_attention(q, k, v, group=None, sinks=torch.zeros(HQ))
    torch.testing.assert_close(got, _reference(q, k, v, torch.zeros(HQ)), atol=ATOL,
                               rtol=RTOL)


@pytest.mark.parametrize("comm_type", ["p2p", "all_gather"])
@pytest.mark.parametrize("cp,window,with_sinks,with_docs", [
    (2, 3, False, False),    # shorter than a chunk (8): whole ring blocks are skipped
    (2, 11, True, True),     # across chunks, with sinks and documents
    (4, 6, True, False),     # four ranks, chunk 4
    (2, 100, True, False),   # longer than the sequence: plain causal with sinks
])
def test_context_parallel_windows_and_sinks_equal_the_reference(cp, comm_type, window,
                                                                with_sinks, with_docs):
    _check(cp, comm_type, 32, window, with_sinks, with_docs)


def test_dropout_with_sinks_and_window_at_cp2():
    """The reference block kernel (dropout): the mask hash of the global positions."""
    _check(2, "p2p", 32, 7, True, False, dropout_p=0.25)


def _count_ring_blocks(window):
    from megatron.core.transformer.context_parallel import ring

    calls = []
    original = ring.block_forward
    ring.block_forward = lambda *args: calls.append(1) or original(*args)
    try:
        q, k, v, _, _, _ = _inputs(32, False)
        rank, size = dist.get_rank(), dist.get_world_size()
        local = [shard_sequence(t, 2, size, rank) for t in (q, k, v)]
        context_parallel_attention(*local, group=dist.group.WORLD, window=window)
    finally:
        ring.block_forward = original
    return len(calls)


def test_ring_skips_blocks_outside_the_window():
    """CP 4, chunk 4 (rank r holds chunks r and 7 - r), window 2: besides its own block a
    rank computes only the neighbours' (rank r - 1's head chunk precedes its head, rank
    r + 1's block precedes its tail); 10 of the 16 ring blocks, all 16 without a window."""
    assert run_distributed(_count_ring_blocks, world_size=4, window=2) == [2, 3, 3, 2]
    assert run_distributed(_count_ring_blocks, world_size=4, window=None) == [4, 4, 4, 4]


@pytest.mark.parametrize("with_docs", [False, True], ids=["batch", "packed"])
def test_one_rank_sinks_and_window_build_no_s_by_s_tensor(with_docs):
    """s = 1024, window 50: forward and backward create nothing of s x s elements (query
    blocks of 256 against at most 306 keys)."""
    from tests.unit.test_attention_paths import _LargestTensor

    s = 1024
    q, k, v, dout, sinks, docs = _inputs(s, with_docs)
    leaves = [t.requires_grad_() for t in (q, k, v, sinks)]
    with _LargestTensor() as seen:
        out = context_parallel_attention(*leaves[:3], group=None, window=50, sinks=leaves[3],
                                         document_ids=docs)
        out.backward(dout)
    assert seen.largest[0] < s * s, seen.largest


def test_a_window_under_cp_on_cuda_names_the_reference_kernel_it_needs():
    """On CUDA the flash op takes no mask: a window under CP runs the reference block
    kernel, and at long local sequences the start-up check names the window as the cause."""
    import torch as T

    from megatron.core.models import llama_config
    from megatron.core.transformer.context_parallel import reference_kernel_reason

    config = llama_config(num_layers=2, hidden_size=1024, num_attention_heads=8,
                          context_parallel_size=2, params_dtype=T.bfloat16,
                          attention_dropout=0.0, window_size=(127, 0))
    reason = reference_kernel_reason(config, "cuda", 16384, packed_documents=False)
    assert reason is not None and "a sliding window" in reason and "no --window-size" in reason
    config.window_size = None
    plain = reference_kernel_reason(config, "cuda", 16384, packed_documents=False)
    assert plain is None or "sliding window" not in plain
