"""gpt-oss's mixture-of-experts pieces against Hugging Face's GptOssExperts / GptOssTopKRouter,
fp32 on CPU.

- The clamped quick-GeGLU (quick_geglu, clamp 7, offset 1) equals HF's ``_apply_gate`` on the
  same (de-interleaved) input BITWISE, values and input gradient, with values beyond the clamp
  on both halves and exactly at it (clamp passes the gradient at its bounds): the same kernels
  in the same order, autograd's backward written out (gated_linear_unit.py).
- SwiGLUExperts with biases, dispatched by LocalDispatcher, equals GptOssExperts (HF's eager
  per-expert loop) for random routing: output, and the gradients of the input and of all four
  tensors (weight1 / gate_up_proj, bias1 / gate_up_proj_bias, weight2 / down_proj, bias2 /
  down_proj_bias) within 1e-5 absolute and relative, on the grouped-GEMM and the loop path
  (the same math; the GEMMs and the bias gradients' sums over rows run in another order).
  The FP8 path adds the same biases after its GEMMs (against the loop within FP8 rounding).
- The router with --moe-router-bias equals GptOssTopKRouter: the chosen experts exactly,
  their gate weights within 1e-6 (both fp32: top-k of the logits, softmax over the k).
- The dense MLP with the same activation and biases equals the plain expression.
EP=2 against EP=1 with biases and this activation: test_expert_tensor_parallel.py; saved at
EP=2 and loaded at EP=1: test_moe_checkpoint.py; the parameter count: test_memory_moe.py.
"""
import pytest
import torch
import torch.nn.functional as F

from megatron.core.transformer.gated_linear_unit import gated_linear_unit, glu_function
from megatron.core.transformer.mlp import gated_activation_func
from megatron.core.transformer.moe import LocalDispatcher, MoEConfig
from megatron.core.transformer.moe.experts import SwiGLUExperts, grouped_mm_applies
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.transformer_config import TransformerConfig

HIDDEN, FFN, EXPERTS, TOPK, TOKENS = 32, 16, 4, 2, 24
LIMIT, OFFSET = 7.0, 1.0
TOL = 1e-5


