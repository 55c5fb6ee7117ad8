"""DeepSeek-V3 routing in router.route: sigmoid scores, the aux-loss-free correction bias for
the choice only, group-limited top-k (--moe-router-num-groups / --moe-router-group-topk), the
renormalisation and the routed scaling factor equal transformers' DeepseekV3TopkRouter: the
same experts exactly, the gate weights within 1e-6. HF takes its top-k unsorted, so both sides
are compared with each token's experts in ascending order. And every bad group setting is one
ValueError naming its field."""
import pytest
import torch

from megatron.core.transformer.moe.moe_config import MoEConfig
from megatron.core.transformer.moe.router import TopKRouter, keep_best_groups, route

HIDDEN, TOKENS = 32, 64


def _hf_router(experts, topk, groups, group_topk, norm, scaling, bias):
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    config = DeepseekV3Config(hidden_size=HIDDEN, n_routed_experts=experts,
                              num_experts_per_tok=topk, n_group=groups, topk_group=group_topk,
                              norm_topk_prob=norm, routed_scaling_factor=scaling)
    router = DeepseekV3TopkRouter(config)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        router.weight.copy_(torch.randn(experts, HIDDEN, generator=g))
        if bias:  # large enough to change choices (sigmoid scores lie in (0, 1))
            router.e_score_correction_bias.copy_(torch.rand(experts, generator=g) - 0.5)
    return router


def _by_expert(weights, indices):
    """Each token's experts ascending, the weights in the same order."""
    order = indices.argsort(dim=-1)
    return weights.gather(-1, order), indices.gather(-1, order)


# (experts, top-k, groups, group top-k): DeepSeek-V3's shape in small, and no groups (HF's
# n_group = topk_group = 1, ours either 1 group or none at all).
SHAPES = {"16e-4g-top2g-k4": (16, 4, 4, 2, 4, 2), "8e-1g-k2": (8, 2, 1, 1, 1, 1),
          "8e-nogroups-k2": (8, 2, 1, 1, None, None)}


@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "correction-bias"])
@pytest.mark.parametrize("norm", [True, False], ids=["norm", "no-norm"])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_route_equals_hf_deepseek_v3_router(shape, norm, bias):
    experts, topk, hf_groups, hf_group_topk, groups, group_topk = SHAPES[shape]
    hf = _hf_router(experts, topk, hf_groups, hf_group_topk, norm, 2.5, bias)
    hidden = torch.randn(TOKENS, HIDDEN, generator=torch.Generator().manual_seed(4))
    logits, want_weights, want_indices = hf(hidden)
    expert_bias = hf.e_score_correction_bias if bias else None
    probs, indices = route(logits, topk, "sigmoid", topk_norm=norm, expert_bias=expert_bias,
                           num_groups=groups, group_topk=group_topk, scaling_factor=2.5)
    probs, indices = _by_expert(probs, indices)
    want_weights, want_indices = _by_expert(want_weights, want_indices)
    assert torch.equal(indices, want_indices)
    assert (probs - want_weights).abs().max().item() <= 1e-6
    if hf_groups > hf_group_topk:  # the groups changed some token's experts
        _, plain = route(logits, topk, "sigmoid", expert_bias=expert_bias)
        assert not torch.equal(plain.sort(dim=-1).values, indices)

    # The whole router (fp32 logits from its weight, the expert-bias buffer) agrees too.
    config = MoEConfig(num_moe_experts=experts, moe_ffn_hidden_size=8, moe_router_topk=topk,
                       moe_router_score_function="sigmoid", moe_router_topk_norm=norm,
                       moe_router_enable_expert_bias=bias, moe_router_num_groups=groups,
                       moe_router_group_topk=group_topk, moe_router_topk_scaling_factor=2.5,
                       moe_router_load_balancing_type="none")
    router = TopKRouter(config, HIDDEN)
    with torch.no_grad():
        router.weight.copy_(hf.weight)
        if bias:
            router.expert_bias.copy_(hf.e_score_correction_bias)
    probs, indices, _ = router(hidden.to(torch.bfloat16).float())
    _, want_weights, want_indices = hf(hidden.to(torch.bfloat16).float())
    probs, indices = _by_expert(probs, indices)
    want_weights, want_indices = _by_expert(want_weights, want_indices)
    assert torch.equal(indices, want_indices)
    assert (probs - want_weights).abs().max().item() <= 1e-6


def _logit(p):
    p = torch.tensor(p, dtype=torch.float32)
    return torch.log(p / (1 - p))


