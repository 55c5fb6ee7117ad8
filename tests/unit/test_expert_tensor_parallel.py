"""Expert parallelism with capacity, and expert tensor parallelism (ETP), against EP=ETP=1.

Layouts: EP=2 (world 2), ETP=2 (EP=1, world 2), EP=2 x ETP=2 (world 4); both dispatchers;
capacity off, dropping by "probs" and "position", padding to capacity; unequal tokens per rank
(one rank with none at world 4); experts 1 and 6 chosen by no token.

The reference is EP=ETP=1: LocalDispatcher on each rank's own tokens (capacity is decided per
rank, as the router does), the rows merged by expert in rank order (the ETP x EP group's
order), one SwiGLUExperts with the full weights on the merged rows, split back, unpermuted per
rank. The rows each expert sees, and their order, are then the same as at EP>1, so:
- ETP=1: output, input and probs gradients, and every expert's weight gradient (gathered from
  the shards) are BITWISE equal.
- ETP>1: each rank computes fc2 over its f/ETP slice and the partial outputs are summed over
  the ETP ranks (and fc1's input gradient likewise), a different fp32 summation order; the
  weight gradients' matmuls run on f/ETP-wide operands, which BLAS may block differently
  (1 ulp seen). Output, input, probs and weight gradients within 1e-5 absolute (values of
  order 1-10; at most 3.8e-6 seen).
gpt-oss's experts (EP=2, ETP=1, the expert loop like the other world-2 rows): biases (drawn,
not zeros) and the clamped quick-GeGLU with offset; outputs and the gathered gradients of
weights and biases BITWISE equal too.
"""
import pytest
import torch
import torch.distributed as dist

from megatron.core import parallel_state as ps
from megatron.core.transformer.mlp import gated_activation_func
from megatron.core.transformer.moe.ep_dispatcher import DISPATCHERS
from megatron.core.transformer.moe.experts import ExpertShard, SwiGLUExperts
from megatron.core.transformer.moe.local_dispatcher import LocalDispatcher

HIDDEN, FFN, EXPERTS, TOPK, UNUSED = 8, 8, 8, 2, (1, 6)
TOL = 1e-5
PLANS = {  # (capacity factor, drop policy, pad to capacity)
    "no_capacity": (None, "probs", False),
    "drop_probs": (0.5, "probs", False),
    "drop_position": (0.5, "position", False),
    "pad_probs": (0.5, "probs", True),
    "pad_position": (0.75, "position", True),
}


def _inputs(rank, tokens, probs_one=False):
    """Rank ``rank``'s hidden [T, h], indices [T, k] (distinct experts, never UNUSED), probs
    and upstream gradient, from a seed of its own."""
    gen = torch.Generator().manual_seed(100 + rank)
    hidden = torch.randn(tokens, HIDDEN, generator=gen)
    allowed = torch.tensor([e for e in range(EXPERTS) if e not in UNUSED])
    pick = torch.rand(tokens, allowed.numel(), generator=gen).argsort(dim=1)[:, :TOPK]
    probs = torch.ones(tokens, TOPK) if probs_one else torch.rand(tokens, TOPK, generator=gen)
    return hidden, allowed[pick], probs, torch.randn(tokens, HIDDEN, generator=gen)


def _leaves(hidden, probs):
    return hidden.clone().requires_grad_(), probs.clone().requires_grad_()


def _reference(parts, experts, plan):
    """EP=ETP=1 on the group's ranks' tokens, capacity per rank (see the module docstring)."""
    dispatcher = LocalDispatcher(EXPERTS, *plan)
    leaves = [_leaves(hidden, probs) for hidden, _, probs, _ in parts]
    permuted = [dispatcher.permute(h, indices, p)
                for (h, p), (_, indices, _, _) in zip(leaves, parts)]
    counts = torch.stack([c for _, c, _ in permuted])  # [ranks, E]
    chunks = [torch.split(x, c.tolist()) for x, c, _ in permuted]
    ranks = range(len(parts))
    merged = torch.cat([chunks[r][e] for e in range(EXPERTS) for r in ranks])
    pieces = torch.split(experts(merged, counts.sum(0)), counts.t().reshape(-1).tolist())
    outs = [dispatcher.unpermute(torch.cat([pieces[e * len(parts) + r] for e in range(EXPERTS)]),
                                 state) for r, (_, _, state) in zip(ranks, permuted)]
    sum((out * grad).sum() for out, (_, _, _, grad) in zip(outs, parts)).backward()
    return dict(out=outs, hidden_grad=[h.grad for h, _ in leaves],
                probs_grad=[p.grad for _, p in leaves],
                num_dropped=[s.num_dropped for _, _, s in permuted], counts=counts)


