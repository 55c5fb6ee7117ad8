"""The MoE layer at EP=1 (megatron/core/transformer/moe), fp32 on CPU.

- Equals HF's MixtralSparseMoeBlock, Qwen2MoeSparseMoeBlock (shared expert + sigmoid gate) and
  Qwen3MoeSparseMoeBlock with the same weights: output, input and weight gradients within
  1e-5 (the same math, but the summation orders of the grouped rows / GEMMs differ; observed
  differences are ~1e-7 relative). Outputs: absolute 1e-5. Gradients: absolute 1e-5 plus
  relative 1e-5, because the router's weight gradient sums 24 tokens to values ~30, where
  one fp32 ulp is 4e-6.
- Dispatch: permute then unpermute is the identity (bitwise); tokens routed = T*k - dropped;
  capacity dropping by probs / position checked by hand; an expert with no tokens works.
- Router: aux loss, seq aux loss, z-loss against loops written here; expert bias changes the
  choice, not the gate weights; the bias update by hand.
"""
import math

import pytest
import torch
import torch.nn.functional as F

from megatron.core.transformer.moe import LocalDispatcher, MoEConfig, MoELayer
from megatron.core.transformer.moe.experts import SwiGLUExperts, grouped_mm_applies
from megatron.core.transformer.moe.router import route, update_expert_bias
from megatron.core.transformer.transformer_config import TransformerConfig
from tests.distributed import run_distributed

TOL = 1e-5
SEQ, BATCH, HIDDEN, FFN, SHARED_FFN = 8, 3, 32, 24, 40


def _config(**kw):
    base = dict(num_moe_experts=4, moe_ffn_hidden_size=FFN, moe_router_topk=2)
    return MoEConfig(**{**base, **kw})


def _layer(moe_config, init_method_std=0.02):
    """An MoE layer of a one-layer model (fp32, one process) with these MoE settings."""
    return MoELayer(TransformerConfig(
        num_layers=1, hidden_size=HIDDEN, num_attention_heads=4, activation="swiglu",
        add_bias_linear=False, init_method_std=init_method_std, scaled_output_init=False,
        moe=moe_config))


# --- against Hugging Face -------------------------------------------------------------------

def _hf_block(family):
    import transformers

    common = dict(hidden_size=HIDDEN, num_experts_per_tok=2, hidden_act="silu")
    if family == "mixtral":
        cfg = transformers.MixtralConfig(intermediate_size=FFN, num_local_experts=4, **common)
        block_cls = transformers.models.mixtral.modeling_mixtral.MixtralSparseMoeBlock
    elif family == "qwen2_moe":
        cfg = transformers.Qwen2MoeConfig(moe_intermediate_size=FFN, num_experts=4,
                                          shared_expert_intermediate_size=SHARED_FFN,
                                          norm_topk_prob=False, **common)
        block_cls = transformers.models.qwen2_moe.modeling_qwen2_moe.Qwen2MoeSparseMoeBlock
    else:
        cfg = transformers.Qwen3MoeConfig(moe_intermediate_size=FFN, num_experts=4,
                                          norm_topk_prob=True, **common)
        block_cls = transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeSparseMoeBlock
    cfg._experts_implementation = "eager"  # HF's per-expert loop, the reference
    torch.manual_seed(0)
    block = block_cls(cfg)
    with torch.no_grad():  # experts are torch.empty and Qwen's router zeros in HF
        for p in block.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
    return block.eval()


# HF settings -> ours. Mixtral: softmax, top-k, renormalise; Megatron's default (top-k of the
# logits, softmax over k) is the same function. Qwen2-MoE: norm_topk_prob=False.
HF_CASES = {
    "mixtral": dict(),
    "mixtral_pre_softmax_norm": dict(moe_router_pre_softmax=True, moe_router_topk_norm=True),
    "qwen2_moe": dict(moe_router_pre_softmax=True, moe_shared_expert_intermediate_size=SHARED_FFN,
                      moe_shared_expert_gate=True),
    "qwen3_moe": dict(moe_router_pre_softmax=True, moe_router_topk_norm=True),
}


