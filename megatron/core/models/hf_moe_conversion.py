"""Hugging Face <-> this project for the mixture-of-experts models: ``MixtralForCausalLM``,
``Qwen2MoeForCausalLM`` (shared expert with a sigmoid gate, qkv biases),
``Qwen3MoeForCausalLM`` (q/k norms) and ``GptOssForCausalLM`` (attention sinks and biases,
alternating sliding-window and full layers, YaRN, biased experts and router, clamped
quick-GeGLU). Full, unsharded state dicts; ``tp_sharding`` cuts them.

gpt-oss keeps its experts transposed and interleaved: ``gate_up_proj`` [E, h, 2f] with gate
and up in alternate columns (and ``gate_up_proj_bias`` [E, 2f] alike), ``down_proj`` [E, f, h];
ours are [gate rows; up rows] [E, 2f, h] and [E, h, f]. Its released checkpoints quantize the
experts to MXFP4 (``*_blocks`` / ``*_scales``): those must be dequantized to bf16 first.

HF keeps the experts in one of two layouts, both read here: per expert (every checkpoint on
disk, and transformers < 5: Mixtral's ``block_sparse_moe.experts.{e}.w1/w3/w2``, Qwen's
``mlp.experts.{e}.gate_proj/up_proj/down_proj``) or stacked (transformers >= 5 in memory:
``mlp.experts.gate_up_proj`` [E, 2f, h], ``mlp.experts.down_proj`` [E, h, f]). Ours is the
stacked one: ``mlp.experts.weight1`` = [gate; up] rows per expert, ``weight2`` [E, h, f].
"""
from typing import Dict, List, Optional

import torch

from megatron.core.transformer.moe.moe_config import MoEConfig

MIXTRAL, QWEN2_MOE, QWEN3_MOE, GPT_OSS = "mixtral", "qwen2_moe", "qwen3_moe", "gpt_oss"
DEEPSEEK_V3 = "deepseek_v3"
MOE_MODEL_TYPES = (MIXTRAL, QWEN2_MOE, QWEN3_MOE, GPT_OSS, DEEPSEEK_V3)
# gpt-oss's fixed activation: quick-GeGLU's sigmoid gain and the +1 on the up half.
GPT_OSS_ALPHA, GPT_OSS_LINEAR_OFFSET = 1.702, 1.0
PER_EXPERT, STACKED = "per_expert", "stacked"


def num_experts_of(hf_config) -> int:
    value = getattr(hf_config, "num_local_experts", None)
    return value if value is not None else hf_config.num_experts


def moe_layer_pattern(hf_config) -> List[int]:
    """1 (MoE) or 0 (dense MLP) per layer, as HF's Qwen-MoE decides: layer i has experts
    unless listed in mlp_only_layers, and only every decoder_sparse_step-th ((i + 1) % step
    == 0). Mixtral: every layer."""
    layers = hf_config.num_hidden_layers
    if hf_config.model_type in (MIXTRAL, GPT_OSS):
        return [1] * layers
    if hf_config.model_type == DEEPSEEK_V3:  # dense first_k_dense_replace layers, then MoE
        first = getattr(hf_config, "first_k_dense_replace", 0) or 0
        return [int(i >= first) for i in range(layers)]
    step = getattr(hf_config, "decoder_sparse_step", 1) or 1
    dense = set(getattr(hf_config, "mlp_only_layers", None) or [])
    return [int(i not in dense and (i + 1) % step == 0) for i in range(layers)]


def _gpt_oss_windows(hf_config) -> dict:
    """gpt-oss's layer_types as --window-size / --window-attn-skip-freq: sliding layers get
    W = sliding_window - 1 (HF keeps keys with i - j < sliding_window); a pattern other than
    all-sliding or sliding-then-full alternation cannot be expressed."""
    types = list(getattr(hf_config, "layer_types", None) or [])
    n = hf_config.num_hidden_layers
    window = getattr(hf_config, "sliding_window", None)
    if window is None or all(t == "full_attention" for t in types):
        return {}
    alternating = ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(n)]
    out = {"window_size": (int(window) - 1, 0)}
    if types == alternating:
        return {**out, "window_attn_skip_freq": 2}
    if types == ["sliding_attention"] * n:
        return out
    raise ValueError(f"gpt_oss: layer_types {types} is not supported: only sliding and full "
                     f"layers alternating (sliding first), or all sliding.")


