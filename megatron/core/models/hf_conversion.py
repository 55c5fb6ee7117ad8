"""Hugging Face <-> this project: configs and full (unsharded) state dicts.

Supported: ``LlamaForCausalLM`` (LLaMA 1/2/3: GQA, rope theta, LLaMA-3 or YaRN rope scaling,
tied or untied embeddings; Mistral shares the layout, Qwen2 adds q/k/v biases, Qwen3 per-head
q/k RMSNorms and a head dim of its own), ``GPT2LMHeadModel``, and the LLaMA-like MoE
models of ``hf_moe_conversion`` (Mixtral, Qwen2-MoE, Qwen3-MoE, gpt-oss, DeepSeek-V3).
Combine with ``tp_sharding``
for a TP rank's or a pipeline stage's share.
"""
from typing import Dict, Tuple

import torch

from megatron.core.models import hf_moe_conversion as moe_hf
from megatron.core.transformer.transformer_config import TransformerConfig

LLAMA, GPT2, QWEN2, QWEN3 = "llama", "gpt2", "qwen2", "qwen3"
_GPT2_ACTIVATIONS = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu"}


def architecture_of(hf_config) -> str:
    model_type = getattr(hf_config, "model_type", None)
    if model_type in ("llama", "mistral", QWEN2, QWEN3):  # LLaMA's layout, + q/k/v biases
        return LLAMA                                          # (Qwen2), + q/k norms (Qwen3)
    if model_type == "gpt2":
        return GPT2
    if model_type in moe_hf.MOE_MODEL_TYPES:
        return model_type
    raise ValueError(f"unsupported Hugging Face model_type {model_type!r}; supported: llama, "
                     f"mistral, qwen2, qwen3, gpt2, {', '.join(moe_hf.MOE_MODEL_TYPES)}.")


def _llama_like(arch: str) -> bool:
    return arch != GPT2


def _rope_settings(hf_config) -> dict:
    """Rope theta and scaling from either transformers' old (rope_theta, rope_scaling) or new
    (rope_parameters) config fields."""
    params = dict(getattr(hf_config, "rope_parameters", None) or {})
    scaling = getattr(hf_config, "rope_scaling", None) or params
    theta = getattr(hf_config, "rope_theta", None) or params.get("rope_theta", 10000.0)
    out = {"rotary_base": float(theta)}
    rope_type = (scaling or {}).get("rope_type", scaling.get("type") if scaling else None)
    if rope_type in (None, "default"):
        return out
    if rope_type == "yarn":
        return {**out, **_yarn_settings(scaling, hf_config.max_position_embeddings)}
    if rope_type != "llama3":
        raise ValueError(f"rope scaling type {rope_type!r} is not supported (only 'llama3' "
                         f"and 'yarn').")
    out.update(rope_scaling_factor=float(scaling["factor"]),
               rope_low_freq_factor=float(scaling["low_freq_factor"]),
               rope_high_freq_factor=float(scaling["high_freq_factor"]),
               rope_original_max_position_embeddings=int(
                   scaling["original_max_position_embeddings"]))
    return out


def _yarn_settings(scaling: dict, max_positions: int) -> dict:
    """HF's yarn rope parameters as TransformerConfig fields, HF's defaults filled in: the
    factor max_positions / original when unset, beta_fast 32 and beta_slow 1 when unset or 0."""
    original = int(scaling["original_max_position_embeddings"])
    factor = scaling.get("factor")
    if factor is None:
        factor = max_positions / original
    mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim") or 0.0
    if mscale is None:
        # HF takes the mscale ratio only when both are set: with mscale_all_dim alone, an
        # unset mscale must be 0 (not our default 1), so that the same rule skips it here too.
        mscale = 0.0 if mscale_all_dim else 1.0
    attention_factor = scaling.get("attention_factor")
    return dict(rope_type="yarn", rotary_scaling_factor=float(factor),
                original_max_position_embeddings=original,
                beta_fast=float(scaling.get("beta_fast") or 32.0),
                beta_slow=float(scaling.get("beta_slow") or 1.0),
                mscale=float(mscale), mscale_all_dim=float(mscale_all_dim),
                yarn_truncate=bool(scaling.get("truncate", True)),
                yarn_attention_factor=None if attention_factor is None
                else float(attention_factor))


