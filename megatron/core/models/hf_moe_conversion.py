"""Hugging Face <-> this project for the mixture-of-experts models: ``MixtralForCausalLM``,
``Qwen2MoeForCausalLM`` (shared expert with a sigmoid gate, qkv biases) and
``Qwen3MoeForCausalLM`` (q/k norms). Full, unsharded state dicts; ``tp_sharding`` cuts them.

HF keeps the experts in one of two layouts, both read here: per expert (every checkpoint on
disk, and transformers < 5: Mixtral's ``block_sparse_moe.experts.{e}.w1/w3/w2``, Qwen's
``mlp.experts.{e}.gate_proj/up_proj/down_proj``) or stacked (transformers >= 5 in memory:
``mlp.experts.gate_up_proj`` [E, 2f, h], ``mlp.experts.down_proj`` [E, h, f]). Ours is the
stacked one: ``mlp.experts.weight1`` = [gate; up] rows per expert, ``weight2`` [E, h, f].
"""
from typing import Dict, List, Optional

import torch

from megatron.core.transformer.moe.moe_config import MoEConfig

MIXTRAL, QWEN2_MOE, QWEN3_MOE = "mixtral", "qwen2_moe", "qwen3_moe"
MOE_MODEL_TYPES = (MIXTRAL, QWEN2_MOE, QWEN3_MOE)
PER_EXPERT, STACKED = "per_expert", "stacked"


def num_experts_of(hf_config) -> int:
    value = getattr(hf_config, "num_local_experts", None)
    return value if value is not None else hf_config.num_experts


def moe_layer_pattern(hf_config) -> List[int]:
    """1 (MoE) or 0 (dense MLP) per layer, as HF's Qwen-MoE decides: layer i has experts
    unless listed in mlp_only_layers, and only every decoder_sparse_step-th ((i + 1) % step
    == 0). Mixtral: every layer."""
    layers = hf_config.num_hidden_layers
    if hf_config.model_type == MIXTRAL:
        return [1] * layers
    step = getattr(hf_config, "decoder_sparse_step", 1) or 1
    dense = set(getattr(hf_config, "mlp_only_layers", None) or [])
    return [int(i not in dense and (i + 1) % step == 0) for i in range(layers)]


def _refuse_unsupported(hf_config) -> None:
    kind = hf_config.model_type
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
    if not any(pattern):
        return out
    shared = getattr(hf_config, "shared_expert_intermediate_size", None) or None
    out["moe"] = MoEConfig(
        num_moe_experts=num_experts_of(hf_config),
        moe_ffn_hidden_size=(hf_config.intermediate_size if kind == MIXTRAL
                             else hf_config.moe_intermediate_size),
        moe_router_topk=hf_config.num_experts_per_tok,
        # Mixtral: top-k of the logits, softmax over the k (Megatron's default). Qwen: softmax
        # over all experts, top-k, renormalised only with norm_topk_prob.
        moe_router_pre_softmax=kind != MIXTRAL,
        moe_router_topk_norm=kind != MIXTRAL and bool(getattr(hf_config, "norm_topk_prob",
                                                              False)),
        moe_router_load_balancing_type="aux_loss",
        moe_aux_loss_coeff=float(getattr(hf_config, "router_aux_loss_coef", 0.0) or 0.0),
        moe_shared_expert_intermediate_size=shared,
        moe_shared_expert_gate=shared is not None,
        moe_layer_freq=1 if all(pattern) else pattern)
    return out


def hf_moe_config_fields(config, model_type: str) -> dict:
    """HF config fields (beyond LLaMA's) that describe ``config``'s MoE and attention."""
    moe = config.moe
    pattern = ([1] * config.num_layers if moe is None else
               [int(moe.is_moe_layer(i + 1)) for i in range(config.num_layers)])
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
    shared = src + "mlp.shared_expert."
    if shared + "gate_proj.weight" in hf:
        out[dst + "mlp.shared_experts.linear_fc1.weight"] = _gated(
            hf[shared + "gate_proj.weight"], hf[shared + "up_proj.weight"])
        out[dst + "mlp.shared_experts.linear_fc2.weight"] = hf[shared + "down_proj.weight"]
        out[dst + "mlp.shared_experts.gate_weight"] = hf[src + "mlp.shared_expert_gate.weight"]
    return out


def moe_layer_to_hf(state: Dict[str, torch.Tensor], src: str, dst: str, model_type: str,
                    layout: str = PER_EXPERT) -> Dict[str, torch.Tensor]:
    """Inverse of moe_layer_from_hf: ours under ``src`` -> HF names under ``dst`` in
    ``layout`` (PER_EXPERT: what checkpoints on disk hold; STACKED: transformers 5's
    modules)."""
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
        shared = dst + "mlp.shared_expert."
        out[shared + "gate_proj.weight"], out[shared + "up_proj.weight"] = fc1.chunk(2)
        out[shared + "down_proj.weight"] = state[src + "mlp.shared_experts.linear_fc2.weight"]
        out[dst + "mlp.shared_expert_gate.weight"] = state[src + "mlp.shared_experts.gate_weight"]
    return out


def expert_layout_of(hf_state: Dict[str, torch.Tensor]) -> Optional[str]:
    """STACKED or PER_EXPERT, whichever ``hf_state`` holds (None: no experts)."""
    for name in hf_state:
        if name.endswith("mlp.experts.gate_up_proj"):
            return STACKED
        if ".experts.0." in name:
            return PER_EXPERT
    return None