def _copy_from_hf(layer, block):
    with torch.no_grad():
        layer.router.weight.copy_(block.gate.weight)
        layer.experts.weight1.copy_(block.experts.gate_up_proj)
        layer.experts.weight2.copy_(block.experts.down_proj)
        if layer.shared_experts is not None:
            mlp = block.shared_expert
            layer.shared_experts.linear_fc1.weight.copy_(
                torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]))
            layer.shared_experts.linear_fc2.weight.copy_(mlp.down_proj.weight)
            layer.shared_experts.gate_weight.copy_(block.shared_expert_gate.weight)


def _hf_grads(block):
    grads = {"router.weight": block.gate.weight.grad,
             "experts.weight1": block.experts.gate_up_proj.grad,
             "experts.weight2": block.experts.down_proj.grad}
    if hasattr(block, "shared_expert"):
        mlp = block.shared_expert
        grads["shared_experts.linear_fc1.weight"] = torch.cat([mlp.gate_proj.weight.grad,
                                                               mlp.up_proj.weight.grad])
        grads["shared_experts.linear_fc2.weight"] = mlp.down_proj.weight.grad
        grads["shared_experts.gate_weight"] = block.shared_expert_gate.weight.grad
    return grads


@pytest.mark.parametrize("grouped_gemm", [False, True])
@pytest.mark.parametrize("case", list(HF_CASES))
def test_matches_hf(case, grouped_gemm):
    # One process with parallel_state: the shared expert is the tensor-parallel MLP.
    run_distributed(_compare_with_hf, 1, tp=1, case=case, grouped_gemm=grouped_gemm)


def _compare_with_hf(case, grouped_gemm):
    block = _hf_block(case.split("_pre")[0])
    layer = _layer(_config(moe_grouped_gemm=grouped_gemm, **HF_CASES[case]))
    _copy_from_hf(layer, block)
    assert grouped_mm_applies(torch.zeros(1, HIDDEN), layer.experts.weight1,
                              layer.experts.weight2)
    x = torch.randn(SEQ, BATCH, HIDDEN)
    upstream = torch.randn(SEQ, BATCH, HIDDEN)
    x_ours, x_hf = x.clone().requires_grad_(), x.transpose(0, 1).contiguous().requires_grad_()
    out, aux = layer.forward_with_aux(x_ours)
    out_hf = block(x_hf)
    torch.testing.assert_close(out, out_hf.transpose(0, 1), atol=TOL, rtol=0)
    assert aux["tokens_per_expert"].sum() == SEQ * BATCH * 2 and aux["num_dropped"] == 0
    (out * upstream).sum().backward()
    (out_hf * upstream.transpose(0, 1)).sum().backward()
    torch.testing.assert_close(x_ours.grad, x_hf.grad.transpose(0, 1), atol=TOL, rtol=0)
    ours = dict(layer.named_parameters())
    for name, grad in _hf_grads(block).items():
        torch.testing.assert_close(ours[name].grad, grad, atol=TOL, rtol=TOL,
                                   msg=lambda m, name=name: f"{name}: {m}")


# --- dispatch ---------------------------------------------------------------------------------

@pytest.mark.parametrize("topk,dispatch", [(1, {}), (2, {}),
                                           (2, dict(capacity_factor=4.0, pad_to_capacity=True))])
def test_permute_unpermute_is_identity(topk, dispatch):
    """Gate weights 1/k (1 for k=1): the k copies sum back to the token, bitwise, and the
    gradient flows back unchanged."""
    hidden = torch.randn(10, 8, requires_grad=True)
    indices = torch.stack([torch.randperm(4)[:topk] for _ in range(10)])
    probs = torch.full((10, topk), 1.0 / topk)
    dispatcher = LocalDispatcher(4, **dispatch)
    expert_input, tokens_per_expert, state = dispatcher.permute(hidden, indices, probs)
    assert state.num_dropped == 0
    out = dispatcher.unpermute(expert_input, state)
    assert torch.equal(out, hidden)
    upstream = torch.randn(10, 8)
    out.backward(upstream)
    assert torch.equal(hidden.grad, upstream)


