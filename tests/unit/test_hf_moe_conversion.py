"""HF conversion of Mixtral, Qwen2-MoE, Qwen3-MoE and gpt-oss: state dicts HF -> ours -> HF bitwise in
both HF expert layouts, configs both ways, expert shard/merge over EP x ETP bitwise, and our
model from the converted weights against HF's: logits, per-token loss and every gradient
(mapped back to HF names) at EP=1, EP=2 and TP=2 x EP=2 (sequence parallel; Qwen3's q/k norm
gradients summed over TP by finalize_model_grads).

Tolerance 1e-5 (fp32): the same arithmetic in another order (HF's eager attention vs SDPA,
HF's per-expert loop vs our grouped experts, Mixtral's softmax-then-top-k vs top-k-then-
softmax, the TP and EP reductions); observed ~1e-6.
"""
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron.core import parallel_state as ps
from megatron.core.distributed.finalize_model_grads import allreduce_sequence_parallel_grads
from megatron.core.models import GPTModel
from megatron.core.models import hf_moe_conversion as moe_hf
from megatron.core.models.hf_conversion import config_from_hf, hf_to_megatron, megatron_to_hf
from megatron.core.models.tp_sharding import merge_state_dicts, shard_state_dict
from megatron.core.transformer.moe.experts import ExpertShard
from tests.distributed import run_distributed

TOL = 1e-5
VOCAB, BATCH, SEQ = 96, 2, 8
_COMMON = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=3, num_attention_heads=4,
               num_key_value_heads=2, num_experts_per_tok=2, max_position_embeddings=64,
               rms_norm_eps=1e-6, tie_word_embeddings=False, attn_implementation="eager")
MODELS = ("mixtral", "qwen2_moe", "qwen3_moe")


def hf_config(name):
    import transformers as T

    if name == "mixtral":
        return T.MixtralConfig(intermediate_size=24, num_local_experts=4, **_COMMON)
    if name == "qwen2_moe":  # layer 1 dense (mlp_only_layers), a gated shared expert, biases
        return T.Qwen2MoeConfig(intermediate_size=40, moe_intermediate_size=24,
                                shared_expert_intermediate_size=20, num_experts=4,
                                mlp_only_layers=[1], **_COMMON)
    if name == "gpt_oss":  # a 4-token window on layers 0 and 2; YaRN from 16 positions;
        # a clamp that the random activations reach
        yarn = {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0,
                "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                "original_max_position_embeddings": 16}
        return T.GptOssConfig(intermediate_size=24, num_local_experts=4, head_dim=16,
                              sliding_window=4, swiglu_limit=0.4, rope_parameters=yarn,
                              **_COMMON)
    if name.startswith("deepseek_v3"):  # one dense layer, 8 experts in 4 groups (2 chosen),
        # a shared expert, MLA with (or without: _noq) the query latent, YaRN (_yarn)
        common = {k: v for k, v in _COMMON.items() if k != "num_key_value_heads"}
        rope = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 8.0,
                "original_max_position_embeddings": 4, "beta_fast": 32.0, "beta_slow": 1.0,
                "mscale": 1.0, "mscale_all_dim": 0.8} if name.endswith("_yarn") else None
        return T.DeepseekV3Config(
            intermediate_size=40, moe_intermediate_size=12, n_routed_experts=8, n_group=4,
            topk_group=2, n_shared_experts=1, first_k_dense_replace=1,
            routed_scaling_factor=2.5, q_lora_rank=None if name.endswith("_noq") else 12,
            kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6,
            num_key_value_heads=4, rope_parameters=rope, **common)
    return T.Qwen3MoeConfig(intermediate_size=40, moe_intermediate_size=24, num_experts=4,
                            head_dim=16, norm_topk_prob=True, **_COMMON)