def _gather_full(local, shard):
    """Every expert's full weight1/weight2 (or gradient) from the ETP x EP group's shards."""
    group = ps.get_expert_tensor_and_model_parallel_group()
    pieces = []
    for tensor in local:
        every = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
        dist.all_gather(every, tensor.contiguous(), group=group)
        pieces.append(every)  # group rank = ep_rank * ETP + etp_rank
    etp = shard.etp_size
    w1 = torch.cat([torch.cat([torch.cat([part.chunk(2, dim=1)[half] for part in
                                          pieces[0][e * etp:(e + 1) * etp]], dim=1)
                               for half in (0, 1)], dim=1) for e in range(shard.ep_size)])
    w2 = torch.cat([torch.cat(pieces[1][e * etp:(e + 1) * etp], dim=2)
                    for e in range(shard.ep_size)])
    return w1, w2


def _gather_biases(local):
    """Every expert's bias1/bias2 (or gradient) from the EP group's shards (ETP 1)."""
    group = ps.get_expert_model_parallel_group()
    out = []
    for tensor in local:
        every = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
        dist.all_gather(every, tensor.contiguous(), group=group)
        out.append(torch.cat(every))
    return out


def _gpt_oss_experts(grouped_gemm, shard=None):
    """Biased experts with gpt-oss's activation; biases drawn whole from their own seed."""
    torch.manual_seed(5)
    experts = SwiGLUExperts(EXPERTS, HIDDEN, FFN, grouped_gemm, init_method_std=0.5,
                            shard=shard, bias=True,
                            activation_func=gated_activation_func("quick_geglu", 7.0, 1.0))
    gen = torch.Generator().manual_seed(6)
    full1, full2 = torch.randn(EXPERTS, 2 * FFN, generator=gen), torch.randn(EXPERTS, HIDDEN,
                                                                             generator=gen)
    with torch.no_grad():
        experts.bias1.copy_(experts.shard.cut_biases(full1, full2)[0])
        experts.bias2.copy_(experts.shard.cut_biases(full1, full2)[1])
    return experts


def _compare(got, want):
    """(bitwise equal, max abs difference)."""
    return torch.equal(got, want), (got - want).abs().max().item() if got.numel() else 0.0