def _gpt_oss_kwargs(hf_config) -> dict:
    """The TransformerConfig fields of a gpt-oss model (beyond LLaMA's)."""
    alpha = float(getattr(hf_config, "swiglu_alpha", GPT_OSS_ALPHA))
    if alpha != GPT_OSS_ALPHA:
        raise ValueError(f"gpt_oss: swiglu_alpha {alpha} is not supported (quick-GeGLU's "
                         f"gain is {GPT_OSS_ALPHA}).")
    if not getattr(hf_config, "attention_bias", True):
        raise ValueError("gpt_oss without attention_bias is not supported.")
    return {"add_bias_linear": True, "add_qkv_bias": True, "softmax_type": "learnable",
            "activation": "quick_geglu", "glu_linear_offset": GPT_OSS_LINEAR_OFFSET,
            "activation_func_clamp_value": float(hf_config.swiglu_limit),
            **_gpt_oss_windows(hf_config)}


def _deepseek_moe(hf_config) -> dict:
    """DeepSeek-V3's router and shared expert as MoEConfig fields: sigmoid scores with the
    aux-loss-free correction bias, group-limited top-k, renormalised, scaled."""
    groups = getattr(hf_config, "n_group", None) or 1
    grouped = groups > 1
    shared = hf_config.moe_intermediate_size * (getattr(hf_config, "n_shared_experts", 0) or 0)
    return dict(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
                moe_router_num_groups=groups if grouped else None,
                moe_router_group_topk=hf_config.topk_group if grouped else None,
                moe_router_topk_scaling_factor=float(hf_config.routed_scaling_factor),
                moe_shared_expert_intermediate_size=shared or None,
                moe_shared_expert_gate=False, moe_aux_loss_coeff=0.0)


# DeepSeek-V3's multi-latent attention: our name under self_attention. -> HF's under self_attn.
MLA_NAMES = {"linear_q_proj.weight": "q_proj.weight",
             "linear_q_down_proj.weight": "q_a_proj.weight",
             "q_layernorm.weight": "q_a_layernorm.weight",
             "linear_q_up_proj.weight": "q_b_proj.weight",
             "linear_kv_down_proj.weight": "kv_a_proj_with_mqa.weight",
             "kv_layernorm.weight": "kv_a_layernorm.weight",
             "linear_kv_up_proj.weight": "kv_b_proj.weight"}
_HF_LATENT_NORM_EPS = 1e-6  # DeepseekV3RMSNorm's default, which its latent norms keep


def mla_names(q_lora_rank) -> Dict[str, str]:
    """MLA_NAMES of a model with (or without, q_lora_rank None) the query latent."""
    skip = ("linear_q_down_proj.weight", "q_layernorm.weight", "linear_q_up_proj.weight") \
        if q_lora_rank is None else ("linear_q_proj.weight",)
    return {ours: theirs for ours, theirs in MLA_NAMES.items() if ours not in skip}