def test_rows_are_grouped_by_expert_in_token_order():
    indices = torch.tensor([[2, 0], [0, 1], [2, 1]])
    hidden = torch.arange(3.0).unsqueeze(-1)
    expert_input, tokens_per_expert, _ = LocalDispatcher(4).permute(
        hidden, indices, torch.ones(3, 2))
    assert tokens_per_expert.tolist() == [2, 2, 2, 0]  # expert 3 receives nothing
    assert expert_input.squeeze(-1).tolist() == [0, 1, 1, 2, 0, 2]


@pytest.mark.parametrize("policy,kept", [("probs", [1, 3, 5]), ("position", [0, 1, 5])])
def test_capacity_drop_by_hand(policy, kept):
    """6 tokens, k=1, 2 experts, factor 0.5: capacity ceil(6/2*0.5) = 2. Tokens 0-4 want
    expert 0, token 5 expert 1."""
    hidden = torch.randn(6, 4)
    indices = torch.tensor([[0], [0], [0], [0], [0], [1]])
    probs = torch.tensor([[0.1], [0.9], [0.3], [0.8], [0.2], [0.5]])
    for pad in (False, True):
        dispatcher = LocalDispatcher(2, capacity_factor=0.5, drop_policy=policy,
                                     pad_to_capacity=pad)
        expert_input, tokens_per_expert, state = dispatcher.permute(hidden, indices, probs)
        assert state.num_dropped == 3
        assert tokens_per_expert.tolist() == ([2, 2] if pad else [2, 1])
        out = dispatcher.unpermute(expert_input, state)
        expected = torch.zeros_like(hidden)
        expected[kept] = hidden[kept] * probs[kept]
        assert torch.equal(out, expected)
        if pad:  # expert 1's second slot is a zero row
            assert torch.equal(expert_input[3], torch.zeros(4))


def test_tokens_routed_equals_tk_minus_dropped():
    torch.manual_seed(1)
    num_tokens, topk, experts, factor = 40, 2, 4, 0.75
    logits = torch.randn(num_tokens, experts) + torch.tensor([2.0, 0.0, 0.0, -2.0])
    probs, indices = route(logits, topk)
    capacity = math.ceil(num_tokens * topk / experts * factor)
    counts = torch.bincount(indices.reshape(-1), minlength=experts)
    dropped = int((counts - capacity).clamp(min=0).sum())
    assert dropped > 0
    dispatcher = LocalDispatcher(experts, capacity_factor=factor)
    expert_input, tokens_per_expert, state = dispatcher.permute(
        torch.randn(num_tokens, 8), indices, probs)
    assert state.num_dropped == dropped
    assert expert_input.shape[0] == tokens_per_expert.sum() == num_tokens * topk - dropped
    assert tokens_per_expert.tolist() == counts.clamp(max=capacity).tolist()


# --- the whole layer with dropping, against a per-token loop ---------------------------------

def _reference_layer(layer, x):
    """The layer written token by token: sigmoid scores, top-k of scores + bias, renormalised;
    each expert keeps its `capacity` highest-probability choices (earlier token on ties)."""
    cfg, tokens = layer.config.moe, x.reshape(-1, x.shape[-1])
    num_tokens, topk, experts = tokens.shape[0], cfg.moe_router_topk, cfg.num_moe_experts
    capacity = math.ceil(num_tokens * topk / experts * cfg.moe_expert_capacity_factor)
    choices = {e: [] for e in range(experts)}
    for t in range(num_tokens):
        scores = torch.sigmoid(tokens[t] @ layer.router.weight.T)
        chosen = torch.topk(scores.detach() + layer.router.expert_bias, topk).indices.tolist()
        total = sum(scores[e] for e in chosen)
        for e in chosen:
            choices[e].append((scores[e] / total, t))
    out = [torch.zeros(x.shape[-1]) for _ in range(num_tokens)]
    w1, w2 = layer.experts.weight1, layer.experts.weight2
    for e, picks in choices.items():
        picks.sort(key=lambda pick: (-pick[0].item(), pick[1]))
        for prob, t in picks[:capacity]:
            gate, up = (w1[e] @ tokens[t]).chunk(2)
            out[t] = out[t] + prob * (w2[e] @ (F.silu(gate) * up))
    dropped = sum(max(0, len(picks) - capacity) for picks in choices.values())
    return torch.stack(out).reshape(x.shape), dropped