def _ep_etp_against_reference(dispatcher_type, ep, etp, tokens, grouped_gemm, gpt_oss=False):
    ps.initialize_model_parallel(1, 1, expert_model_parallel_size=ep,
                                 expert_tensor_parallel_size=etp)
    group_ranks = ps.get_expert_tensor_and_model_parallel_ranks()
    me = group_ranks.index(dist.get_rank())
    shard = ExpertShard.from_parallel_state()
    if gpt_oss:
        experts = _gpt_oss_experts(grouped_gemm)
        full = _gpt_oss_experts(grouped_gemm, ExpertShard())
    else:
        torch.manual_seed(5)
        experts = SwiGLUExperts(EXPERTS, HIDDEN, FFN, grouped_gemm, init_method_std=0.5)
        torch.manual_seed(5)
        full = SwiGLUExperts(EXPERTS, HIDDEN, FFN, grouped_gemm, init_method_std=0.5,
                             shard=ExpertShard())
    result = dict(init=all(torch.equal(a, b) for a, b in zip(
        _gather_full((experts.weight1.data, experts.weight2.data), shard),
        (full.weight1.data, full.weight2.data))))
    parts = [_inputs(r, tokens[r]) for r in group_ranks]
    for name, plan in PLANS.items():
        experts.zero_grad(), full.zero_grad()
        hidden, probs = _leaves(parts[me][0], parts[me][2])
        dispatcher = DISPATCHERS[dispatcher_type](EXPERTS, *plan)
        expert_input, per_local_expert, state = dispatcher.permute(hidden, parts[me][1], probs)
        out = dispatcher.unpermute(experts(expert_input, per_local_expert), state)
        (out * parts[me][3]).sum().backward()
        ref = _reference(parts, full, plan)
        grads = _gather_full((experts.weight1.grad, experts.weight2.grad), shard)
        rows = torch.tensor([per_local_expert.sum().item()])
        dist.all_reduce(rows, group=ps.get_expert_tensor_and_model_parallel_group())
        result[name] = dict(
            out=_compare(out, ref["out"][me]),
            hidden_grad=_compare(hidden.grad, ref["hidden_grad"][me]),
            probs_grad=_compare(probs.grad, ref["probs_grad"][me]),
            weight1_grad=_compare(grads[0], full.weight1.grad),
            weight2_grad=_compare(grads[1], full.weight2.grad),
            **({} if not gpt_oss else dict(zip(("bias1_grad", "bias2_grad"), (
                _compare(got, want) for got, want in zip(
                    _gather_biases((experts.bias1.grad, experts.bias2.grad)),
                    (full.bias1.grad, full.bias2.grad)))))),
            num_dropped=(state.num_dropped, ref["num_dropped"][me]),
            rows=rows.item() // etp,  # every ETP rank holds the same rows
            ref_counts=ref["counts"].sum(0))
    return result


LAYOUTS = [  # (world, EP, ETP, tokens per rank)
    (2, 2, 1, [5, 3]),
    (2, 1, 2, [5, 3]),
    (4, 2, 2, [6, 0, 3, 4]),
]


@pytest.mark.parametrize("dispatcher", sorted(DISPATCHERS))
@pytest.mark.parametrize("world,ep,etp,tokens,gpt_oss",
                         [(*layout, False) for layout in LAYOUTS] + [(*LAYOUTS[0], True)])