def _deepseek_kwargs(hf_config) -> dict:
    """The TransformerConfig fields of DeepSeek-V3's attention (beyond LLaMA's)."""
    if hf_config.num_key_value_heads != hf_config.num_attention_heads:
        raise ValueError("deepseek_v3 with num_key_value_heads != num_attention_heads is not "
                         "supported (MLA's heads are not grouped).")
    if hf_config.rms_norm_eps != _HF_LATENT_NORM_EPS:
        raise ValueError(f"deepseek_v3: rms_norm_eps {hf_config.rms_norm_eps} is not "
                         f"supported (its latent norms keep {_HF_LATENT_NORM_EPS}; ours use "
                         f"the model's epsilon).")
    return {"multi_latent_attention": True, "q_lora_rank": hf_config.q_lora_rank,
            "kv_lora_rank": hf_config.kv_lora_rank, "qk_head_dim": hf_config.qk_nope_head_dim,
            "qk_pos_emb_head_dim": hf_config.qk_rope_head_dim,
            "v_head_dim": hf_config.v_head_dim, "qk_layernorm": True,
            "rotary_interleaved": bool(getattr(hf_config, "rope_interleave", True)),
            "kv_channels": hf_config.qk_nope_head_dim + hf_config.qk_rope_head_dim,
            "num_query_groups": None}


def _refuse_unsupported(hf_config) -> None:
    kind = hf_config.model_type
    if kind == GPT_OSS:
        return  # its activation, windows and biases are read by _gpt_oss_kwargs
    if kind == DEEPSEEK_V3:
        if getattr(hf_config, "attention_bias", False):
            raise ValueError("deepseek_v3 with attention_bias is not supported.")
        if getattr(hf_config, "hidden_act", "silu") != "silu":
            raise ValueError(f"deepseek_v3: hidden_act {hf_config.hidden_act!r} is not "
                             f"supported (the experts are SwiGLU: 'silu').")
        return
    if getattr(hf_config, "hidden_act", "silu") != "silu":
        raise ValueError(f"{kind}: hidden_act {hf_config.hidden_act!r} is not supported (the "
                         f"experts are SwiGLU: 'silu').")
    window = getattr(hf_config, "sliding_window", None)
    in_use = (getattr(hf_config, "use_sliding_window", False) if kind != MIXTRAL
              else window is not None and window < hf_config.max_position_embeddings)
    if in_use:
        raise ValueError(f"{kind}: sliding-window attention (window {window}) is not "
                         f"implemented here; only models with it off convert.")
    if kind == QWEN3_MOE and getattr(hf_config, "attention_bias", False):
        raise ValueError("qwen3_moe with attention_bias is not supported.")
    if kind == MIXTRAL and getattr(hf_config, "router_jitter_noise", 0.0):
        raise ValueError(f"mixtral: router_jitter_noise {hf_config.router_jitter_noise} is "
                         f"not supported (set it to 0).")


def moe_transformer_kwargs(hf_config) -> dict:
    """The TransformerConfig fields an MoE model adds to (or changes in) LLaMA's: ``moe``
    (None when no layer has experts), qk_layernorm, qkv biases."""
    _refuse_unsupported(hf_config)
    kind = hf_config.model_type
    pattern = moe_layer_pattern(hf_config)
    out = {"qk_layernorm": kind == QWEN3_MOE,
           "add_qkv_bias": kind == QWEN2_MOE and bool(getattr(hf_config, "qkv_bias", True)),
           "moe": None}
    if kind == GPT_OSS:
        out.update(_gpt_oss_kwargs(hf_config))
    if kind == DEEPSEEK_V3:
        out.update(_deepseek_kwargs(hf_config))
    if not any(pattern):
        return out
    shared = getattr(hf_config, "shared_expert_intermediate_size", None) or None
    deepseek = _deepseek_moe(hf_config) if kind == DEEPSEEK_V3 else {}
    fields = dict(
        num_moe_experts=num_experts_of(hf_config),
        moe_ffn_hidden_size=(hf_config.intermediate_size if kind in (MIXTRAL, GPT_OSS)
                             else hf_config.moe_intermediate_size),
        moe_router_topk=hf_config.num_experts_per_tok,
        # Mixtral, gpt-oss: top-k of the logits, softmax over the k (Megatron's default).
        # Qwen: softmax over all experts, top-k, renormalised only with norm_topk_prob.
        # DeepSeek-V3: sigmoid scores (_deepseek_moe), renormalised with norm_topk_prob.
        moe_router_pre_softmax=kind not in (MIXTRAL, GPT_OSS, DEEPSEEK_V3),
        moe_router_topk_norm=kind not in (MIXTRAL, GPT_OSS) and bool(
            getattr(hf_config, "norm_topk_prob", False)),
        moe_router_bias=kind == GPT_OSS,
        moe_router_load_balancing_type="aux_loss",
        moe_aux_loss_coeff=float(getattr(hf_config, "router_aux_loss_coef", 0.0) or 0.0),
        moe_shared_expert_intermediate_size=shared,
        moe_shared_expert_gate=shared is not None,
        moe_layer_freq=1 if all(pattern) else pattern)
    out["moe"] = MoEConfig(**{**fields, **deepseek})
    return out