def _hf_config():
    import transformers

    config = transformers.GptOssConfig(
        hidden_size=HIDDEN, intermediate_size=FFN, num_local_experts=EXPERTS,
        num_experts_per_tok=TOPK, swiglu_limit=LIMIT, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    config._experts_implementation = "eager"  # HF's per-expert loop, the reference
    return config


def _deinterleave(t):
    """HF's [..., g0, u0, g1, u1, ...] -> our [..., gate | up]."""
    return torch.cat([t[..., ::2], t[..., 1::2]], dim=-1)


def _interleave(t):
    gate, up = t.chunk(2, dim=-1)
    return torch.stack([gate, up], dim=-1).flatten(-2)


def _quick_geglu():
    return glu_function("quick_geglu", LIMIT, OFFSET)


# --- (a) the activation ---------------------------------------------------------------------

def test_clamped_quick_geglu_equals_hf_apply_gate_bitwise():
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    hf = GptOssExperts(_hf_config())
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(64, 2 * FFN, generator=gen) * 6  # ~25% of each half beyond the clamp
    x[0, :3] = LIMIT  # the gate exactly at its bound
    x[1, FFN:FFN + 3] = torch.tensor([LIMIT, -LIMIT, -LIMIT - 1])  # up at and below its bounds
    gate, up = x.chunk(2, dim=-1)
    assert (gate > LIMIT).sum() > 50 and (up > LIMIT).sum() > 50 and (up < -LIMIT).sum() > 50
    upstream = torch.randn(64, FFN, generator=gen)
    ours_in, hf_in = x.clone().requires_grad_(), _interleave(x).requires_grad_()
    ours, theirs = _quick_geglu()(ours_in), hf._apply_gate(hf_in)
    assert torch.equal(ours, theirs)
    ours.backward(upstream)
    theirs.backward(upstream)
    assert torch.equal(ours_in.grad, _deinterleave(hf_in.grad))
    # The plain expression (torch.compile's form) is the same function, bitwise.
    plain_in = x.clone().requires_grad_()
    plain = gated_linear_unit(plain_in, quick=True, clamp=LIMIT, offset=OFFSET)
    plain.backward(upstream)
    assert torch.equal(plain, ours) and torch.equal(plain_in.grad, ours_in.grad)


@pytest.mark.parametrize("activation,clamp,offset", [
    ("swiglu", None, 0.0), ("swiglu", 2.0, 0.5), ("quick_geglu", None, 0.0),
    ("quick_geglu", LIMIT, OFFSET)])
def test_gated_function_equals_its_plain_expression_bitwise(activation, clamp, offset):
    x = torch.randn(16, 2 * FFN, generator=torch.Generator().manual_seed(1)) * 4
    upstream = torch.randn(16, FFN, generator=torch.Generator().manual_seed(2))
    a, b = x.clone().requires_grad_(), x.clone().requires_grad_()
    got = gated_activation_func(activation, clamp, offset)(a)
    want = glu_function(activation, clamp, offset, plain=True)(b)
    got.backward(upstream)
    want.backward(upstream)
    assert torch.equal(got, want) and torch.equal(a.grad, b.grad)


def test_dense_mlp_with_quick_geglu_and_biases():
    """The MLP's fc1 keeps [gate; up] rows like the experts; one process, no groups needed
    beyond the default TP of 1."""
    from tests.distributed import run_distributed

    assert run_distributed(_dense_mlp_matches, 1, tp=1)[0]


def _dense_mlp_matches():
    from megatron.core.transformer.mlp import MLP

    config = TransformerConfig(num_layers=1, hidden_size=HIDDEN, num_attention_heads=4,
                               ffn_hidden_size=FFN, activation="quick_geglu",
                               activation_func_clamp_value=LIMIT, glu_linear_offset=OFFSET)
    torch.manual_seed(0)
    mlp = MLP(config)
    with torch.no_grad():
        for p in mlp.parameters():
            p.copy_(torch.randn_like(p))
    x = torch.randn(5, 2, HIDDEN)
    out, bias = mlp(x)
    fc1 = F.linear(x, mlp.linear_fc1.weight, mlp.linear_fc1.bias)
    expected = F.linear(gated_linear_unit(fc1, True, LIMIT, OFFSET), mlp.linear_fc2.weight)
    return torch.equal(out, expected) and torch.equal(bias, mlp.linear_fc2.bias)


# --- (b) the experts ------------------------------------------------------------------------

def _hf_experts():
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    torch.manual_seed(0)
    experts = GptOssExperts(_hf_config())
    with torch.no_grad():  # torch.empty in HF; scaled so some of fc1's outputs pass the clamp
        for p in experts.parameters():
            p.copy_(torch.randn_like(p) * 0.4)
    return experts


def _ours_from_hf(hf, grouped_gemm):
    ours = SwiGLUExperts(EXPERTS, HIDDEN, FFN, grouped_gemm=grouped_gemm, bias=True,
                         activation_func=_quick_geglu())
    ours.load_full(_deinterleave(hf.gate_up_proj.detach()).transpose(1, 2),
                   hf.down_proj.detach().transpose(1, 2),
                   _deinterleave(hf.gate_up_proj_bias.detach()), hf.down_proj_bias.detach())
    return ours


def _routing(seed):
    gen = torch.Generator().manual_seed(seed)
    indices = torch.rand(TOKENS, EXPERTS, generator=gen).argsort(dim=1)[:, :TOPK]
    indices[:3] = torch.tensor([0, 1])  # expert 3 gets no token from these rows
    probs = torch.softmax(torch.randn(TOKENS, TOPK, generator=gen), dim=-1)
    return indices, probs


@pytest.mark.parametrize("grouped_gemm", [False, True])
def test_biased_experts_equal_hf_gpt_oss_experts(grouped_gemm):
    hf = _hf_experts()
    ours = _ours_from_hf(hf, grouped_gemm)
    assert grouped_mm_applies(torch.zeros(1, HIDDEN), ours.weight1, ours.weight2)
    indices, probs = _routing(3)
    gen = torch.Generator().manual_seed(4)
    x, upstream = torch.randn(TOKENS, HIDDEN, generator=gen), torch.randn(TOKENS, HIDDEN,
                                                                           generator=gen)
    x_ours, x_hf = x.clone().requires_grad_(), x.clone().requires_grad_()
    dispatcher = LocalDispatcher(EXPERTS)
    rows, tokens_per_expert, state = dispatcher.permute(x_ours, indices, probs)
    with torch.no_grad():  # the clamp is reached, so its gradient rule is exercised
        fc1 = torch.cat([F.linear(r, ours.weight1[e], ours.bias1[e]) for e, r in
                         enumerate(torch.split(rows, tokens_per_expert.tolist()))])
        assert (fc1[:, :FFN] > LIMIT).any() and (fc1[:, FFN:].abs() > LIMIT).any()
    out = dispatcher.unpermute(ours(rows, tokens_per_expert), state)
    out_hf = hf(x_hf, indices, probs)
    torch.testing.assert_close(out, out_hf, atol=TOL, rtol=TOL)
    (out * upstream).sum().backward()
    (out_hf * upstream).sum().backward()
    pairs = {
        "input": (x_ours.grad, x_hf.grad),
        "weight1": (ours.weight1.grad, _deinterleave(hf.gate_up_proj.grad).transpose(1, 2)),
        "bias1": (ours.bias1.grad, _deinterleave(hf.gate_up_proj_bias.grad)),
        "weight2": (ours.weight2.grad, hf.down_proj.grad.transpose(1, 2)),
        "bias2": (ours.bias2.grad, hf.down_proj_bias.grad),
    }
    for name, (got, want) in pairs.items():
        torch.testing.assert_close(got, want, atol=TOL, rtol=TOL,
                                   msg=lambda m, name=name: f"{name}: {m}")
    assert torch.count_nonzero(ours.bias1.grad[3]) > 0  # expert 3 got other rows


def test_fp8_experts_add_their_biases_in_high_precision():
    """The FP8 path adds each row's biases after its GEMMs: against the high-precision loop,
    within FP8's rounding (rowwise e4m3: a few percent of the largest value), and bias2's
    gradient (the sum of each expert's output gradients, no GEMM) to fp32 rounding."""
    from megatron.core.fp8 import Fp8Config
    from megatron.core.fp8.linear import Fp8Gemms

    torch.manual_seed(8)
    experts = SwiGLUExperts(EXPERTS, 64, 64, bias=True, activation_func=_quick_geglu(),
                            init_method_std=0.1)
    with torch.no_grad():
        experts.bias1.normal_()
        experts.bias2.normal_()
    gen = torch.Generator().manual_seed(9)
    x, upstream = torch.randn(50, 64, generator=gen), torch.randn(50, 64, generator=gen)
    counts = torch.tensor([20, 0, 17, 13])
    runs = []
    for fp8 in (None, Fp8Config(recipe="rowwise")):
        experts.zero_grad()
        experts.fp8 = None if fp8 is None else (Fp8Gemms(fp8), Fp8Gemms(fp8))
        leaf = x.clone().requires_grad_()
        out = experts(leaf, counts)
        (out * upstream).sum().backward()
        runs.append(dict(out=out.detach(), input=leaf.grad, bias1=experts.bias1.grad.clone(),
                         bias2=experts.bias2.grad.clone(), weight1=experts.weight1.grad.clone()))
    high, low = runs
    for name in ("out", "input", "bias1", "weight1"):
        assert (low[name] - high[name]).abs().max() <= 0.1 * high[name].abs().max(), name
    torch.testing.assert_close(low["bias2"], high["bias2"], atol=1e-5, rtol=1e-5)
    assert not low["bias1"][1].any() and not low["bias2"][1].any()  # expert 1: no rows
    with torch.no_grad():  # the biases matter far beyond FP8's error
        experts.fp8 = None
        experts.bias2.zero_()
        assert (experts(x, counts) - high["out"]).abs().max() > 0.5 * high["out"].abs().max()


def test_expert_and_router_biases_are_not_weight_decayed():
    """Megatron's rule (biases and 1-D weights are not decayed) covers the stacked [E, ...]
    biases too."""
    from megatron.core.optimizer import get_param_groups

    layer = torch.nn.ModuleDict(dict(
        experts=SwiGLUExperts(EXPERTS, HIDDEN, FFN, bias=True),
        router=TopKRouter(MoEConfig(num_moe_experts=EXPERTS, moe_ffn_hidden_size=FFN,
                                    moe_router_bias=True), HIDDEN)))
    decayed, not_decayed = get_param_groups([layer])
    names = {id(p): n for n, p in layer.named_parameters()}
    assert sorted(names[id(p)] for p in decayed["params"]) == [
        "experts.weight1", "experts.weight2", "router.weight"]
    assert sorted(names[id(p)] for p in not_decayed["params"]) == [
        "experts.bias1", "experts.bias2", "router.bias"]
    assert not_decayed["wd_mult"] == 0.0


def test_experts_without_biases_refuse_them_at_load():
    experts = SwiGLUExperts(EXPERTS, HIDDEN, FFN)
    assert experts.bias1 is None and len(list(experts.parameters())) == 2
    with pytest.raises(ValueError, match="exactly when the experts have biases"):
        experts.load_full(torch.zeros(EXPERTS, 2 * FFN, HIDDEN), torch.zeros(EXPERTS, HIDDEN, FFN),
                          torch.zeros(EXPERTS, 2 * FFN), torch.zeros(EXPERTS, HIDDEN))


def test_biases_are_zeros_marked_expert_parallel_and_leave_the_weights_unchanged():
    torch.manual_seed(5)
    plain = SwiGLUExperts(EXPERTS, HIDDEN, FFN)
    torch.manual_seed(5)
    biased = SwiGLUExperts(EXPERTS, HIDDEN, FFN, bias=True)
    assert torch.equal(plain.weight1, biased.weight1) and torch.equal(plain.weight2,
                                                                      biased.weight2)
    assert biased.bias1.shape == (EXPERTS, 2 * FFN) and biased.bias2.shape == (EXPERTS, HIDDEN)
    for bias in (biased.bias1, biased.bias2):
        assert not bias.any() and bias.expert_parallel and not bias.tensor_model_parallel


# --- (d) the router -------------------------------------------------------------------------

def test_router_bias_equals_hf_gpt_oss_router():
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssTopKRouter

    torch.manual_seed(6)
    hf = GptOssTopKRouter(_hf_config())
    with torch.no_grad():
        hf.weight.copy_(torch.randn_like(hf.weight) * 0.3)
        hf.bias.copy_(torch.randn_like(hf.bias))
    ours = TopKRouter(MoEConfig(num_moe_experts=EXPERTS, moe_ffn_hidden_size=FFN,
                                moe_router_topk=TOPK, moe_router_bias=True), HIDDEN)
    assert ours.bias is not None and not ours.bias.any()  # zeros until loaded
    with torch.no_grad():
        ours.weight.copy_(hf.weight)
        ours.bias.copy_(hf.bias)
    x = torch.randn(TOKENS, HIDDEN, generator=torch.Generator().manual_seed(7))
    probs, indices, _ = ours(x)
    _, hf_probs, hf_indices = hf(x)
    assert torch.equal(indices, hf_indices)
    torch.testing.assert_close(probs, hf_probs, atol=1e-6, rtol=0)
    # The bias changes the choice (it is no no-op) and trains.
    without = F.linear(x, hf.weight).topk(TOPK, dim=-1).indices
    assert not torch.equal(without, indices)
    probs.sum(dim=0)[0].backward()
    assert ours.bias.grad is not None and ours.bias.grad.abs().sum() > 0


def test_router_without_the_flag_has_no_bias():
    router = TopKRouter(MoEConfig(num_moe_experts=EXPERTS, moe_ffn_hidden_size=FFN), HIDDEN)
    assert router.bias is None and [n for n, _ in router.named_parameters()] == ["weight"]


def _sp_layer(tp):
    from megatron.core.transformer.moe import MoELayer

    config = TransformerConfig(
        num_layers=1, hidden_size=HIDDEN, num_attention_heads=4, activation="quick_geglu",
        activation_func_clamp_value=LIMIT, glu_linear_offset=OFFSET,
        tensor_model_parallel_size=tp, sequence_parallel=tp > 1, expert_tensor_parallel_size=1,
        scaled_output_init=False, init_method_std=0.3,
        moe=MoEConfig(num_moe_experts=EXPERTS, moe_ffn_hidden_size=FFN, moe_router_topk=TOPK,
                      moe_router_bias=True))
    torch.manual_seed(0)
    layer = MoELayer(config)
    with torch.no_grad():
        for bias in (layer.router.bias, layer.experts.bias1, layer.experts.bias2):
            bias.normal_()
    return layer


def _biases_under_sequence_parallel():
    """TP=2 with SP (expert TP 1) against the same layer at TP=1 on the whole sequence: the
    router's bias is marked like its weight, so the SP reduction sums its partial gradients
    over TP; the experts' gradients are summed over their expert-DP group (here the TP
    group), as DDP does."""
    import torch.distributed as dist

    from megatron.core import parallel_state as ps
    from megatron.core.distributed.finalize_model_grads import allreduce_sequence_parallel_grads

    ps.initialize_model_parallel(2, 1, expert_model_parallel_size=1,
                                 expert_tensor_parallel_size=1)
    ours, reference = _sp_layer(2), _sp_layer(1)
    x = torch.randn(8, 3, HIDDEN, generator=torch.Generator().manual_seed(10))
    rank = ps.get_tensor_model_parallel_rank()
    mine = x.chunk(2)[rank]
    (ours(mine)[0] * mine).sum().backward()
    (reference(x)[0] * x).sum().backward()
    allreduce_sequence_parallel_grads([ours])
    for param in ours.experts.parameters():
        dist.all_reduce(param.grad, group=ps.get_expert_data_parallel_group())
    marks = tuple(getattr(p, mark, False) for p, mark in (
        (ours.router.bias, "sequence_parallel"), (ours.router.weight, "sequence_parallel"),
        (ours.experts.bias1, "expert_parallel"), (ours.experts.bias2, "expert_parallel")))
    got, want = dict(ours.named_parameters()), dict(reference.named_parameters())
    # relative to the gradient's size (the router's reach ~30, where an fp32 ulp is 4e-6)
    return marks, {n: ((got[n].grad - want[n].grad).abs().max() /
                       want[n].grad.abs().max().clamp(min=1)).item() for n in want}


def test_router_and_expert_biases_under_sequence_parallelism():
    from tests.distributed import run_distributed

    for marks, errors in run_distributed(_biases_under_sequence_parallel, 2):
        assert all(marks)
        assert set(errors) >= {"router.bias", "experts.bias1", "experts.bias2"}
        for name, err in errors.items():
            assert err <= TOL, f"{name}: {err}"


# --- the configuration ----------------------------------------------------------------------

def _moe_config(**kw):
    base = dict(num_layers=1, hidden_size=HIDDEN, num_attention_heads=4,
                activation="quick_geglu", moe=MoEConfig(num_moe_experts=EXPERTS,
                                                        moe_ffn_hidden_size=FFN))
    return TransformerConfig(**{**base, **kw})


def test_flags_reach_the_configs():
    from megatron.training.arguments import parse_args
    from megatron.training.arguments.configs import transformer_config_from_args

    args = parse_args(("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 "
                       "--micro-batch-size 1 --train-iters 1 --lr 1e-3 --quick-geglu "
                       "--activation-func-clamp-value 7 --glu-linear-offset 1 --num-experts 4 "
                       "--moe-router-bias").split())
    config = transformer_config_from_args(args)
    assert (config.activation, config.activation_func_clamp_value, config.glu_linear_offset,
            config.add_bias_linear, config.moe.moe_router_bias) == ("quick_geglu", 7.0, 1.0,
                                                                    True, True)
    plain = transformer_config_from_args(parse_args(
        "--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 "
        "--micro-batch-size 1 --train-iters 1 --lr 1e-3 --swiglu".split()))
    assert (plain.activation, plain.activation_func_clamp_value, plain.glu_linear_offset) == \
        ("swiglu", None, 0.0)


def test_config_refuses_biased_experts_with_expert_tensor_parallelism():
    _moe_config(activation_func_clamp_value=LIMIT, glu_linear_offset=OFFSET)  # biases, ETP 1
    with pytest.raises(ValueError, match="MoE experts with biases .* need "
                                         "expert_tensor_parallel_size 1, got 2"):
        _moe_config(tensor_model_parallel_size=2, sequence_parallel=True,
                    expert_tensor_parallel_size=2)
    _moe_config(add_bias_linear=False, expert_tensor_parallel_size=2)  # no biases: fine


@pytest.mark.parametrize("kw,message", [
    (dict(activation="gelu", activation_func_clamp_value=LIMIT), "has none: use --swiglu"),
    (dict(activation="gelu", glu_linear_offset=1.0), "has none: use --swiglu"),
    (dict(activation_func_clamp_value=0.0), "finite value > 0"),
    (dict(activation_func_clamp_value=float("inf")), "finite value > 0"),
    (dict(glu_linear_offset=float("nan")), "glu_linear_offset must be finite"),
    (dict(activation="gelu", moe=MoEConfig(num_moe_experts=EXPERTS, moe_ffn_hidden_size=FFN)),
     "the MoE experts are gated FFNs"),
])
def test_config_refuses_bad_activation_settings(kw, message):
    base = dict(num_layers=1, hidden_size=HIDDEN, num_attention_heads=4,
                activation="quick_geglu")
    with pytest.raises(ValueError, match=message):
        TransformerConfig(**{**base, **kw})
