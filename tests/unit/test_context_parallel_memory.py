"""Context parallelism's activation memory, measured: the bytes autograd saves (counted with
``torch.autograd.graph.saved_tensors_hooks``, unique storages, as test_theoretical_memory.py
does) by one attention call and by a whole model on each CP rank, against the unsharded run
and against the memory estimate (``memory.activations``), which must equal them exactly.

Attention alone: at CP=4 each rank saves at most 1/4 of what flash attention saves on the whole
sequence, plus the ring's K/V blocks in flight (the estimate's ``cp_kv_in_flight_bytes``,
transient, taken from the kernel's code, not measured); the ring saves exactly 1/4 (q, k, v,
output and log-sum-exp are all per token), all_gather more (the whole sequence's K and V).
The whole model is compared with no tolerance: the estimate names every saved tensor.
"""
import pytest
import torch
import torch.nn.functional as F

from megatron.core import parallel_state as ps
from megatron.core.models import LlamaModel, llama_config
from megatron.core.tensor_parallel import model_parallel_manual_seed
from megatron.core.transformer.context_parallel import (
    context_parallel_attention,
    shard_sequence,
)
from megatron.training.memory.activations import (
    ActivationSetup,
    attention_call_bytes,
    chunk_bytes,
    cp_kv_in_flight_bytes,
)
from tests.distributed import run_distributed
from tests.unit.test_theoretical_memory import _ptrs, _unique_bytes

SEQ, MBS, HEADS, GROUPS, HEAD_DIM, VOCAB = 64, 2, 8, 4, 4, 64


def _config(cp: int = 1, comm: str = "p2p", tp: int = 1, **extra):
    return llama_config(num_layers=2, hidden_size=HEADS * HEAD_DIM, num_attention_heads=HEADS,
                        num_query_groups=GROUPS, ffn_hidden_size=48, max_position_embeddings=SEQ,
                        context_parallel_size=cp, cp_comm_type=comm,
                        tensor_model_parallel_size=tp, sequence_parallel=tp > 1, **extra)


def _setup() -> ActivationSetup:
    return ActivationSetup(SEQ, MBS, 4, VOCAB, device="cpu")  # fp32 on CPU


def _qkv():
    """q [b, heads, s, d], k and v [b, groups, s, d] of the whole sequence (fp32)."""
    g = torch.Generator().manual_seed(11)
    return (torch.randn(MBS, HEADS, SEQ, HEAD_DIM, generator=g),
            torch.randn(MBS, GROUPS, SEQ, HEAD_DIM, generator=g),
            torch.randn(MBS, GROUPS, SEQ, HEAD_DIM, generator=g))


def _saved_by(attention, tensors) -> int:
    """Bytes autograd saves for one call of ``attention`` on leaf copies of ``tensors``
    (inputs included: q, k and v are what attention keeps of the projections)."""
    leaves = [t.clone().requires_grad_() for t in tensors]
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = attention(*leaves)
    out.square().sum().backward()  # the saved tensors were all usable
    return _unique_bytes(saved)


def _flash_whole_sequence() -> int:
    return _saved_by(lambda q, k, v: F.scaled_dot_product_attention(
        q, k, v, is_causal=True, enable_gqa=True), _qkv())


def _cp_attention_rank(comm: str) -> int:
    cp, rank = ps.get_context_parallel_world_size(), ps.get_context_parallel_rank()
    local = [shard_sequence(t, 2, cp, rank) for t in _qkv()]
    return _saved_by(lambda q, k, v: context_parallel_attention(
        q, k, v, group=ps.get_context_parallel_group(), comm_type=comm), local)


@pytest.mark.parametrize("comm", ["p2p", "all_gather"])
def test_attention_saves_a_quarter_per_rank_at_cp4(comm):
    whole = _flash_whole_sequence()
    assert whole == attention_call_bytes(_config(), _setup())  # q, k, v, out, lse
    per_rank = run_distributed(_cp_attention_rank, world_size=4, cp=4, comm=comm)
    estimate = attention_call_bytes(_config(4, comm), _setup())
    in_flight = cp_kv_in_flight_bytes(_config(4, comm), _setup())
    assert per_rank == [estimate] * 4
    if comm == "p2p":
        assert in_flight > 0
        assert per_rank[0] * 4 == whole  # every saved tensor is per token
        assert per_rank[0] <= whole / 4 + in_flight
    else:  # all_gather keeps the whole sequence's K and V instead of the local ones
        gathered = 2 * 4 * MBS * GROUPS * SEQ * HEAD_DIM  # fp32 K and V of all 64 tokens
        local_kv = 2 * 4 * MBS * GROUPS * (SEQ // 4) * HEAD_DIM
        assert per_rank[0] == whole // 4 - local_kv + gathered
        assert in_flight == 2 * gathered  # fp32 dK, dV of all tokens and their scatter copy


def _model_rank(comm: str, recompute) -> tuple:
    """(saved bytes of one microbatch through the model on this rank, the estimate)."""
    cp, rank = ps.get_context_parallel_world_size(), ps.get_context_parallel_rank()
    tp = ps.get_tensor_model_parallel_world_size()
    extra = {}
    if recompute == "full":
        extra = dict(recompute_granularity="full", recompute_method="uniform",
                     recompute_num_layers=1)
    elif recompute == "selective":
        extra = dict(recompute_granularity="selective")
    config = _config(cp, comm, tp, hidden_dropout=0.0, attention_dropout=0.0, **extra)
    model_parallel_manual_seed(7)
    model = LlamaModel(config, VOCAB)
    g = torch.Generator().manual_seed(5)
    tokens = shard_sequence(torch.randint(0, VOCAB, (MBS, SEQ), generator=g), 1, cp, rank)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        loss = model(tokens, labels=tokens).mean()
    loss.backward()
    return (_unique_bytes(saved, exclude=_ptrs(model.parameters())),
            chunk_bytes(config, _setup(), 0))


@pytest.mark.parametrize("world,tp,cp,comm,recompute", [
    (4, 1, 4, "p2p", None),
    (4, 1, 4, "all_gather", None),
    (4, 2, 2, "p2p", None),  # with TP and sequence parallelism
    (2, 1, 2, "p2p", "selective"),  # a no-op under CP: the same bytes as none
    (2, 1, 2, "p2p", "full"),
])
def test_model_activations_per_rank_equal_the_estimate(world, tp, cp, comm, recompute):
    results = run_distributed(_model_rank, world_size=world, tp=tp, cp=cp, comm=comm,
                              recompute=recompute)
    for rank, (measured, estimate) in enumerate(results):
        assert measured == estimate, f"rank {rank}: measured {measured}, estimate {estimate}"