def hf_moe_config_fields(config, model_type: str) -> dict:
    """HF config fields (beyond LLaMA's) that describe ``config``'s MoE and attention."""
    moe = config.moe
    pattern = ([1] * config.num_layers if moe is None else
               [int(moe.is_moe_layer(i + 1)) for i in range(config.num_layers)])
    if model_type == GPT_OSS:
        return _gpt_oss_config_fields(config, pattern)
    if model_type == DEEPSEEK_V3:
        return _deepseek_config_fields(config, pattern)
    if model_type == MIXTRAL:
        if moe is None or not all(pattern) or moe.moe_shared_expert_intermediate_size or \
                moe.moe_router_pre_softmax or config.qk_layernorm or config.add_qkv_bias:
            raise ValueError("not a Mixtral model: Mixtral has experts in every layer, no "
                             "shared expert, top-k before the softmax, no q/k norms or biases.")
        return {"num_local_experts": moe.num_moe_experts,
                "num_experts_per_tok": moe.moe_router_topk,
                "intermediate_size": moe.moe_ffn_hidden_size,
                "router_aux_loss_coef": moe.moe_aux_loss_coeff, "sliding_window": None}
    if moe is None or not moe.moe_router_pre_softmax:
        raise ValueError(f"not a {model_type} model: it routes with a softmax over all "
                         f"experts before the top-k (moe_router_pre_softmax).")
    fields = {"num_experts": moe.num_moe_experts, "num_experts_per_tok": moe.moe_router_topk,
              "moe_intermediate_size": moe.moe_ffn_hidden_size,
              "norm_topk_prob": moe.moe_router_topk_norm,
              "router_aux_loss_coef": moe.moe_aux_loss_coeff, "decoder_sparse_step": 1,
              "mlp_only_layers": [i for i, v in enumerate(pattern) if not v],
              "use_sliding_window": False}
    if model_type == QWEN2_MOE:
        if not moe.moe_shared_expert_gate or config.qk_layernorm:
            raise ValueError("not a qwen2_moe model: it has a gated shared expert and no q/k "
                             "norms.")
        fields.update(shared_expert_intermediate_size=moe.moe_shared_expert_intermediate_size,
                      qkv_bias=bool(config.add_qkv_bias))
    elif moe.moe_shared_expert_intermediate_size or not config.qk_layernorm or \
            config.add_qkv_bias:
        raise ValueError("not a qwen3_moe model: it has q/k norms, no shared expert, no "
                         "biases.")
    else:
        fields.update(attention_bias=False, head_dim=config.kv_channels)
    return fields