def test_groups_keep_the_choice_inside_the_best_groups():
    """Expert 2 has the highest score, but its group (2, 3) sums to less than group (0, 1):
    plain top-2 takes experts 2 and 0, group-limited top-2 with one group takes 0 and 1."""
    logits = _logit([[0.9, 0.8, 0.95, 0.1, 0.2, 0.2, 0.3, 0.1]])
    _, plain = route(logits, 2, "sigmoid")
    assert sorted(plain[0].tolist()) == [0, 2]
    probs, grouped = route(logits, 2, "sigmoid", num_groups=4, group_topk=1, topk_norm=True)
    assert sorted(grouped[0].tolist()) == [0, 1]
    torch.testing.assert_close(probs.sum(), torch.tensor(1.0))
    hf = _hf_router(8, 2, 4, 1, True, 1.0, False)
    with torch.no_grad():  # logits = hidden @ W^T with W = I: HF sees the same logits
        hf.weight.zero_()
        hf.weight[:, :8].copy_(torch.eye(8))
    hidden = torch.zeros(1, HIDDEN)
    hidden[:, :8] = logits
    assert sorted(hf(hidden)[2][0].tolist()) == [0, 1]


def test_the_correction_bias_chooses_the_groups_but_not_the_weights():
    """A bias on expert 6 makes group (6, 7) the best; the gate weights stay unbiased."""
    logits = _logit([[0.9, 0.8, 0.95, 0.1, 0.2, 0.2, 0.3, 0.1]])
    bias = torch.zeros(8)
    bias[6] = 2.0
    probs, indices = route(logits, 2, "sigmoid", expert_bias=bias, num_groups=4, group_topk=1)
    assert sorted(indices[0].tolist()) == [6, 7]
    torch.testing.assert_close(probs.sort().values, torch.tensor([[0.1, 0.3]]))


def test_one_group_and_the_existing_paths_are_unchanged():
    """One group of all experts is no group; without the new settings route() is the old one
    (top-k of the values, gathered) to the bit."""
    logits = torch.randn(TOKENS, 8, generator=torch.Generator().manual_seed(9))
    for kwargs in [dict(score_function="sigmoid", topk_norm=True),
                   dict(score_function="softmax"), dict(score_function="softmax",
                                                        pre_softmax=True, topk_norm=True)]:
        plain = route(logits, 2, **kwargs)
        one_group = route(logits, 2, num_groups=1, group_topk=1, **kwargs)
        assert torch.equal(plain[1], one_group[1]) and torch.equal(plain[0], one_group[0])
    scores = logits.sigmoid()
    top, indices = torch.topk(scores, 2, dim=-1)
    probs, got = route(logits, 2, "sigmoid")
    assert torch.equal(got, indices) and torch.equal(probs, top)
    scaled, _ = route(logits, 2, "sigmoid", scaling_factor=2.5)
    assert torch.equal(scaled, top * 2.5)


def test_keep_best_groups_masks_whole_groups():
    ranked = torch.tensor([[0.1, 0.2, 0.9, 0.8, 0.3, 0.4]])
    kept = keep_best_groups(ranked, 3, 1)
    assert torch.equal(kept, torch.tensor([[-torch.inf, -torch.inf, 0.9, 0.8, -torch.inf,
                                            -torch.inf]]))


BAD = [
    ("moe_router_num_groups", dict(moe_router_num_groups=3, moe_router_group_topk=1),
     "use a divisor of num_moe_experts (16)"),
    ("moe_router_num_groups", dict(moe_router_num_groups=16, moe_router_group_topk=4),
     "each group needs at least 2 experts (a group is scored by its top 2); use at most 8 "
     "groups for 16 experts"),
    ("moe_router_group_topk", dict(moe_router_num_groups=4, moe_router_group_topk=5),
     "use 1..moe_router_num_groups (4)"),
    ("moe_router_topk", dict(moe_router_num_groups=4, moe_router_group_topk=1,
                             moe_router_topk=6),
     "the 1 chosen groups hold only 4 experts; raise moe_router_group_topk or lower the "
     "top-k to at most 4"),
    ("moe_router_num_groups", dict(moe_router_num_groups=4),
     "moe_router_num_groups and moe_router_group_topk come as a pair"),
    ("moe_router_group_topk", dict(moe_router_group_topk=2),
     "moe_router_num_groups and moe_router_group_topk come as a pair"),
    ("moe_router_topk_scaling_factor", dict(moe_router_topk_scaling_factor=0.0),
     "use a value > 0"),
]


@pytest.mark.parametrize("field, kwargs, fix", BAD, ids=[f"{b[0]}-{i}" for i, b in
                                                          enumerate(BAD)])
def test_bad_group_settings_name_the_field(field, kwargs, fix):
    kwargs = {"moe_router_topk": 4, **kwargs}
    with pytest.raises(ValueError) as info:
        MoEConfig(num_moe_experts=16, moe_ffn_hidden_size=8, **kwargs)
    assert str(info.value).startswith(f"MoEConfig.{field}=")
    assert fix in str(info.value)