def build_hf_model(name):
    import transformers as T

    cls = {"mixtral": T.MixtralForCausalLM, "qwen2_moe": T.Qwen2MoeForCausalLM,
           "qwen3_moe": T.Qwen3MoeForCausalLM, "gpt_oss": T.GptOssForCausalLM,
           "deepseek_v3": T.DeepseekV3ForCausalLM}[name.split("_noq")[0].split("_yarn")[0]]
    torch.manual_seed(0)
    model = cls(hf_config(name))
    with torch.no_grad():  # non-trivial norms, biases and routers, so their mapping counts
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
        for n, b in model.named_buffers():  # DeepSeek's routing correction bias
            if n.endswith("e_score_correction_bias"):
                b.add_(torch.randn_like(b) * 0.05)
    return model.eval()


def _per_expert(name, model):
    return megatron_to_hf(hf_to_megatron(model.state_dict(), model.config), model.config)


@pytest.mark.parametrize("name", MODELS)
def test_state_dict_round_trip_is_bitwise_in_both_layouts(name):
    hf = build_hf_model(name)
    stacked = hf.state_dict()
    assert moe_hf.expert_layout_of(stacked) == moe_hf.STACKED
    ours = hf_to_megatron(stacked, hf.config, 128)
    back = megatron_to_hf(ours, hf.config, expert_layout=moe_hf.STACKED)
    assert set(back) == set(stacked)
    for key, value in stacked.items():
        assert torch.equal(back[key], value), key
    per_expert = megatron_to_hf(ours, hf.config)
    assert moe_hf.expert_layout_of(per_expert) == moe_hf.PER_EXPERT
    again = hf_to_megatron(per_expert, hf.config, 128)
    assert set(again) == set(ours)
    for key, value in ours.items():
        assert torch.equal(again[key], value), key


def test_per_expert_names_are_the_checkpoint_names():
    mixtral = _per_expert("mixtral", build_hf_model("mixtral"))
    assert "model.layers.2.block_sparse_moe.experts.3.w3.weight" in mixtral
    assert "model.layers.0.block_sparse_moe.gate.weight" in mixtral
    qwen = _per_expert("qwen2_moe", build_hf_model("qwen2_moe"))
    assert "model.layers.0.mlp.experts.3.up_proj.weight" in qwen
    assert "model.layers.1.mlp.down_proj.weight" in qwen  # the dense layer
    assert "model.layers.2.mlp.shared_expert_gate.weight" in qwen


def test_transformers_loads_the_per_expert_layout(tmp_path):
    """What megatron_to_hf writes by default is what from_pretrained reads (on-disk names)."""
    import transformers as T
    from safetensors.torch import save_file

    hf = build_hf_model("qwen3_moe")
    save_file({k: v.contiguous() for k, v in _per_expert("qwen3_moe", hf).items()},
              str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    hf.config.save_pretrained(tmp_path)
    loaded = T.Qwen3MoeForCausalLM.from_pretrained(tmp_path)
    for key, value in hf.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], value), key


@pytest.mark.parametrize("name", MODELS)
def test_config_round_trip(name):
    import transformers as T

    config, kwargs = config_from_hf(hf_config(name))
    fields = moe_hf.hf_moe_config_fields(config, name)
    rebuilt = type(hf_config(name))(**{**hf_config(name).to_dict(), **fields})
    again, kwargs_again = config_from_hf(rebuilt)
    assert again == config and kwargs_again == kwargs
    assert isinstance(rebuilt, T.PretrainedConfig)


def test_config_fields_follow_hf():
    mixtral, _ = config_from_hf(hf_config("mixtral"))
    assert not mixtral.moe.moe_router_pre_softmax and mixtral.moe.moe_ffn_hidden_size == 24
    qwen2, _ = config_from_hf(hf_config("qwen2_moe"))
    assert qwen2.moe.moe_layer_freq == [1, 0, 1] and qwen2.ffn_hidden_size == 40
    assert qwen2.moe.moe_shared_expert_gate and qwen2.add_qkv_bias and not qwen2.add_bias_linear
    assert qwen2.moe.moe_router_pre_softmax and not qwen2.moe.moe_router_topk_norm
    qwen3, _ = config_from_hf(hf_config("qwen3_moe"))
    assert qwen3.qk_layernorm and qwen3.kv_channels == 16 and qwen3.moe.moe_router_topk_norm
    step2 = hf_config("qwen2_moe")
    step2.decoder_sparse_step, step2.mlp_only_layers = 2, []
    assert config_from_hf(step2)[0].moe.moe_layer_freq == [0, 1, 0]  # HF: (i + 1) % step
    dense = hf_config("qwen3_moe")
    dense.mlp_only_layers = [0, 1, 2]
    assert config_from_hf(dense)[0].moe is None