def config_from_hf(hf_config, **overrides) -> Tuple[TransformerConfig, dict]:
    """(TransformerConfig, model kwargs: vocab_size, share_embeddings_and_output_weights)."""
    arch = architecture_of(hf_config)
    if _llama_like(arch):
        biased = getattr(hf_config, "attention_bias", False) and arch != moe_hf.GPT_OSS
        if biased or getattr(hf_config, "mlp_bias", False):
            raise ValueError("LLaMA checkpoints with attention_bias or mlp_bias are not "
                             "supported.")
        heads = hf_config.num_attention_heads
        head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads
        kwargs = dict(
            num_layers=hf_config.num_hidden_layers, hidden_size=hf_config.hidden_size,
            num_attention_heads=heads, ffn_hidden_size=hf_config.intermediate_size,
            num_query_groups=getattr(hf_config, "num_key_value_heads", None) or heads,
            kv_channels=head_dim, normalization="RMSNorm",
            layernorm_epsilon=hf_config.rms_norm_eps, activation="swiglu",
            add_bias_linear=False, position_embedding_type="rope",
            max_position_embeddings=hf_config.max_position_embeddings,
            attention_dropout=float(getattr(hf_config, "attention_dropout", 0.0)),
            hidden_dropout=0.0, scaled_output_init=False,
            init_method_std=getattr(hf_config, "initializer_range", 0.02),
            **_rope_settings(hf_config))
        if getattr(hf_config, "model_type", None) == QWEN2:
            kwargs["add_qkv_bias"] = True
        if getattr(hf_config, "model_type", None) == QWEN3:
            kwargs["qk_layernorm"] = True
        if getattr(hf_config, "use_sliding_window", False) and \
                getattr(hf_config, "model_type", None) == QWEN3:
            raise ValueError("sliding-window attention (use_sliding_window) is not supported "
                             "yet.")
        window = getattr(hf_config, "sliding_window", None)
        if getattr(hf_config, "model_type", None) == "mistral" and window is not None:
            # HF keeps keys j with i - j < sliding_window: ours sees i - W .. i, W = S - 1.
            kwargs["window_size"] = (int(window) - 1, 0)
        if arch in moe_hf.MOE_MODEL_TYPES:
            kwargs.update(moe_hf.moe_transformer_kwargs(hf_config))
        tied = bool(getattr(hf_config, "tie_word_embeddings", False))
    else:
        if getattr(hf_config, "scale_attn_by_inverse_layer_idx", False) or \
                getattr(hf_config, "reorder_and_upcast_attn", False):
            raise ValueError("GPT-2 variants with scale_attn_by_inverse_layer_idx or "
                             "reorder_and_upcast_attn are not supported.")
        activation = _GPT2_ACTIVATIONS.get(hf_config.activation_function)
        if activation is None:
            raise ValueError(f"GPT-2 activation {hf_config.activation_function!r} is not "
                             f"supported; use one of {sorted(_GPT2_ACTIVATIONS)}.")
        kwargs = dict(
            num_layers=hf_config.n_layer, hidden_size=hf_config.n_embd,
            num_attention_heads=hf_config.n_head,
            ffn_hidden_size=hf_config.n_inner or 4 * hf_config.n_embd,
            normalization="LayerNorm", layernorm_epsilon=hf_config.layer_norm_epsilon,
            activation=activation, add_bias_linear=True,
            position_embedding_type="learned_absolute",
            max_position_embeddings=hf_config.n_positions,
            attention_dropout=hf_config.attn_pdrop, hidden_dropout=hf_config.resid_pdrop,
            init_method_std=hf_config.initializer_range)
        tied = True
    kwargs.update(overrides)
    return TransformerConfig(**kwargs), {"vocab_size": hf_config.vocab_size,
                                         "share_embeddings_and_output_weights": tied}


def _fuse_qkv(q, k, v, groups):
    """[q; k; v] rows (HF) -> per query group [q heads of g; k_g; v_g] rows (ours)."""
    shape = q.shape[1:]
    q, k, v = (t.reshape(groups, -1, *shape) for t in (q, k, v))
    return torch.cat([q, k, v], dim=1).reshape(-1, *shape)


def _split_qkv(qkv, config: TransformerConfig):
    groups, d = config.num_query_groups, config.kv_channels
    per_group_q = config.num_attention_heads // groups * d
    grouped = qkv.reshape(groups, per_group_q + 2 * d, *qkv.shape[1:])
    q, k, v = grouped.split([per_group_q, d, d], dim=1)
    return (t.reshape(-1, *qkv.shape[1:]) for t in (q, k, v))


def _pad_rows(t, rows):
    if t.shape[0] == rows:
        return t
    if t.shape[0] > rows:
        raise ValueError(f"vocabulary of {t.shape[0]} rows does not fit in {rows}.")
    return torch.cat([t, t.new_zeros(rows - t.shape[0], *t.shape[1:])])


