"""The mixture-of-experts part of a checkpoint's args (Megatron's flag names) for the HF MoE
models (Mixtral, Qwen2-MoE, Qwen3-MoE, gpt-oss, DeepSeek-V3): from our TransformerConfig,
back to a HF config, and the launch flags."""
from typing import Dict, List, Optional

from conversion_utils import ConversionError
from megatron.core.models import hf_moe_conversion as moe_hf


def moe_args_from_config(config) -> Dict:
    """Args for ``config``'s MoE (nothing but the attention extras for a dense model)."""
    out = {"qk_layernorm": bool(config.qk_layernorm), "add_qkv_bias": bool(config.add_qkv_bias)}
    moe = config.moe
    if moe is None:
        return out
    out.update(num_experts=moe.num_moe_experts, moe_ffn_hidden_size=moe.moe_ffn_hidden_size,
               moe_router_topk=moe.moe_router_topk,
               moe_router_pre_softmax=moe.moe_router_pre_softmax,
               moe_router_topk_norm=moe.moe_router_topk_norm,
               moe_router_load_balancing_type=moe.moe_router_load_balancing_type,
               moe_aux_loss_coeff=moe.moe_aux_loss_coeff,
               moe_shared_expert_intermediate_size=moe.moe_shared_expert_intermediate_size,
               moe_shared_expert_gate=moe.moe_shared_expert_gate,
               moe_layer_freq=moe.moe_layer_freq, moe_router_bias=moe.moe_router_bias,
               moe_router_score_function=moe.moe_router_score_function,
               moe_router_enable_expert_bias=moe.moe_router_enable_expert_bias,
               moe_router_num_groups=moe.moe_router_num_groups,
               moe_router_group_topk=moe.moe_router_group_topk,
               moe_router_topk_scaling_factor=moe.moe_router_topk_scaling_factor)
    return out


def hf_model_type_of_args(args: Dict) -> Optional[str]:
    """Which HF MoE model a checkpoint's args describe (None: no experts)."""
    if args.get("num_experts") is None:
        return None
    if args.get("moe_router_bias"):  # only gpt-oss's router has a learned bias
        return moe_hf.GPT_OSS
    if args.get("multi_latent_attention"):  # (its qk_layernorm: the latents' norms)
        return moe_hf.DEEPSEEK_V3
    if args.get("qk_layernorm"):
        return moe_hf.QWEN3_MOE
    return moe_hf.QWEN2_MOE if args.get("moe_router_pre_softmax") else moe_hf.MIXTRAL


_ARCHITECTURES = {moe_hf.MIXTRAL: "MixtralForCausalLM",
                  moe_hf.QWEN2_MOE: "Qwen2MoeForCausalLM",
                  moe_hf.QWEN3_MOE: "Qwen3MoeForCausalLM",
                  moe_hf.GPT_OSS: "GptOssForCausalLM",
                  moe_hf.DEEPSEEK_V3: "DeepseekV3ForCausalLM"}


def hf_moe_config(args: Dict, llama_fields: Dict):
    """The transformers config of an MoE checkpoint: LLaMA's fields (``llama_fields``) plus
    the MoE ones, checked by hf_moe_config_fields against the model our config builds."""
    import transformers

    from megatron.core.transformer.transformer_config import TransformerConfig
    from megatron.training.arguments.moe import moe_config_from_args

    kind = hf_model_type_of_args(args)

    class _Args:  # moe_config_from_args reads attributes
        pass

    holder = _Args()
    holder.__dict__.update(args)
    gpt_oss = {"activation": "swiglu"}
    if kind == moe_hf.GPT_OSS:
        window = args.get("window_size")
        gpt_oss = dict(activation="quick_geglu", glu_linear_offset=args["glu_linear_offset"],
                       activation_func_clamp_value=args["activation_func_clamp_value"],
                       softmax_type=args.get("softmax_type", "vanilla"),
                       window_size=None if window is None else tuple(window),
                       window_attn_skip_freq=args.get("window_attn_skip_freq"))
    latent = _latent_attention_fields(args)
    ours = TransformerConfig(
        num_layers=args["num_layers"], hidden_size=args["hidden_size"],
        num_attention_heads=args["num_attention_heads"],
        ffn_hidden_size=args["ffn_hidden_size"],
        # MLA derives its head dim (a run without --kv-channels records none)
        kv_channels=None if latent else llama_fields["head_dim"],
        normalization="RMSNorm", add_bias_linear=not args["disable_bias_linear"],
        add_qkv_bias=bool(args.get("add_qkv_bias")), qk_layernorm=bool(args.get("qk_layernorm")),
        moe=moe_config_from_args(holder), **gpt_oss, **latent)
    # rope_scaling is kept: the MoE families read rope_parameters as LLaMA does (YaRN too).
    # DeepSeek-V3's head_dim is its rotated channels, which its config sets itself.
    drop = ("attention_bias", "mlp_bias") + (("head_dim",) if latent else ())
    fields = {k: v for k, v in llama_fields.items() if k not in drop}
    try:
        fields.update(moe_hf.hf_moe_config_fields(ours, kind))
    except ValueError as exc:
        raise ConversionError(f"this checkpoint's model has no Hugging Face equivalent: "
                              f"{exc}") from None
    cls = {moe_hf.MIXTRAL: transformers.MixtralConfig,
           moe_hf.QWEN2_MOE: transformers.Qwen2MoeConfig,
           moe_hf.QWEN3_MOE: transformers.Qwen3MoeConfig,
           moe_hf.GPT_OSS: transformers.GptOssConfig,
           moe_hf.DEEPSEEK_V3: transformers.DeepseekV3Config}[kind]
    config = cls(**fields)
    config.architectures = [_ARCHITECTURES[kind]]
    return config