@pytest.mark.parametrize("change,words", [
    (dict(sliding_window=16), "sliding-window"), (dict(router_jitter_noise=0.1), "jitter"),
    (dict(hidden_act="gelu"), "silu")])
def test_unrepresentable_mixtral_is_refused(change, words):
    config = hf_config("mixtral")
    for key, value in change.items():
        setattr(config, key, value)
    with pytest.raises(ValueError, match=words):
        config_from_hf(config)


@pytest.mark.parametrize("ep,etp", [(2, 1), (2, 2), (4, 1), (4, 2)])
def test_expert_shard_merge_round_trip(ep, etp):
    hf = build_hf_model("qwen2_moe")
    full = hf_to_megatron(hf.state_dict(), hf.config, 128)
    tp = 2  # dense TP; experts by (EP, ETP), as a TP=2 x EP=ep grid of ranks would hold them
    shards, ranks = [], []
    for e in range(ep):
        for x in range(max(tp, etp)):
            shards.append(shard_state_dict(full, tp, x % tp, True, ep, e, etp, x % etp))
            ranks.append((x % tp, e, x % etp))
    for shard, (_, e, x) in zip(shards, ranks):  # the layout SwiGLUExperts holds
        w1, w2 = ExpertShard(ep, e, etp, x).cut(full["decoder.layers.0.mlp.experts.weight1"],
                                                full["decoder.layers.0.mlp.experts.weight2"])
        assert torch.equal(shard["decoder.layers.0.mlp.experts.weight1"], w1)
        assert torch.equal(shard["decoder.layers.0.mlp.experts.weight2"], w2)
    merged = merge_state_dicts(shards, True, ranks)
    assert set(merged) == set(full)
    for key, value in full.items():
        assert torch.equal(merged[key], value), key
    without_ep0 = [(s, r) for s, r in zip(shards, ranks) if r[1] != 0]
    with pytest.raises(ValueError, match="no shard"):
        merge_state_dicts([s for s, _ in without_ep0], True, [r for _, r in without_ep0])


def _gathered_grads(model):
    """Every rank's gradients merged into full tensors (TP-partial replicated ones summed).
    Every DP rank feeds the same batch here, and an expert sees the tokens of all of them: its
    gradient, summed over the expert-DP group, is divided by DP, as DDP's 1/DP scaling does in
    training."""
    allreduce_sequence_parallel_grads([model])
    dp = ps.get_data_parallel_world_size()
    expert_dp = ps.get_expert_data_parallel_group()
    local = {}
    for n, p in model.named_parameters():
        if getattr(p, "expert_parallel", False):
            # with expert TP below TP each TP rank's experts saw only its part of the
            # sequence: the whole gradient is the sum over the expert-DP group
            grad = p.grad.clone()
            dist.all_reduce(grad, group=expert_dp)
            local[n] = grad / dp
        else:
            local[n] = p.grad.clone()
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, (local, (ps.get_tensor_model_parallel_rank(),
                                              ps.get_expert_model_parallel_rank(),
                                              ps.get_expert_tensor_parallel_rank())))
    return merge_state_dicts([g for g, _ in everyone], True, [r for _, r in everyone])


