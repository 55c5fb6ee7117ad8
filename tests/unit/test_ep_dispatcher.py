"""EP dispatchers (all-to-all, all-gather) against EP=1 (LocalDispatcher on the EP ranks'
tokens concatenated, every expert on one rank), and against a plain per-token loop.

The rows each expert sees, and their order, are the same at EP=1 and EP>1, and every sum over
the k=2 choices of a token has two terms (a + b == b + a exactly), so outputs, input and probs
gradients and expert weight gradients are compared BITWISE. The per-token loop multiplies
row by row instead of a matmul over an expert's rows: compared within 2e-6 (fp32
rounding of 8-term dot products with outputs of order 1-5; 4.8e-7 seen).
"""
import pytest
import torch
import torch.distributed as dist

from megatron.core import parallel_state as ps
from megatron.core.transformer.moe.ep_dispatcher import DISPATCHERS
from megatron.core.transformer.moe.local_dispatcher import LocalDispatcher

HIDDEN = 8


def _inputs(rank, tokens, num_experts, topk, unused_experts=(), probs_one=False):
    """Rank ``rank``'s hidden [T, h], indices [T, k] (distinct experts per token, never one of
    ``unused_experts``), probs [T, k] and upstream gradient, from a seed of its own."""
    gen = torch.Generator().manual_seed(100 + rank)
    hidden = torch.randn(tokens, HIDDEN, generator=gen)
    allowed = torch.tensor([e for e in range(num_experts) if e not in unused_experts])
    pick = torch.rand(tokens, allowed.numel(), generator=gen).argsort(dim=1)[:, :topk]
    probs = torch.ones(tokens, topk) if probs_one else torch.rand(tokens, topk, generator=gen)
    return hidden, allowed[pick], probs, torch.randn(tokens, HIDDEN, generator=gen)


def _weights(num_experts):
    return torch.randn(num_experts, HIDDEN, HIDDEN, generator=torch.Generator().manual_seed(7))


def _run_experts(kind, expert_input, tokens_per_expert, first_expert, weights):
    """Toy experts: "scale" multiplies by (e + 1), "linear" is x @ W_e^T, "identity"."""
    if kind == "identity":
        return expert_input
    rows = torch.split(expert_input, tokens_per_expert.tolist())
    if kind == "scale":
        outs = [x * (first_expert + e + 1) for e, x in enumerate(rows)]
    else:
        outs = [x @ weights[e].t() for e, x in enumerate(rows)]
    return torch.cat(outs) if outs else expert_input


def _forward_backward(dispatcher, kind, hidden, indices, probs, grad, first_expert, weights):
    hidden, probs = hidden.clone().requires_grad_(), probs.clone().requires_grad_()
    if weights is not None:
        weights = weights.clone().requires_grad_()
    expert_input, tokens_per_expert, state = dispatcher.permute(hidden, indices, probs)
    out = dispatcher.unpermute(
        _run_experts(kind, expert_input, tokens_per_expert, first_expert, weights), state)
    (out * grad).sum().backward()
    return dict(out=out.detach(), hidden_grad=hidden.grad, probs_grad=probs.grad,
                weight_grad=None if weights is None else weights.grad,
                expert_input=expert_input.detach(), tokens_per_expert=tokens_per_expert)


def _ep_against_ep1(dispatcher_type, ep, kind, tokens, num_experts, topk=2, unused=(),
                    probs_one=False):
    """On every rank: EP=ep with this dispatcher vs EP=1 on the EP group's tokens; returns
    which quantities are bitwise equal (and the routed-row count)."""
    ps.initialize_model_parallel(1, 1, expert_model_parallel_size=ep)
    me, group_ranks = ps.get_expert_model_parallel_rank(), ps.get_expert_model_parallel_ranks()
    local = num_experts // ep
    first = me * local
    every = [_inputs(r, tokens[r], num_experts, topk, unused, probs_one) for r in group_ranks]
    weights = _weights(num_experts) if kind == "linear" else None
    got = _forward_backward(DISPATCHERS[dispatcher_type](num_experts), kind, *every[me],
                            first, None if weights is None else weights[first:first + local])
    ref = _forward_backward(LocalDispatcher(num_experts), kind,
                            *[torch.cat(parts) for parts in zip(*every)], 0, weights)
    start, stop = sum(tokens[r] for r in group_ranks[:me]), sum(tokens[r] for r in
                                                                 group_ranks[:me + 1])
    ref_counts = ref["tokens_per_expert"]
    ref_rows = ref_counts[:first].sum(), ref_counts[:first + local].sum()
    rows = torch.tensor([got["expert_input"].shape[0]])
    dist.all_reduce(rows, group=ps.get_expert_model_parallel_group())
    equal = dict(
        tokens_per_expert=torch.equal(got["tokens_per_expert"], ref_counts[first:first + local]),
        expert_input=torch.equal(got["expert_input"], ref["expert_input"][slice(*ref_rows)]),
        out=torch.equal(got["out"], ref["out"][start:stop]),
        hidden_grad=torch.equal(got["hidden_grad"], ref["hidden_grad"][start:stop]),
        probs_grad=torch.equal(got["probs_grad"], ref["probs_grad"][start:stop]),
    )
    if weights is not None:
        equal["weight_grad"] = torch.equal(got["weight_grad"],
                                           ref["weight_grad"][first:first + local])
    return equal, rows.item(), got, ref_counts