@pytest.mark.parametrize("grouped_gemm,pad", [(False, False), (True, False), (True, True)])
def test_layer_with_dropping_matches_token_loop(grouped_gemm, pad):
    torch.manual_seed(2)
    layer = _layer(_config(num_moe_experts=6, moe_router_score_function="sigmoid",
                           moe_router_topk_norm=True, moe_router_enable_expert_bias=True,
                           moe_expert_capacity_factor=1.0, moe_grouped_gemm=grouped_gemm,
                           moe_pad_expert_input_to_capacity=pad), 0.2)
    layer.router.expert_bias.copy_(torch.tensor([1.0, 0.5, 0, 0, 0, -100.0]))  # 5: no tokens
    x = torch.randn(SEQ, BATCH, HIDDEN)
    x_ours, x_ref = x.clone().requires_grad_(), x.clone().requires_grad_()
    out, aux = layer.forward_with_aux(x_ours)
    expected, dropped = _reference_layer(layer, x_ref)
    assert dropped > 0 and aux["num_dropped"] == dropped
    assert aux["tokens_per_expert"][5] == (math.ceil(SEQ * BATCH * 2 / 6) if pad else 0)
    torch.testing.assert_close(out, expected, atol=TOL, rtol=0)
    upstream = torch.randn_like(x)
    grads = torch.autograd.grad((out * upstream).sum(), [x_ours, *layer.parameters()])
    ref_grads = torch.autograd.grad((expected * upstream).sum(), [x_ref, *layer.parameters()])
    for grad, ref in zip(grads, ref_grads):
        torch.testing.assert_close(grad, ref, atol=TOL, rtol=TOL)
    assert torch.count_nonzero(grads[1][5]) == 0  # expert 5's weight1 gradient


def test_grouped_gemm_falls_back_when_unaligned():
    """h=6 fp32: 24-byte rows, which torch._grouped_mm refuses; the loop runs instead."""
    experts = SwiGLUExperts(3, 6, 8, grouped_gemm=True)
    x = torch.randn(5, 6)
    assert not grouped_mm_applies(x, experts.weight1, experts.weight2)
    out = experts(x, torch.tensor([2, 0, 3]))
    expected = torch.cat([experts._forward_loop(x[:2], torch.tensor([2, 0, 0])),
                          experts._forward_loop(x[2:], torch.tensor([0, 0, 3]))])
    assert torch.equal(out, expected)


# --- router -----------------------------------------------------------------------------------