def _compare(name, tp_size, ep_size, overrides=None):
    tp, ep = tp_size, ep_size
    # gpt-oss's biased experts take expert TP 1 (the default expert TP is TP)
    expert_tp = 1 if name == "gpt_oss" else None
    ps.initialize_model_parallel(tp, expert_model_parallel_size=ep,
                                 expert_tensor_parallel_size=expert_tp)
    etp = ps.get_expert_tensor_parallel_world_size()
    hf = build_hf_model(name)
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    labels = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    hf_logits = hf(tokens).logits
    hf_loss = F.cross_entropy(hf_logits.reshape(-1, VOCAB), labels.reshape(-1),
                              reduction="none").view(BATCH, SEQ)
    hf_loss.sum().backward()

    config, kwargs = config_from_hf(hf.config, tensor_model_parallel_size=tp,
                                    sequence_parallel=tp > 1, expert_model_parallel_size=ep,
                                    expert_tensor_parallel_size=etp, **(overrides or {}))
    config.moe.moe_aux_loss_coeff = 0.0  # HF's loss here has none either
    model = GPTModel(config, padded_vocab_size=VOCAB, **kwargs)
    full = hf_to_megatron(hf.state_dict(), hf.config)
    shard = shard_state_dict(full, tp, ps.get_tensor_model_parallel_rank(), True, ep,
                             ps.get_expert_model_parallel_rank(), etp,
                             ps.get_expert_tensor_parallel_rank())
    if overrides:  # a feature switched off may leave HF weights without a place (the sinks)
        shard = {k: v for k, v in shard.items() if k in model.state_dict()}
    model.load_state_dict(shard, strict=True)
    logits = model(tokens)
    parts = [torch.empty_like(logits) for _ in range(tp)]
    dist.all_gather(parts, logits.contiguous(), group=ps.get_tensor_model_parallel_group())
    loss = model(tokens, labels=labels)
    loss.sum().backward()
    errors = {"logits": (torch.cat(parts, -1) - hf_logits).abs().max().item(),
              "loss": (loss - hf_loss).abs().max().item()}
    if overrides:  # another model than HF's: only how far its logits are
        return errors
    grads = megatron_to_hf(_gathered_grads(model), hf.config,
                           expert_layout=moe_hf.STACKED)
    for hf_name, p in hf.named_parameters():
        errors[f"grad {hf_name}"] = (grads[hf_name] - p.grad).abs().max().item()
    return errors


def _check(results):
    for rank, errors in enumerate(results):
        for what, err in errors.items():
            assert err <= TOL, f"rank {rank}: {what} differs from HF by {err:.3g}"


@pytest.mark.parametrize("name", MODELS)
def test_ep1_equals_hf(name):
    _check(run_distributed(_compare, world_size=1, name=name, tp_size=1, ep_size=1))


@pytest.mark.parametrize("name", MODELS)
def test_ep2_equals_hf(name):
    _check(run_distributed(_compare, world_size=2, name=name, tp_size=1, ep_size=2))


@pytest.mark.parametrize("name", ["qwen2_moe", "qwen3_moe"])
def test_tp2_ep2_equals_hf(name):
    _check(run_distributed(_compare, world_size=4, name=name, tp_size=2, ep_size=2))


@pytest.mark.parametrize("tp,ep", [(1, 1), (1, 2), (2, 1), (2, 2)])
def test_gpt_oss_equals_hf(tp, ep):
    """Sinks, alternating windows, YaRN, biased experts and router, the clamped quick-GeGLU:
    logits, loss and every gradient (the sinks' included) at TP x EP."""
    _check(run_distributed(_compare, world_size=tp * ep, name="gpt_oss", tp_size=tp,
                           ep_size=ep))