def _gpt_oss_config_fields(config, pattern) -> dict:
    moe = config.moe
    if (moe is None or not all(pattern) or moe.moe_router_pre_softmax or
            not moe.moe_router_bias or config.activation != "quick_geglu" or
            config.glu_linear_offset != GPT_OSS_LINEAR_OFFSET or
            config.activation_func_clamp_value is None or config.softmax_type != "learnable"
            or not config.add_bias_linear or moe.moe_shared_expert_intermediate_size or
            config.qk_layernorm):
        raise ValueError("not a gpt_oss model: it has biased experts in every layer and a "
                         "biased router (top-k before the softmax), quick-GeGLU with offset 1 "
                         "and a clamp, learned attention sinks, biases, no q/k norms.")
    window = config.window_size
    freq = config.window_attn_skip_freq
    if window is not None and freq not in (None, 2):
        raise ValueError(f"not a gpt_oss model: its full layers alternate with the windowed "
                         f"ones (--window-attn-skip-freq 2), got {freq}.")
    layer_types = [("full_attention" if window is None or (freq and (i + 1) % freq == 0)
                    else "sliding_attention") for i in range(config.num_layers)]
    return {"num_local_experts": moe.num_moe_experts, "num_experts_per_tok": moe.moe_router_topk,
            "intermediate_size": moe.moe_ffn_hidden_size,
            "router_aux_loss_coef": moe.moe_aux_loss_coeff,
            "swiglu_limit": config.activation_func_clamp_value, "swiglu_alpha": GPT_OSS_ALPHA,
            "sliding_window": None if window is None else window[0] + 1,
            "layer_types": layer_types, "attention_bias": True, "head_dim": config.kv_channels}


def _deepseek_config_fields(config, pattern) -> dict:
    moe = config.moe
    if (moe is None or not config.multi_latent_attention or moe.moe_router_score_function !=
            "sigmoid" or not moe.moe_router_enable_expert_bias or moe.moe_shared_expert_gate
            or not config.qk_layernorm or 1 not in pattern):
        raise ValueError("not a deepseek_v3 model: it has multi-latent attention with latent "
                         "norms, sigmoid routing with the correction bias, ungated shared "
                         "experts, dense layers only before the first MoE layer.")
    first = pattern.index(1)
    if any(not v for v in pattern[first:]):
        raise ValueError("not a deepseek_v3 model: after its first MoE layer every layer has "
                         "experts (first_k_dense_replace).")
    shared = moe.moe_shared_expert_intermediate_size or 0
    if shared % moe.moe_ffn_hidden_size:
        raise ValueError(f"not a deepseek_v3 model: the shared expert's FFN {shared} is not a "
                         f"multiple of the experts' {moe.moe_ffn_hidden_size}.")
    return {"n_routed_experts": moe.num_moe_experts, "num_experts_per_tok": moe.moe_router_topk,
            "moe_intermediate_size": moe.moe_ffn_hidden_size,
            "n_shared_experts": shared // moe.moe_ffn_hidden_size,
            "n_group": moe.moe_router_num_groups or 1,
            "topk_group": moe.moe_router_group_topk or 1,
            "routed_scaling_factor": moe.moe_router_topk_scaling_factor or 1.0,
            "norm_topk_prob": moe.moe_router_topk_norm, "first_k_dense_replace": first,
            "q_lora_rank": config.q_lora_rank, "kv_lora_rank": config.kv_lora_rank,
            "qk_nope_head_dim": config.qk_head_dim,
            "qk_rope_head_dim": config.qk_pos_emb_head_dim, "v_head_dim": config.v_head_dim,
            "rope_interleave": config.rotary_interleaved, "attention_bias": False,
            "num_key_value_heads": config.num_attention_heads}


def _interleaved(gate_up: torch.Tensor, dim: int):
    """gpt-oss's alternate gate/up entries along ``dim`` -> (gate, up)."""
    return gate_up.index_select(dim, torch.arange(0, gate_up.shape[dim], 2)), \
        gate_up.index_select(dim, torch.arange(1, gate_up.shape[dim], 2))


def _interleave(gate: torch.Tensor, up: torch.Tensor, dim: int) -> torch.Tensor:
    """(gate, up) -> alternate entries along ``dim`` (the inverse of _interleaved)."""
    return torch.stack([gate, up], dim=dim + 1).flatten(dim, dim + 1)