def test_ep_etp_equal_ep1(dispatcher, world, ep, etp, tokens, gpt_oss):
    from tests.distributed import run_distributed

    grouped = world == 4  # torch._grouped_mm where it applies (h=8, f/ETP=4: aligned)
    results = run_distributed(_ep_etp_against_reference, world_size=world,
                              dispatcher_type=dispatcher, ep=ep, etp=etp, tokens=tokens,
                              grouped_gemm=grouped, gpt_oss=gpt_oss)
    keys = ("out", "hidden_grad", "probs_grad", "weight1_grad", "weight2_grad") + \
        (("bias1_grad", "bias2_grad") if gpt_oss else ())
    for rank, result in enumerate(results):
        assert result.pop("init"), "global expert weights depend on EP/ETP"
        for name, got in result.items():
            where = f"rank {rank} {name}"
            for key in keys:
                assert got[key][0] if etp == 1 else got[key][1] <= TOL, f"{where} {key}: {got}"
            dropped, ref_dropped = got["num_dropped"]
            assert dropped == ref_dropped, where
            group = [r for r in range(world) if r // (ep * etp) == rank // (ep * etp)]
            group_dropped = sum(results[r][name]["num_dropped"][0] for r in group)
            assert (group_dropped > 0) == (name != "no_capacity"), where
            kept = sum(tokens[r] * TOPK for r in group) - group_dropped
            counts = got["ref_counts"]  # rows per expert at EP=1, padding included
            if "pad" in name:  # every rank sends `capacity` rows per expert, used or not
                assert got["rows"] == counts.sum() and (counts == counts[0]).all(), where
            else:
                assert got["rows"] == kept == counts.sum() and counts[list(UNUSED)].sum() == 0


def _identity_experts(ep, etp, tokens):
    """Gate weights 1 and experts that return their input (on ETP rank 0; 0 on the others, so
    the ETP sum is the input again): every token comes back times the number of its kept
    choices, and so does its gradient (exact: sums of at most k=2 equal terms and zeros)."""
    ps.initialize_model_parallel(1, 1, expert_model_parallel_size=ep,
                                 expert_tensor_parallel_size=etp)
    hidden, indices, probs, grad = _inputs(dist.get_rank(), tokens[dist.get_rank()],
                                           probs_one=True)
    scale = float(ps.get_expert_tensor_parallel_rank() == 0)
    failures = []
    for kind in sorted(DISPATCHERS):
        for name, plan in PLANS.items():
            leaf = hidden.clone().requires_grad_()
            dispatcher = DISPATCHERS[kind](EXPERTS, *plan)
            expert_input, _, state = dispatcher.permute(leaf, indices, probs)
            out = dispatcher.unpermute(expert_input * scale, state)
            out.backward(grad)
            kept = LocalDispatcher(EXPERTS, *plan).permute(hidden, indices, probs)[2]
            times = torch.bincount(kept.row_token, kept.row_probs, tokens[dist.get_rank()] + 1)
            times = times[:-1].unsqueeze(-1)  # kept choices per token (padding rows: index T)
            if not (torch.equal(out, times * hidden) and torch.equal(leaf.grad, times * grad)
                    and times.sum() == hidden.shape[0] * TOPK - state.num_dropped):
                failures.append((kind, name))
    return failures


@pytest.mark.parametrize("world,ep,etp,tokens", LAYOUTS[1:])
def test_dispatch_combine_is_identity_with_etp(world, ep, etp, tokens):
    from tests.distributed import run_distributed

    results = run_distributed(_identity_experts, world_size=world, ep=ep, etp=etp,
                              tokens=tokens)
    assert results == [[]] * world


def test_shard_cut_is_the_stride_two_split_of_gate_up():
    """E=4, f=4, h=3; EP=2, ETP=2, rank (ep 1, etp 1): global experts 2 and 3, gate rows 2-3
    and up rows 6-7 of weight1 (f slice 2-3), columns 2-3 of weight2."""
    weight1 = torch.arange(4 * 8 * 3.0).view(4, 8, 3)
    weight2 = torch.arange(4 * 3 * 4.0).view(4, 3, 4)
    local1, local2 = ExpertShard(ep_size=2, ep_rank=1, etp_size=2, etp_rank=1).cut(weight1,
                                                                                   weight2)
    assert torch.equal(local1, weight1[2:4][:, [2, 3, 6, 7]])
    assert torch.equal(local2, weight2[2:4][:, :, 2:4])
    experts = SwiGLUExperts(4, 3, 4, shard=ExpertShard(2, 1, 2, 1))
    experts.load_full(weight1, weight2)
    assert torch.equal(experts.weight1, local1) and torch.equal(experts.weight2, local2)
    assert experts.num_local_experts == 2 and experts.weight1.shape == (2, 4, 3)
    for weight in experts.parameters():
        assert weight.expert_parallel and weight.tensor_model_parallel
    assert not SwiGLUExperts(4, 3, 4).weight1.tensor_model_parallel  # no expert groups: 1 x 1
    with pytest.raises(ValueError, match=r"moe_ffn_hidden_size \(4\) must be divisible by "
                                         r"expert-tensor-parallel-size \(3\)"):
        SwiGLUExperts(4, 3, 4, shard=ExpertShard(etp_size=3))


if __name__ == "__main__":  # the largest differences per layout, for the docstring
    from tests.distributed import run_distributed
    for world, ep, etp, tokens in LAYOUTS:
        for kind in sorted(DISPATCHERS):
            res = run_distributed(_ep_etp_against_reference, world_size=world,
                                  dispatcher_type=kind, ep=ep, etp=etp, tokens=tokens,
                                  grouped_gemm=world == 4)
            worst = {k: max(r[n][k][1] for r in res for n in PLANS)
                     for k in ("out", "hidden_grad", "probs_grad", "weight1_grad",
                               "weight2_grad")}
            print(world, ep, etp, kind, worst)
