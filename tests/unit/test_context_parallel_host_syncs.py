"""Context parallelism without per-layer host work on CUDA, checked on CPU (issue 36):

- all-gather's chunk-order index is built and copied to the device once per (CP size,
  device), not twice per layer and microbatch (a spy counts the builds);
- CP attention dropout draws its seed on the device and never reads it (SyncCounter: 0 reads),
  the same seed value as the old ``.item()`` draw (so the same masks), on every CP rank.
"""
import torch
import torch.distributed as dist

from megatron.core.models import llama_config
from megatron.core.tensor_parallel import get_rng_tracker, model_parallel_manual_seed
from megatron.core.transformer import attention as attention_module
from megatron.core.transformer.attention import SelfAttention
from megatron.core.transformer.context_parallel import (
    all_gather,
    attention_dropout_keep,
    context_parallel_attention,
    shard_sequence,
    unshard_sequence,
)
from tests.distributed import run_distributed
from tests.sync_counter import SyncCounter
from tests.unit.test_context_parallel_attention import full_inputs, reference_attention

ATOL = RTOL = 2e-5  # as test_context_parallel_attention.py: block merges re-associate fp32 sums
HQ, HKV = 6, 2


# --- all-gather's chunk order: built once per (CP size, device) ---------------------------

def _all_gather_two_layers():
    rank, size = dist.get_rank(), dist.get_world_size()
    all_gather._chunk_sources_on.cache_clear()  # pool processes outlive a test
    builds, real = [], all_gather._chunk_sources
    all_gather._chunk_sources = lambda cp: builds.append(cp) or real(cp)
    results = []
    try:
        for seed in (7, 8):  # two layers (calls), forward and backward each
            q, k, v, dout, _ = full_inputs(HQ, HKV, 32, False, seed=seed)
            local = [shard_sequence(t, 2, size, rank).requires_grad_() for t in (q, k, v)]
            out = context_parallel_attention(*local, group=dist.group.WORLD,
                                             comm_type="all_gather")
            out.backward(shard_sequence(dout, 2, size, rank))
            results.append((out.detach(), [t.grad for t in local]))
    finally:
        all_gather._chunk_sources = real
    return builds, results


def test_all_gather_builds_the_chunk_order_once():
    per_rank = run_distributed(_all_gather_two_layers, world_size=2)
    assert [builds for builds, _ in per_rank] == [[2], [2]]
    for call, seed in enumerate((7, 8)):
        q, k, v, dout, _ = full_inputs(HQ, HKV, 32, False, seed=seed)
        q, k, v = (t.requires_grad_() for t in (q, k, v))
        ref = reference_attention(q, k, v)
        got = unshard_sequence([results[call][0] for _, results in per_rank], 2)
        torch.testing.assert_close(got, ref.detach(), atol=ATOL, rtol=RTOL)
        for i, want in enumerate(torch.autograd.grad(ref, (q, k, v), dout)):
            grad = unshard_sequence([results[call][1][i] for _, results in per_rank], 2)
            torch.testing.assert_close(grad, want, atol=ATOL, rtol=RTOL)


# --- the dropout seed is drawn on the device and never read -------------------------------

def test_a_tensor_seed_gives_the_same_mask_as_the_int():
    idx = (torch.arange(2)[:, None, None, None], torch.arange(4)[:, None, None],
           torch.arange(32)[:, None], torch.arange(32))
    for seed in (0, 99, 2 ** 62 - 1, 0x9E3779B9):
        assert torch.equal(attention_dropout_keep(torch.tensor(seed), *idx, 0.3),
                           attention_dropout_keep(seed, *idx, 0.3))
    q, k, v, _, _ = full_inputs(4, 2, 32, False)
    kwargs = dict(group=None, dropout_p=0.3)
    assert torch.equal(context_parallel_attention(q, k, v, dropout_seed=torch.tensor(99), **kwargs),
                       context_parallel_attention(q, k, v, dropout_seed=99, **kwargs))


def _old_seed() -> int:
    """The seed the code before the fix drew (and read) from the same stream state."""
    with get_rng_tracker().fork():
        return int(torch.randint(0, 2 ** 62, (1,)).item())


def _cp_self_attention_with_dropout():
    config = llama_config(num_layers=1, hidden_size=32, num_attention_heads=4,
                          num_query_groups=2, ffn_hidden_size=48, max_position_embeddings=32,
                          context_parallel_size=2, attention_dropout=0.3, hidden_dropout=0.0)
    torch.manual_seed(0)
    model_parallel_manual_seed(5)
    layer = SelfAttention(config, layer_number=1).train()
    hidden = torch.randn(16, 2, 32, requires_grad=True)  # this rank's s/CP tokens
    seeds, real = [], attention_module.context_parallel_attention

    def spy(*args, dropout_seed=None, **kwargs):
        seeds.append(dropout_seed)
        return real(*args, dropout_seed=dropout_seed, **kwargs)

    attention_module.context_parallel_attention = spy
    try:
        with SyncCounter() as syncs:
            out, _ = layer(hidden)
            out.square().sum().backward()
    finally:
        attention_module.context_parallel_attention = real
    model_parallel_manual_seed(5)  # the stream as the layer found it
    return syncs.calls, [int(seed) for seed in seeds], _old_seed()


def test_cp_attention_dropout_reads_nothing_from_the_device():
    per_rank = run_distributed(_cp_self_attention_with_dropout, world_size=2, cp=2)
    for calls, seeds, old_seed in per_rank:
        assert calls == []
        assert seeds == [old_seed]  # the same value as before: the same masks
    assert per_rank[0][1] == per_rank[1][1]  # both CP ranks hash the same seed