def gpt_oss_layer_from_hf(hf, src: str, dst: str) -> Dict[str, torch.Tensor]:
    """One gpt-oss layer's MLP (and its attention extras: the output projection's bias, the
    sinks): HF names under ``src`` -> ours under ``dst``."""
    experts = src + "mlp.experts."
    if experts + "gate_up_proj_blocks" in hf:
        raise ValueError("gpt_oss: the experts are MXFP4-quantized (gate_up_proj_blocks); "
                         "dequantize the checkpoint to bf16 first (transformers' "
                         "Mxfp4Config(dequantize=True), then save_pretrained).")
    gate, up = _interleaved(hf[experts + "gate_up_proj"], 2)  # [E, h, f] each
    bias_gate, bias_up = _interleaved(hf[experts + "gate_up_proj_bias"], 1)
    return {dst + "mlp.experts.weight1": torch.cat([gate, up], dim=2).transpose(1, 2),
            dst + "mlp.experts.bias1": torch.cat([bias_gate, bias_up], dim=1),
            dst + "mlp.experts.weight2": hf[experts + "down_proj"].transpose(1, 2),
            dst + "mlp.experts.bias2": hf[experts + "down_proj_bias"],
            dst + "mlp.router.weight": hf[src + "mlp.router.weight"],
            dst + "mlp.router.bias": hf[src + "mlp.router.bias"],
            dst + "self_attention.linear_proj.bias": hf[src + "self_attn.o_proj.bias"],
            dst + "self_attention.sinks": hf[src + "self_attn.sinks"]}


def gpt_oss_layer_to_hf(state, src: str, dst: str) -> Dict[str, torch.Tensor]:
    """Inverse of gpt_oss_layer_from_hf."""
    gate, up = state[src + "mlp.experts.weight1"].transpose(1, 2).chunk(2, dim=2)
    bias_gate, bias_up = state[src + "mlp.experts.bias1"].chunk(2, dim=1)
    experts = dst + "mlp.experts."
    return {experts + "gate_up_proj": _interleave(gate, up, 2),
            experts + "gate_up_proj_bias": _interleave(bias_gate, bias_up, 1),
            experts + "down_proj": state[src + "mlp.experts.weight2"].transpose(1, 2),
            experts + "down_proj_bias": state[src + "mlp.experts.bias2"],
            dst + "mlp.router.weight": state[src + "mlp.router.weight"],
            dst + "mlp.router.bias": state[src + "mlp.router.bias"],
            dst + "self_attn.o_proj.bias": state[src + "self_attention.linear_proj.bias"],
            dst + "self_attn.sinks": state[src + "self_attention.sinks"]}


def _expert_names(model_type: str):
    """(HF MLP prefix, per-expert (gate, up, down) names, router name) of one layer."""
    if model_type == MIXTRAL:
        return "block_sparse_moe.", ("w1", "w3", "w2"), "block_sparse_moe.gate.weight"
    return "mlp.", ("gate_proj", "up_proj", "down_proj"), "mlp.gate.weight"


def _gated(gate, up):
    return torch.cat([gate, up], dim=-2)


def moe_layer_from_hf(hf: Dict[str, torch.Tensor], src: str, dst: str, model_type: str,
                      num_experts: int) -> Dict[str, torch.Tensor]:
    """One MoE layer's MLP: HF names under ``src`` ("model.layers.{i}.") -> ours under
    ``dst`` ("decoder.layers.{i}.")."""
    if model_type == GPT_OSS:
        return gpt_oss_layer_from_hf(hf, src, dst)
    prefix, (g, u, d), router = _expert_names(model_type)
    out = {}
    if src + "mlp.experts.gate_up_proj" in hf:  # transformers >= 5, in memory
        out[dst + "mlp.experts.weight1"] = hf[src + "mlp.experts.gate_up_proj"]
        out[dst + "mlp.experts.weight2"] = hf[src + "mlp.experts.down_proj"]
        out[dst + "mlp.router.weight"] = hf[src + "mlp.gate.weight"]
    else:
        expert = src + prefix + "experts.{}."
        out[dst + "mlp.experts.weight1"] = torch.stack(
            [_gated(hf[expert.format(e) + f"{g}.weight"], hf[expert.format(e) + f"{u}.weight"])
             for e in range(num_experts)])
        out[dst + "mlp.experts.weight2"] = torch.stack(
            [hf[expert.format(e) + f"{d}.weight"] for e in range(num_experts)])
        out[dst + "mlp.router.weight"] = hf[src + router]
    shared = src + _shared_expert_prefix(model_type)
    if shared + "gate_proj.weight" in hf:
        out[dst + "mlp.shared_experts.linear_fc1.weight"] = _gated(
            hf[shared + "gate_proj.weight"], hf[shared + "up_proj.weight"])
        out[dst + "mlp.shared_experts.linear_fc2.weight"] = hf[shared + "down_proj.weight"]
        if model_type != DEEPSEEK_V3:  # DeepSeek's shared experts have no gate
            out[dst + "mlp.shared_experts.gate_weight"] = hf[
                src + "mlp.shared_expert_gate.weight"]
    if model_type == DEEPSEEK_V3:  # the aux-loss-free balancing bias (a buffer both sides)
        out[dst + "mlp.router.expert_bias"] = hf[src + "mlp.gate.e_score_correction_bias"]
    return out