# Parameters copied one to one: (our name, HF name, HF stores it transposed). GPT-2's Conv1D
# keeps weights as [in, out], ours (nn.Linear) as [out, in]. Layer entries are suffixes.
_ONE_TO_ONE = {
    LLAMA: {
        "layer": [("input_layernorm.weight", "input_layernorm.weight", False),
                  ("self_attention.linear_proj.weight", "self_attn.o_proj.weight", False),
                  ("pre_mlp_layernorm.weight", "post_attention_layernorm.weight", False),
                  ("mlp.linear_fc2.weight", "mlp.down_proj.weight", False)],
        "global": [("decoder.final_layernorm.weight", "model.norm.weight", False)],
    },
    GPT2: {
        "layer": [(f"{ours}.{kind}", f"{theirs}.{kind}", kind == "weight" and linear)
                  for ours, theirs, linear in (
                      ("self_attention.linear_proj", "attn.c_proj", True),
                      ("mlp.linear_fc1", "mlp.c_fc", True),
                      ("mlp.linear_fc2", "mlp.c_proj", True),
                      ("input_layernorm", "ln_1", False),
                      ("pre_mlp_layernorm", "ln_2", False))
                  for kind in ("weight", "bias")],
        "global": [("embedding.position_embeddings.weight", "transformer.wpe.weight", False),
                   ("decoder.final_layernorm.weight", "transformer.ln_f.weight", False),
                   ("decoder.final_layernorm.bias", "transformer.ln_f.bias", False)],
    },
}
_HF_LAYER_PREFIX = {LLAMA: "model.layers.{}.", GPT2: "transformer.h.{}."}
_HF_EMBEDDING = {LLAMA: "model.embed_tokens.weight", GPT2: "transformer.wte.weight"}


_QK_NORMS = [("self_attention.q_layernorm.weight", "self_attn.q_norm.weight", False),
             ("self_attention.k_layernorm.weight", "self_attn.k_norm.weight", False)]


def _one_to_one_pairs(arch: str, config: TransformerConfig):
    """(our name, HF name, transposed) for every one-to-one parameter of the model (the MoE
    models' MLPs are mapped layer by layer: _mlp_from_hf)."""
    family = arch if arch == GPT2 else LLAMA
    pairs = list(_ONE_TO_ONE[family]["global"])
    layer = [p for p in _ONE_TO_ONE[family]["layer"]
             if arch in (LLAMA, GPT2) or not p[0].startswith("mlp.")]
    # (under multi-latent attention qk_layernorm means the latents' norms: mapped with it)
    layer += _QK_NORMS if config.qk_layernorm and not config.multi_latent_attention else []
    for i in range(config.num_layers):
        theirs = _HF_LAYER_PREFIX[family].format(i)
        pairs += [(f"decoder.layers.{i}.{o}", theirs + t, tr) for o, t, tr in layer]
    return pairs


def _is_moe_layer(config: TransformerConfig, index: int) -> bool:
    return config.moe is not None and config.moe.is_moe_layer(index + 1)


def _mlp_from_hf(hf_state, i: int, src: str, dst: str, arch: str, config: TransformerConfig,
                 hf_config) -> Dict[str, torch.Tensor]:
    if _is_moe_layer(config, i):
        return moe_hf.moe_layer_from_hf(hf_state, src, dst, arch,
                                        moe_hf.num_experts_of(hf_config))
    out = {dst + "mlp.linear_fc1.weight": torch.cat(
        [hf_state[src + "mlp.gate_proj.weight"], hf_state[src + "mlp.up_proj.weight"]])}
    if arch != LLAMA:  # LLaMA's fc2 is one of the one-to-one pairs
        out[dst + "mlp.linear_fc2.weight"] = hf_state[src + "mlp.down_proj.weight"]
    return out


def _mlp_to_hf(state, i: int, src: str, dst: str, arch: str, config: TransformerConfig,
               expert_layout: str) -> Dict[str, torch.Tensor]:
    if _is_moe_layer(config, i):
        return moe_hf.moe_layer_to_hf(state, src, dst, arch, expert_layout)
    gate, up = state[src + "mlp.linear_fc1.weight"].chunk(2)
    out = {dst + "mlp.gate_proj.weight": gate, dst + "mlp.up_proj.weight": up}
    if arch != LLAMA:
        out[dst + "mlp.down_proj.weight"] = state[src + "mlp.linear_fc2.weight"]
    return out