CASES = [  # (world, EP, tokens per rank): unequal counts, and a rank with no tokens
    (2, 2, [5, 3]),
    (4, 4, [6, 0, 3, 4]),
    (4, 2, [4, 7, 2, 5]),
]


@pytest.mark.parametrize("dispatcher", sorted(DISPATCHERS))
@pytest.mark.parametrize("world,ep,tokens", CASES)
@pytest.mark.parametrize("kind", ["scale", "linear"])
def test_ep_equals_ep1_bitwise(dispatcher, world, ep, tokens, kind):
    from tests.distributed import run_distributed

    # 8 experts, expert 1 and 6 are chosen by no token (one on each of two EP ranks).
    results = run_distributed(_ep_against_ep1, world_size=world, dispatcher_type=dispatcher,
                              ep=ep, kind=kind, tokens=tokens, num_experts=8, unused=(1, 6))
    for rank, (equal, rows, _, ref_counts) in enumerate(results):
        assert all(equal.values()), f"rank {rank}: {equal}"
        group = rank - rank % ep
        assert rows == 2 * sum(tokens[group:group + ep])  # every choice routed once
        assert ref_counts[1] == ref_counts[6] == 0


@pytest.mark.parametrize("dispatcher", sorted(DISPATCHERS))
@pytest.mark.parametrize("topk", [1, 2])
def test_permute_unpermute_is_the_identity_with_probs_one(dispatcher, topk):
    """Identity experts and gate weights 1: unpermute(permute(x)) = k * x, and so is the
    gradient of x (exact: a sum of k equal terms, k <= 2)."""
    from tests.distributed import run_distributed

    tokens = [6, 0, 3, 5]
    results = run_distributed(_ep_against_ep1, world_size=4, dispatcher_type=dispatcher, ep=4,
                              kind="identity", tokens=tokens, num_experts=4, topk=topk,
                              probs_one=True)
    for rank, (equal, rows, got, _) in enumerate(results):
        hidden, _, _, grad = _inputs(rank, tokens[rank], 4, topk, probs_one=True)
        assert torch.equal(got["out"], topk * hidden)
        assert torch.equal(got["hidden_grad"], topk * grad)
        assert rows == topk * sum(tokens)
        assert all(equal.values()), f"rank {rank}: {equal}"


def _per_token_loop(dispatcher_type):
    """EP=2 with linear experts against out[t] = sum_j p[t,j] * W_{e[t,j]} x[t], token by token
    (the definition, independent of any dispatcher)."""
    ps.initialize_model_parallel(1, 1, expert_model_parallel_size=2)
    me = ps.get_expert_model_parallel_rank()
    hidden, indices, probs, grad = _inputs(me, 5, 4, 2)
    weights = _weights(4)
    got = _forward_backward(DISPATCHERS[dispatcher_type](4), "linear", hidden, indices, probs,
                            grad, 2 * me, weights[2 * me:2 * me + 2])
    want = torch.stack([sum(probs[t, j] * (weights[indices[t, j]] @ hidden[t])
                            for j in range(2)) for t in range(5)])
    return (got["out"] - want).abs().max().item()


@pytest.mark.parametrize("dispatcher", sorted(DISPATCHERS))
def test_against_a_per_token_loop(dispatcher):
    from tests.distributed import run_distributed

    assert max(run_distributed(_per_token_loop, world_size=2, dispatcher_type=dispatcher)) < 2e-6


def _bad_expert_count(dispatcher_type):
    ps.initialize_model_parallel(1, 1, expert_model_parallel_size=2)
    try:
        DISPATCHERS[dispatcher_type](3)
    except ValueError as exc:
        return str(exc)


@pytest.mark.parametrize("dispatcher", sorted(DISPATCHERS))
def test_experts_not_divisible_by_ep_is_a_clear_error(dispatcher):
    from tests.distributed import run_distributed

    messages = run_distributed(_bad_expert_count, world_size=2, dispatcher_type=dispatcher)
    assert messages[0] == ("num_moe_experts (3) must be divisible by expert-model-parallel-size "
                           "(2): each EP rank holds the same number of experts.")