def _shared_expert_prefix(model_type: str) -> str:
    return "mlp.shared_experts." if model_type == DEEPSEEK_V3 else "mlp.shared_expert."


def moe_layer_to_hf(state: Dict[str, torch.Tensor], src: str, dst: str, model_type: str,
                    layout: str = PER_EXPERT) -> Dict[str, torch.Tensor]:
    """Inverse of moe_layer_from_hf: ours under ``src`` -> HF names under ``dst`` in
    ``layout`` (PER_EXPERT: what checkpoints on disk hold; STACKED: transformers 5's
    modules; gpt-oss has one layout)."""
    if model_type == GPT_OSS:
        return gpt_oss_layer_to_hf(state, src, dst)
    w1, w2 = state[src + "mlp.experts.weight1"], state[src + "mlp.experts.weight2"]
    out = {}
    if layout == STACKED:
        out[dst + "mlp.experts.gate_up_proj"] = w1
        out[dst + "mlp.experts.down_proj"] = w2
        out[dst + "mlp.gate.weight"] = state[src + "mlp.router.weight"]
    elif layout == PER_EXPERT:
        prefix, (g, u, d), router = _expert_names(model_type)
        for e in range(w1.shape[0]):
            expert = f"{dst}{prefix}experts.{e}."
            gate, up = w1[e].chunk(2)
            out.update({expert + f"{g}.weight": gate, expert + f"{u}.weight": up,
                        expert + f"{d}.weight": w2[e]})
        out[dst + router] = state[src + "mlp.router.weight"]
    else:
        raise ValueError(f"expert layout {layout!r} is not one of {PER_EXPERT!r}, {STACKED!r}.")
    fc1 = state.get(src + "mlp.shared_experts.linear_fc1.weight")
    if fc1 is not None:
        shared = dst + _shared_expert_prefix(model_type)
        out[shared + "gate_proj.weight"], out[shared + "up_proj.weight"] = fc1.chunk(2)
        out[shared + "down_proj.weight"] = state[src + "mlp.shared_experts.linear_fc2.weight"]
        if model_type != DEEPSEEK_V3:
            out[dst + "mlp.shared_expert_gate.weight"] = state[
                src + "mlp.shared_experts.gate_weight"]
    if model_type == DEEPSEEK_V3 and src + "mlp.router.expert_bias" in state:  # a buffer:
        # absent from a map of gradients
        out[dst + "mlp.gate.e_score_correction_bias"] = state[src + "mlp.router.expert_bias"]
    return out


def expert_layout_of(hf_state: Dict[str, torch.Tensor]) -> Optional[str]:
    """STACKED or PER_EXPERT, whichever ``hf_state`` holds (None: no experts)."""
    for name in hf_state:
        if name.endswith("mlp.experts.gate_up_proj"):
            return STACKED
        if ".experts.0." in name:
            return PER_EXPERT
    return None