def _latent_attention_fields(args: Dict) -> Dict:
    """The TransformerConfig fields of multi-latent attention (DeepSeek-V3) in ``args``."""
    if not args.get("multi_latent_attention"):
        return {}
    eps = moe_hf._HF_LATENT_NORM_EPS
    if args["norm_epsilon"] != eps:  # HF's latent norms keep their own epsilon
        raise ConversionError(f"this checkpoint's model has multi-latent attention and "
                              f"--norm-epsilon {args['norm_epsilon']}: DeepseekV3ForCausalLM's "
                              f"latent norms use {eps} whatever its rms_norm_eps, so only "
                              f"models trained with --norm-epsilon {eps} convert.")
    return dict(multi_latent_attention=True, position_embedding_type="rope",
                **{k: args[k] for k in ("q_lora_rank", "kv_lora_rank", "qk_head_dim",
                                        "qk_pos_emb_head_dim", "v_head_dim",
                                        "rotary_interleaved")})


def moe_flags(args: Dict) -> List[str]:
    """Launch flags of the MoE settings (and the layout's expert-parallel sizes)."""
    flags = ["--qk-layernorm"] if args.get("qk_layernorm") else []
    if args.get("num_experts") is None:
        return flags
    freq = args["moe_layer_freq"]
    flags += [f"--num-experts {args['num_experts']} --moe-ffn-hidden-size "
              f"{args['moe_ffn_hidden_size']} --moe-router-topk {args['moe_router_topk']}",
              f"--moe-layer-freq {freq if isinstance(freq, int) else str(freq).replace(' ', '')}",
              f"--moe-router-load-balancing-type {args['moe_router_load_balancing_type']} "
              f"--moe-aux-loss-coeff {args['moe_aux_loss_coeff']!r}"]
    if args.get("moe_router_score_function", "softmax") != "softmax":
        flags.append(f"--moe-router-score-function {args['moe_router_score_function']}")
    flags += [flag for flag, on in (("--moe-router-pre-softmax", args["moe_router_pre_softmax"]),
                                    ("--moe-router-topk-norm", args["moe_router_topk_norm"]),
                                    ("--moe-router-bias", args.get("moe_router_bias")),
                                    ("--moe-router-enable-expert-bias",
                                     args.get("moe_router_enable_expert_bias")),
                                    ("--moe-shared-expert-gate", args["moe_shared_expert_gate"]))
              if on]
    if args.get("moe_router_num_groups") is not None:  # group-limited routing (a pair)
        flags.append(f"--moe-router-num-groups {args['moe_router_num_groups']} "
                     f"--moe-router-group-topk {args['moe_router_group_topk']}")
    if args.get("moe_router_topk_scaling_factor") is not None:
        flags.append(f"--moe-router-topk-scaling-factor "
                     f"{args['moe_router_topk_scaling_factor']!r}")
    if args.get("moe_shared_expert_intermediate_size"):
        flags.append(f"--moe-shared-expert-intermediate-size "
                     f"{args['moe_shared_expert_intermediate_size']}")
    if args.get("expert_model_parallel_size", 1) > 1:
        flags.append(f"--expert-model-parallel-size {args['expert_model_parallel_size']}")
    etp = args.get("expert_tensor_parallel_size")
    if etp is not None and etp != args["tensor_model_parallel_size"]:
        flags.append(f"--expert-tensor-parallel-size {etp}")
    if args["tensor_model_parallel_size"] > 1:  # MoE with TP needs it (Megatron's rule)
        flags.append("--sequence-parallel")
    return flags


def check_expert_target(args: Dict, tp: int, ep: int, etp: Optional[int]) -> None:
    """ConversionError unless the experts cut into EP x expert TP (expert TP default: TP)."""
    if args.get("num_experts") is None:
        if ep != 1 or etp not in (None, 1):
            raise ConversionError("--expert-model-parallel-size / --expert-tensor-parallel-size "
                                  "need a model with experts.")
        return
    experts, ffn = args["num_experts"], args["moe_ffn_hidden_size"]
    if ep < 1 or experts % ep:
        raise ConversionError(f"--expert-model-parallel-size {ep} does not divide the model's "
                              f"{experts} experts.")
    if ffn % (etp or tp):
        raise ConversionError(f"the expert tensor-parallel size {etp or tp} does not divide "
                              f"the experts' FFN hidden size {ffn}.")
    shared = args.get("moe_shared_expert_intermediate_size")
    if shared and shared % tp:
        raise ConversionError(f"--tensor-model-parallel-size {tp} does not divide the shared "
                              f"expert's FFN hidden size {shared}.")


def expert_layout_args(args: Dict, ep: int, etp: Optional[int]) -> Dict:
    """``args`` with the expert layout (and sequence parallelism, which MoE with TP needs)."""
    if args.get("num_experts") is None:
        return args
    return {**args, "expert_model_parallel_size": ep, "expert_tensor_parallel_size": etp,
            "sequence_parallel": args["tensor_model_parallel_size"] > 1}