def hf_to_megatron(hf_state: Dict[str, torch.Tensor], hf_config,
                   padded_vocab_size: int = None) -> Dict[str, torch.Tensor]:
    """A HF state dict -> our full state dict (all layers, unsharded, vocab padded)."""
    arch = architecture_of(hf_config)
    config, model_kwargs = config_from_hf(hf_config)
    rows = padded_vocab_size or model_kwargs["vocab_size"]
    out = {ours: hf_state[theirs].t() if transposed else hf_state[theirs]
           for ours, theirs, transposed in _one_to_one_pairs(arch, config)}
    family = GPT2 if arch == GPT2 else LLAMA
    out["embedding.word_embeddings.weight"] = _pad_rows(hf_state[_HF_EMBEDDING[family]], rows)
    for i in range(config.num_layers):
        src, dst = _HF_LAYER_PREFIX[family].format(i), f"decoder.layers.{i}."
        if family == LLAMA:
            if config.multi_latent_attention:  # DeepSeek-V3: one to one, no fused QKV
                out.update({f"{dst}self_attention.{ours}": hf_state[f"{src}self_attn.{theirs}"]
                            for ours, theirs in moe_hf.mla_names(config.q_lora_rank).items()})
            else:
                for kind in ("weight", "bias") if config.add_qkv_bias else ("weight",):
                    out[dst + f"self_attention.linear_qkv.{kind}"] = _fuse_qkv(
                        *(hf_state[f"{src}self_attn.{x}_proj.{kind}"] for x in "qkv"),
                        config.num_query_groups)
            out.update(_mlp_from_hf(hf_state, i, src, dst, arch, config, hf_config))
        else:
            heads = config.num_attention_heads
            out[dst + "self_attention.linear_qkv.weight"] = _fuse_qkv(
                *hf_state[src + "attn.c_attn.weight"].t().chunk(3), heads)
            out[dst + "self_attention.linear_qkv.bias"] = _fuse_qkv(
                *hf_state[src + "attn.c_attn.bias"].chunk(3), heads)
    if not model_kwargs["share_embeddings_and_output_weights"]:
        out["output_layer.weight"] = _pad_rows(hf_state["lm_head.weight"], rows)
    return {k: v.detach().clone().contiguous() for k, v in out.items()}


def megatron_to_hf(state: Dict[str, torch.Tensor], hf_config,
                   expert_layout: str = moe_hf.PER_EXPERT) -> Dict[str, torch.Tensor]:
    """Our full state dict -> a HF state dict (vocab padding dropped); MoE experts in
    ``expert_layout`` (per expert: the on-disk layout every transformers version loads)."""
    arch = architecture_of(hf_config)
    config, model_kwargs = config_from_hf(hf_config)
    vocab = model_kwargs["vocab_size"]
    out = {theirs: state[ours].t() if transposed else state[ours]
           for ours, theirs, transposed in _one_to_one_pairs(arch, config)}
    family = GPT2 if arch == GPT2 else LLAMA
    embedding = state["embedding.word_embeddings.weight"][:vocab]
    out[_HF_EMBEDDING[family]] = embedding
    for i in range(config.num_layers):
        src, dst = f"decoder.layers.{i}.", _HF_LAYER_PREFIX[family].format(i)
        if config.multi_latent_attention:
            out.update({f"{dst}self_attn.{theirs}": state[f"{src}self_attention.{ours}"]
                        for ours, theirs in moe_hf.mla_names(config.q_lora_rank).items()})
            out.update(_mlp_to_hf(state, i, src, dst, arch, config, expert_layout))
            continue
        q, k, v = _split_qkv(state[src + "self_attention.linear_qkv.weight"], config)
        if family == LLAMA:
            out.update({dst + "self_attn.q_proj.weight": q, dst + "self_attn.k_proj.weight": k,
                        dst + "self_attn.v_proj.weight": v})
            if config.add_qkv_bias:
                biases = _split_qkv(state[src + "self_attention.linear_qkv.bias"], config)
                out.update({dst + f"self_attn.{x}_proj.bias": t for x, t in zip("qkv", biases)})
            out.update(_mlp_to_hf(state, i, src, dst, arch, config, expert_layout))
        else:
            out[dst + "attn.c_attn.weight"] = torch.cat([q, k, v]).t()
            out[dst + "attn.c_attn.bias"] = torch.cat(
                list(_split_qkv(state[src + "self_attention.linear_qkv.bias"], config)))
    tied = model_kwargs["share_embeddings_and_output_weights"]
    out["lm_head.weight"] = embedding if tied else state["output_layer.weight"][:vocab]
    return {k: v.detach().clone().contiguous() for k, v in out.items()}