def test_gpt_oss_round_trip_is_bitwise_and_the_layout_is_ours():
    hf = build_hf_model("gpt_oss")
    state = hf.state_dict()
    ours = hf_to_megatron(state, hf.config, 128)
    back = megatron_to_hf(ours, hf.config)
    assert set(back) == set(state)
    for key, value in state.items():
        assert torch.equal(back[key], value), key
    # expert 1's gate rows are HF's even columns, its up rows the odd ones, transposed
    gate_up = state["model.layers.1.mlp.experts.gate_up_proj"][1]
    weight1 = ours["decoder.layers.1.mlp.experts.weight1"][1]
    assert torch.equal(weight1[:24], gate_up[:, 0::2].t())
    assert torch.equal(weight1[24:], gate_up[:, 1::2].t())
    config, _ = config_from_hf(hf.config)
    assert config.window_size == (3, 0) and config.window_attn_skip_freq == 2
    assert config.softmax_type == "learnable" and config.activation == "quick_geglu"
    assert config.rope_type == "yarn" and config.moe.moe_router_bias
    fields = moe_hf.hf_moe_config_fields(config, "gpt_oss")
    rebuilt = type(hf.config)(**{**hf.config.to_dict(), **fields})
    assert config_from_hf(rebuilt)[0] == config
    assert rebuilt.layer_types == hf.config.layer_types


def test_gpt_oss_features_matter():
    """Without the sinks, the window or the clamp our model differs from HF by far more than
    the tolerance: the equality above can fail."""
    for overrides in ({"softmax_type": "vanilla"}, {"window_size": None},
                      {"activation_func_clamp_value": None}):
        errors = run_distributed(_compare, world_size=1, name="gpt_oss", tp_size=1, ep_size=1,
                                 overrides=overrides)[0]
        assert errors["logits"] > 1e-3, (overrides, errors["logits"])


@pytest.mark.parametrize("change,words", [
    (dict(swiglu_alpha=1.5), "swiglu_alpha"),
    (dict(layer_types=["full_attention", "sliding_attention", "sliding_attention"]),
     "layer_types")])
def test_unrepresentable_gpt_oss_is_refused(change, words):
    config = hf_config("gpt_oss")
    for key, value in change.items():
        setattr(config, key, value)
    with pytest.raises(ValueError, match=words):
        config_from_hf(config)


def test_mxfp4_experts_are_refused_with_the_fix():
    hf = build_hf_model("gpt_oss")
    state = dict(hf.state_dict())
    state["model.layers.0.mlp.experts.gate_up_proj_blocks"] = torch.zeros(1)
    with pytest.raises(ValueError, match="MXFP4.*dequantize"):
        hf_to_megatron(state, hf.config)


DEEPSEEK = ("deepseek_v3", "deepseek_v3_noq", "deepseek_v3_yarn")


@pytest.mark.parametrize("name", DEEPSEEK)
def test_deepseek_v3_equals_hf(name):
    """MLA (with and without the query latent, YaRN with mscale_all_dim), a dense first
    layer, group-limited sigmoid routing with the correction bias and scaling, a shared
    expert: logits, loss and every gradient at TP 1."""
    _check(run_distributed(_compare, world_size=1, name=name, tp_size=1, ep_size=1))


def test_deepseek_v3_at_tp2_ep2_equals_hf():
    _check(run_distributed(_compare, world_size=4, name="deepseek_v3", tp_size=2, ep_size=2))


@pytest.mark.parametrize("name", DEEPSEEK)
def test_deepseek_v3_round_trip_is_bitwise(name):
    hf = build_hf_model(name)
    state = hf.state_dict()
    ours = hf_to_megatron(state, hf.config, 128)
    assert "decoder.layers.1.mlp.router.expert_bias" in ours
    assert "decoder.layers.0.mlp.linear_fc1.weight" in ours  # the dense first layer
    for layout in (moe_hf.STACKED, moe_hf.PER_EXPERT):
        back = megatron_to_hf(ours, hf.config, expert_layout=layout)
        again = hf_to_megatron(back, hf.config, 128)
        assert set(again) == set(ours)
        for key, value in ours.items():
            assert torch.equal(again[key], value), key
    back = megatron_to_hf(ours, hf.config, expert_layout=moe_hf.STACKED)
    assert set(back) == set(state)
    for key, value in state.items():
        assert torch.equal(back[key], value), key
    config, _ = config_from_hf(hf.config)
    fields = moe_hf.hf_moe_config_fields(config, "deepseek_v3")
    rebuilt = type(hf.config)(**{**hf.config.to_dict(), **fields})
    assert config_from_hf(rebuilt)[0] == config