def test_aux_losses_against_formula():
    torch.manual_seed(3)
    cfg = _config(moe_aux_loss_coeff=0.01, moe_z_loss_coeff=0.001)
    layer = _layer(cfg, 0.3)
    x = torch.randn(SEQ, BATCH, HIDDEN)
    _, aux = layer.forward_with_aux(x)
    logits = x.reshape(-1, HIDDEN) @ layer.router.weight.T
    chosen = torch.topk(logits, 2).indices

    def balance(token_ids):
        total = 0.0
        for e in range(4):
            f_e = sum(int(e in chosen[t]) for t in token_ids) / (len(token_ids) * 2)
            p_e = sum(torch.softmax(logits[t], -1)[e].item() for t in token_ids) / len(token_ids)
            total += f_e * p_e
        return 4 * total

    all_tokens = range(SEQ * BATCH)
    z = sum(torch.logsumexp(logits[t], -1).item() ** 2 for t in all_tokens) / (SEQ * BATCH)
    assert aux["aux_loss"].item() == pytest.approx(0.01 * balance(all_tokens), rel=1e-5)
    assert aux["z_loss"].item() == pytest.approx(0.001 * z, rel=1e-5)
    layer.config.moe.moe_router_load_balancing_type = "seq_aux_loss"
    _, aux = layer.forward_with_aux(x)
    per_seq = [balance(range(b, SEQ * BATCH, BATCH)) for b in range(BATCH)]  # token = s*b + b
    assert aux["aux_loss"].item() == pytest.approx(0.01 * sum(per_seq) / BATCH, rel=1e-5)
    layer.config.moe.moe_router_load_balancing_type = "none"
    assert "aux_loss" not in layer.forward_with_aux(x)[1]


@pytest.mark.parametrize("score_function,pre_softmax", [("softmax", False), ("softmax", True),
                                                        ("sigmoid", False)])
def test_expert_bias_changes_choice_not_gate_weights(score_function, pre_softmax):
    torch.manual_seed(4)
    logits = torch.randn(20, 4)
    bias = torch.tensor([0.0, 0.0, 0.0, 50.0])
    plain_probs, plain = route(logits, 2, score_function, pre_softmax)
    probs, indices = route(logits, 2, score_function, pre_softmax, expert_bias=bias)
    assert (indices == 3).any(dim=-1).all() and not torch.equal(indices, plain)
    if score_function == "softmax" and not pre_softmax:  # softmax over the chosen logits
        expected = torch.softmax(logits.gather(-1, indices), -1)
    else:
        scores = logits.softmax(-1) if pre_softmax else logits.sigmoid()
        expected = scores.gather(-1, indices)
    assert torch.equal(probs, expected)
    # Rows that chose expert 3 anyway make the same choice, so get the same gate weights.
    same = (plain == 3).any(-1)
    assert same.any()
    assert torch.equal(probs[same].sort(-1).values, plain_probs[same].sort(-1).values)


def test_update_expert_bias_by_hand():
    bias = torch.tensor([0.5, 0.0, 0.0, -0.5])
    update_expert_bias(bias, torch.tensor([4, 0, 2, 2]), rate=0.1)  # mean load 2
    assert torch.allclose(bias, torch.tensor([0.4, 0.1, 0.0, -0.5]))
    layer = _layer(_config(moe_router_enable_expert_bias=True))
    layer.forward_with_aux(torch.randn(SEQ, BATCH, HIDDEN))
    assert layer.router.local_tokens_per_expert.sum() == SEQ * BATCH * 2
    layer.router.update_expert_bias()
    assert layer.router.expert_bias.abs().max() == pytest.approx(1e-3)
    assert layer.router.local_tokens_per_expert.sum() == 0
    assert "expert_bias" not in dict(layer.named_parameters())


@pytest.mark.parametrize("field,kwargs", [
    ("moe_router_topk", dict(moe_router_topk=5)),
    ("moe_router_score_function", dict(moe_router_score_function="relu")),
    ("moe_router_pre_softmax", dict(moe_router_score_function="sigmoid",
                                    moe_router_pre_softmax=True)),
    ("moe_router_load_balancing_type", dict(moe_router_load_balancing_type="sinkhorn")),
    ("moe_expert_capacity_factor", dict(moe_expert_capacity_factor=0.0)),
    ("moe_token_drop_policy", dict(moe_token_drop_policy="random")),
    ("moe_pad_expert_input_to_capacity", dict(moe_pad_expert_input_to_capacity=True)),
    ("moe_shared_expert_gate", dict(moe_shared_expert_gate=True)),
    ("moe_aux_loss_coeff", dict(moe_aux_loss_coeff=-1.0)),
])
def test_config_errors_name_the_field(field, kwargs):
    with pytest.raises(ValueError, match=f"MoEConfig.{field}="):
        _config(**kwargs)
