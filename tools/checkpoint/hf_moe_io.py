"""Hugging Face weight names of the MoE models (Mixtral, Qwen2-MoE, Qwen3-MoE, gpt-oss,
DeepSeek-V3) for hf_io: the names a checkpoint must hold (experts per expert, as on disk;
gpt-oss's stacked, its only layout), and transformers 5's stacked expert layout
(``mlp.experts.gate_up_proj`` / ``down_proj``) rewritten to those names."""
import re
from typing import Dict, List

import torch

from megatron.core.models import hf_moe_conversion as moe_hf

_STACKED = re.compile(r"^(model\.layers\.\d+\.)mlp\.experts\.gate_up_proj$")


def is_moe(model_type: str) -> bool:
    return model_type in moe_hf.MOE_MODEL_TYPES


_GPT_OSS_LAYER = ["mlp.router.weight", "mlp.router.bias"] + [
    f"mlp.experts.{w}" for w in ("gate_up_proj", "gate_up_proj_bias", "down_proj",
                                 "down_proj_bias")]


def _attention_names(config) -> List[str]:
    names = [f"self_attn.{x}_proj.weight" for x in "qkvo"]
    if config.model_type == moe_hf.GPT_OSS:
        return names + [f"self_attn.{x}_proj.bias" for x in "qkvo"] + ["self_attn.sinks"]
    if config.model_type == moe_hf.DEEPSEEK_V3:  # multi-latent attention: no q/k/v
        return ["self_attn.o_proj.weight"] + [
            f"self_attn.{theirs}" for theirs in moe_hf.mla_names(config.q_lora_rank).values()]
    if config.model_type == moe_hf.QWEN2_MOE and getattr(config, "qkv_bias", True):
        names += [f"self_attn.{x}_proj.bias" for x in "qkv"]
    if config.model_type == moe_hf.QWEN3_MOE:
        names += ["self_attn.q_norm.weight", "self_attn.k_norm.weight"]
    return names


def _moe_mlp_names(config) -> List[str]:
    if config.model_type == moe_hf.GPT_OSS:
        return list(_GPT_OSS_LAYER)
    prefix, (g, u, d), router = moe_hf._expert_names(config.model_type)
    names = [router]
    for e in range(moe_hf.num_experts_of(config)):
        names += [f"{prefix}experts.{e}.{w}.weight" for w in (g, u, d)]
    if config.model_type == moe_hf.DEEPSEEK_V3:  # the routing correction bias; shared
        # experts without a gate
        names.append("mlp.gate.e_score_correction_bias")
        if getattr(config, "n_shared_experts", 0):
            names += [f"mlp.shared_experts.{w}_proj.weight" for w in ("gate", "up", "down")]
        return names
    if getattr(config, "shared_expert_intermediate_size", None):
        names += [f"mlp.shared_expert.{w}_proj.weight" for w in ("gate", "up", "down")]
        names.append("mlp.shared_expert_gate.weight")
    return names


def expected_layer_names(config, layer: int) -> List[str]:
    """The HF names of decoder layer ``layer`` (without the ``model.layers.{i}.`` prefix)."""
    names = ["input_layernorm.weight", "post_attention_layernorm.weight"]
    names += _attention_names(config)
    if moe_hf.moe_layer_pattern(config)[layer]:
        return names + _moe_mlp_names(config)
    return names + [f"mlp.{x}_proj.weight" for x in ("gate", "up", "down")]


def per_expert_weights(state: Dict[str, torch.Tensor], config) -> Dict[str, torch.Tensor]:
    """``state`` with any stacked expert layer (transformers >= 5 in memory) rewritten to the
    per-expert names checkpoints on disk use; other entries unchanged."""
    layers = sorted({m.group(1) for m in map(_STACKED.match, state) if m})
    if not layers or config.model_type == moe_hf.GPT_OSS:
        return state
    out = dict(state)
    experts = moe_hf.num_experts_of(config)
    for src in layers:
        taken = {k: out.pop(k) for k in (src + "mlp.experts.gate_up_proj",
                                         src + "mlp.experts.down_proj", src + "mlp.gate.weight",
                                         src + "mlp.gate.e_score_correction_bias")
                 if k in out}
        ours = moe_hf.moe_layer_from_hf(taken, src, "x.", config.model_type, experts)
        out.update(moe_hf.moe_layer_to_hf(ours, "x.", src, config.model_type))
    return out


def meta_state(state: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """Shape-only copies (no memory), to run a conversion just for its names and shapes."""
    return {k: torch.empty(v.shape, dtype=v.dtype, device="meta") for k, v in state.items()}
