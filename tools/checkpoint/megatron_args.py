"""Hugging Face configs <-> the ``args`` a Megatron checkpoint records (``vars(args)`` of
megatron/training/arguments/: argparse dest names), and the launch flags that rebuild the
same model. A checkpoint's args start from the parser's defaults, so a reader can rebuild the
model from ``{**parser defaults, **saved args}`` alone."""
from typing import Dict, List, Optional

import megatron_moe_args
from conversion_utils import ConversionError
from megatron.core.models import hf_moe_conversion as moe_hf
from megatron.core.models.hf_conversion import GPT2, LLAMA, config_from_hf
from megatron.training.arguments import get_parser
from megatron.training.tokenizer.vocab_padding import check_splits_over_tensor_parallel

DEFAULT_MAX_SEQ_LENGTH = 4096  # --seq-length recorded when HF allows longer (LLaMA-3.1: 128K)


def parser_defaults() -> Dict:
    return vars(get_parser().parse_args([]))


def check_target(num_layers: int, heads: int, groups: int, ffn_hidden_size: int, tp: int,
                 pp: int, layers_per_virtual_stage: Optional[int]) -> Optional[int]:
    """ConversionError unless the model cuts into this layout; returns the number of virtual
    stages per pipeline rank (None without interleaving)."""
    if tp < 1 or pp < 1:
        raise ConversionError("--tensor-model-parallel-size and --pipeline-model-parallel-size "
                              "must be >= 1.")
    if heads % tp:
        raise ConversionError(f"--tensor-model-parallel-size {tp} does not divide the model's "
                              f"{heads} attention heads; choose a divisor of {heads}.")
    if groups % tp:
        raise ConversionError(f"--tensor-model-parallel-size {tp} does not divide the model's "
                              f"{groups} query groups (key/value heads); choose a divisor of "
                              f"{groups}.")
    if ffn_hidden_size % tp:
        raise ConversionError(f"--tensor-model-parallel-size {tp} does not divide the model's "
                              f"FFN hidden size {ffn_hidden_size}.")
    if num_layers % pp:
        raise ConversionError(f"--pipeline-model-parallel-size {pp} does not divide the "
                              f"model's {num_layers} layers.")
    if layers_per_virtual_stage is None:
        return None
    if pp < 2:
        raise ConversionError("--num-layers-per-virtual-pipeline-stage needs "
                              "--pipeline-model-parallel-size > 1.")
    if layers_per_virtual_stage < 1 or num_layers % (pp * layers_per_virtual_stage):
        raise ConversionError(
            f"the model's {num_layers} layers do not split into --pipeline-model-parallel-size "
            f"{pp} x --num-layers-per-virtual-pipeline-stage {layers_per_virtual_stage}.")
    vpp = num_layers // (pp * layers_per_virtual_stage)
    return vpp if vpp > 1 else None


def layout_args(args: Dict, tp: int, pp: int, layers_per_virtual_stage: Optional[int],
                vpp: Optional[int], divisible_by: int,
                padded_vocab_size: Optional[int] = None) -> Dict:
    """``args`` with the parallel layout replaced; ``padded_vocab_size`` is the
    --padded-vocab-size flag (None: padded as training pads for the layout)."""
    return {**args, "tensor_model_parallel_size": tp, "pipeline_model_parallel_size": pp,
            "num_layers_per_virtual_pipeline_stage": layers_per_virtual_stage if vpp else None,
            "num_virtual_stages_per_pipeline_rank": None,
            "virtual_pipeline_model_parallel_size": vpp,
            "decoder_first_pipeline_num_layers": None, "decoder_last_pipeline_num_layers": None,
            "account_for_embedding_in_pipeline_split": False,
            "account_for_loss_in_pipeline_split": False,
            "make_vocab_size_divisible_by": divisible_by,
            "padded_vocab_size": padded_vocab_size}


def explicit_padding(rows: int, tokens: Optional[int], tp: int) -> Optional[int]:
    """--padded-vocab-size for a model of ``rows`` embedding rows and a ``tokens``-token
    tokenizer: ``rows`` when its authors padded it (Qwen), so training keeps every row; None
    when the tokenizer fills it (or is unknown). ConversionError when TP cannot split it."""
    if tokens is None or tokens >= rows:
        return None
    try:
        check_splits_over_tensor_parallel(rows, tp)
    except ValueError:
        raise ConversionError(f"the model's {rows} embedding rows (for {tokens} tokens) do not "
                              f"split evenly over --tensor-model-parallel-size {tp}; choose a "
                              f"tensor-parallel size that divides {rows}.") from None
    return rows


def saved_explicit_padding(args: Dict, rows: int) -> Optional[int]:
    """A checkpoint's --padded-vocab-size: its args' value when it is the rows the checkpoint
    keeps (older checkpoints record the derived padding there, never equal to those rows
    unless no padding was needed)."""
    value = args.get("padded_vocab_size")
    return rows if value == rows else None


def args_from_hf(hf_config, tokenizer_dir: Optional[str],
                 seq_length: Optional[int] = None) -> Dict:
    """The args of a checkpoint holding ``hf_config``'s model (layout fields: ``layout_args``)."""
    try:
        config, model_kwargs = config_from_hf(hf_config)
    except ValueError as exc:
        raise ConversionError(f"unsupported model: {exc}") from None
    heads, groups = config.num_attention_heads, config.num_query_groups
    gqa = groups != heads
    scaling = config.rope_scaling_factor is not None
    args = parser_defaults()
    args.update(
        num_layers=config.num_layers, hidden_size=config.hidden_size,
        ffn_hidden_size=config.ffn_hidden_size, num_attention_heads=heads,
        group_query_attention=gqa, num_query_groups=groups if gqa else 1,
        kv_channels=config.kv_channels, max_position_embeddings=config.max_position_embeddings,
        seq_length=seq_length or min(config.max_position_embeddings, DEFAULT_MAX_SEQ_LENGTH),
        position_embedding_type=config.position_embedding_type,
        rotary_base=config.rotary_base, rotary_percent=1.0, use_rope_scaling=scaling,
        normalization=config.normalization, norm_epsilon=config.layernorm_epsilon,
        swiglu=config.activation == "swiglu", openai_gelu=config.activation == "gelu_tanh",
        quick_geglu=config.activation == "quick_geglu",
        glu_linear_offset=config.glu_linear_offset,
        activation_func_clamp_value=config.activation_func_clamp_value,
        softmax_type=config.softmax_type,
        disable_bias_linear=not config.add_bias_linear, add_qkv_bias=config.add_qkv_bias,
        untie_embeddings_and_output_weights=not model_kwargs[
            "share_embeddings_and_output_weights"],
        hidden_dropout=config.hidden_dropout, attention_dropout=config.attention_dropout,
        init_method_std=config.init_method_std, vocab_size=model_kwargs["vocab_size"],
        tokenizer_type="PretrainedFromHF" if tokenizer_dir else None,
        tokenizer_name_or_path=tokenizer_dir)
    if config.multi_latent_attention:  # DeepSeek-V3
        args.update(multi_latent_attention=True, q_lora_rank=config.q_lora_rank,
                    kv_lora_rank=config.kv_lora_rank, qk_head_dim=config.qk_head_dim,
                    qk_pos_emb_head_dim=config.qk_pos_emb_head_dim,
                    v_head_dim=config.v_head_dim, rotary_interleaved=config.rotary_interleaved)
    if config.window_size is not None:
        args.update(window_size=list(config.window_size),
                    window_attn_skip_freq=config.window_attn_skip_freq)
    if scaling:
        args.update(rope_scaling_factor=config.rope_scaling_factor,
                    rope_low_freq_factor=config.rope_low_freq_factor,
                    rope_high_freq_factor=config.rope_high_freq_factor,
                    rope_original_max_position_embeddings=(
                        config.rope_original_max_position_embeddings))
    if config.rope_type == "yarn":
        args.update(rope_type="yarn", rotary_scaling_factor=config.rotary_scaling_factor,
                    original_max_position_embeddings=config.original_max_position_embeddings,
                    beta_fast=config.beta_fast, beta_slow=config.beta_slow,
                    mscale=config.mscale, mscale_all_dim=config.mscale_all_dim,
                    yarn_correction_range_round_to_int=config.yarn_truncate,
                    yarn_attention_factor=config.yarn_attention_factor)
    args.update(megatron_moe_args.moe_args_from_config(config))
    return args


def architecture_of_args(args: Dict) -> str:
    """LLAMA or GPT2 for a checkpoint's args (defaults filled in), or ConversionError saying
    which settings have no Hugging Face counterpart here."""
    gated = args["swiglu"] or args.get("quick_geglu")
    arch = LLAMA if gated else GPT2
    if arch == LLAMA:
        wanted = {"normalization": "RMSNorm", "position_embedding_type": "rope",
                  "disable_bias_linear": True, "rotary_percent": 1.0}
        if megatron_moe_args.hf_model_type_of_args(args) == moe_hf.GPT_OSS:
            del wanted["disable_bias_linear"]  # gpt-oss: biases everywhere
    else:
        wanted = {"normalization": "LayerNorm", "position_embedding_type": "learned_absolute",
                  "disable_bias_linear": False, "untie_embeddings_and_output_weights": False}
    wrong = [f"{k}={args[k]!r} (needs {v!r})" for k, v in wanted.items() if args[k] != v]
    if args.get("multi_latent_attention") and args.get("num_experts") is None:
        wrong.append("multi_latent_attention without experts (DeepseekV3ForCausalLM, the one "
                     "model with it here, has MoE layers)")
    if arch == GPT2:
        heads = args["num_attention_heads"]
        if args["group_query_attention"] and args["num_query_groups"] != heads:
            wrong.append(f"num_query_groups={args['num_query_groups']} (GPT-2 has none)")
        if args["kv_channels"] not in (None, args["hidden_size"] // heads):
            wrong.append(f"kv_channels={args['kv_channels']} (GPT-2's is hidden/heads)")
    if wrong:
        name = "LlamaForCausalLM (--swiglu)" if arch == LLAMA else "GPT2LMHeadModel (no --swiglu)"
        raise ConversionError(f"this checkpoint's model has no Hugging Face equivalent: as "
                              f"{name} it has {', '.join(wrong)}.")
    return arch


def hf_config_from_args(args: Dict, vocab_size: int, dtype, token_ids: Dict):
    """A LlamaConfig or GPT2Config (``architectures`` set) for a checkpoint's args."""
    import transformers

    arch = architecture_of_args(args)
    heads, hidden = args["num_attention_heads"], args["hidden_size"]
    max_positions = args["max_position_embeddings"] or args["seq_length"]
    common = dict(vocab_size=vocab_size, initializer_range=args["init_method_std"], **token_ids)
    if arch == LLAMA:
        rope_scaling = None
        if args["use_rope_scaling"]:
            rope_scaling = {"rope_type": "llama3", "factor": args["rope_scaling_factor"],
                            "low_freq_factor": args["rope_low_freq_factor"],
                            "high_freq_factor": args["rope_high_freq_factor"],
                            "original_max_position_embeddings":
                                args["rope_original_max_position_embeddings"]}
        elif args.get("rope_type") == "yarn":  # saved args may predate the flag
            rope_scaling = _yarn_rope_parameters(args)
        llama = dict(
            hidden_size=hidden, intermediate_size=args["ffn_hidden_size"],
            num_hidden_layers=args["num_layers"], num_attention_heads=heads,
            num_key_value_heads=args["num_query_groups"] if args["group_query_attention"]
            else heads, head_dim=args["kv_channels"] or hidden // heads,
            max_position_embeddings=max_positions, rms_norm_eps=args["norm_epsilon"],
            rope_theta=args["rotary_base"], rope_scaling=rope_scaling, hidden_act="silu",
            attention_bias=False, mlp_bias=False, attention_dropout=args["attention_dropout"],
            tie_word_embeddings=not args["untie_embeddings_and_output_weights"], **common)
        if megatron_moe_args.hf_model_type_of_args(args):
            config = megatron_moe_args.hf_moe_config(args, llama)
        elif args.get("window_size"):
            config = _mistral_config(args, llama)
        elif args["add_qkv_bias"]:
            config = _qwen2_config(llama)
        elif args.get("qk_layernorm"):
            config = _qwen3_config(llama)
        else:
            config = transformers.LlamaConfig(**llama)
            config.architectures = ["LlamaForCausalLM"]
    else:
        ffn = args["ffn_hidden_size"] or 4 * hidden
        config = transformers.GPT2Config(
            n_embd=hidden, n_layer=args["num_layers"], n_head=heads, n_positions=max_positions,
            n_inner=None if ffn == 4 * hidden else ffn,
            activation_function="gelu_new" if args["openai_gelu"] else "gelu",
            layer_norm_epsilon=args["norm_epsilon"], resid_pdrop=args["hidden_dropout"],
            embd_pdrop=args["hidden_dropout"], attn_pdrop=args["attention_dropout"],
            tie_word_embeddings=True, **common)
        config.architectures = ["GPT2LMHeadModel"]
    config.dtype = dtype
    return config


def _yarn_rope_parameters(args: Dict) -> Dict:
    """HF's rope_parameters of a YaRN checkpoint (rope_theta is added by the config)."""
    params = {"rope_type": "yarn", "factor": args["rotary_scaling_factor"],
              "original_max_position_embeddings": args["original_max_position_embeddings"],
              "beta_fast": args["beta_fast"], "beta_slow": args["beta_slow"],
              "mscale": args["mscale"], "mscale_all_dim": args["mscale_all_dim"],
              "truncate": args["yarn_correction_range_round_to_int"]}
    if args.get("yarn_attention_factor") is not None:
        params["attention_factor"] = args["yarn_attention_factor"]
    return params


def _llama3_scaling(llama: Dict) -> bool:
    """LLaMA-3 rope scaling, which only LlamaForCausalLM has here (YaRN: all the families)."""
    return bool(llama["rope_scaling"]) and llama["rope_scaling"]["rope_type"] == "llama3"


def _rope_parameters(llama: Dict) -> Dict:
    return {**(llama["rope_scaling"] or {"rope_type": "default"}),
            "rope_theta": llama["rope_theta"]}


def _qwen2_config(llama: Dict):
    """LLaMA with q/k/v biases is Qwen2 (head_dim hidden/heads, rope plain or YaRN)."""
    import transformers

    heads = llama["num_attention_heads"]
    if llama["head_dim"] != llama["hidden_size"] // heads or _llama3_scaling(llama):
        raise ConversionError("this checkpoint's model has q/k/v biases (Qwen2) but "
                              f"kv_channels {llama['head_dim']} or LLaMA-3 rope scaling, "
                              f"which Qwen2ForCausalLM does not have.")
    drop = ("head_dim", "rope_scaling", "rope_theta", "attention_bias", "mlp_bias")
    config = transformers.Qwen2Config(**{k: v for k, v in llama.items() if k not in drop},
                                      rope_parameters=_rope_parameters(llama))
    config.architectures = ["Qwen2ForCausalLM"]
    return config


def _mistral_config(args: Dict, llama: Dict):
    """LLaMA with a sliding window on every layer is Mistral (sliding_window S = LEFT + 1)."""
    import transformers

    left, _ = args["window_size"]
    if args.get("window_attn_skip_freq") or args["add_qkv_bias"] or args.get("qk_layernorm") \
            or _llama3_scaling(llama):
        raise ConversionError("this checkpoint's model has a sliding window and full-attention "
                              "layers, q/k/v biases, q/k norms or LLaMA-3 rope scaling: "
                              "MistralForCausalLM has a window on every layer and none of "
                              "those.")
    drop = ("rope_scaling", "rope_theta", "attention_bias", "mlp_bias")
    config = transformers.MistralConfig(**{k: v for k, v in llama.items() if k not in drop},
                                        rope_parameters=_rope_parameters(llama),
                                        sliding_window=left + 1)
    config.architectures = ["MistralForCausalLM"]
    return config


def _qwen3_config(llama: Dict):
    """LLaMA with per-head q/k RMSNorms is Qwen3 (any head dim; rope plain or YaRN)."""
    import transformers

    if _llama3_scaling(llama):
        raise ConversionError("this checkpoint's model has q/k norms (Qwen3) and LLaMA-3 rope "
                              "scaling, which Qwen3ForCausalLM does not have.")
    drop = ("rope_scaling", "rope_theta", "mlp_bias")
    config = transformers.Qwen3Config(**{k: v for k, v in llama.items() if k not in drop},
                                      rope_parameters=_rope_parameters(llama))
    config.architectures = ["Qwen3ForCausalLM"]
    return config


def _num(value) -> str:
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e15:
        return str(int(value)) if value >= 1 else repr(value)
    return repr(value) if isinstance(value, float) else str(value)


def _yarn_flags(a: Dict) -> str:
    text = (f"--rope-type yarn --rotary-scaling-factor {_num(a['rotary_scaling_factor'])} "
            f"--original-max-position-embeddings {a['original_max_position_embeddings']} "
            f"--beta-fast {_num(a['beta_fast'])} --beta-slow {_num(a['beta_slow'])} "
            f"--mscale {_num(a['mscale'])} --mscale-all-dim {_num(a['mscale_all_dim'])}")
    if not a["yarn_correction_range_round_to_int"]:
        text += " --no-yarn-correction-range-round-to-int"
    if a.get("yarn_attention_factor") is not None:
        text += f" --yarn-attention-factor {_num(a['yarn_attention_factor'])}"
    return text


def _latent_attention_flags(a: Dict) -> str:
    """Multi-latent attention's flags (its latent norms: --qk-layernorm, with the MoE flags)."""
    text = "--multi-latent-attention"
    if a["q_lora_rank"] is not None:
        text += f" --q-lora-rank {a['q_lora_rank']}"
    text += (f" --kv-lora-rank {a['kv_lora_rank']} --qk-head-dim {a['qk_head_dim']} "
             f"--qk-pos-emb-head-dim {a['qk_pos_emb_head_dim']} --v-head-dim {a['v_head_dim']}")
    return text + (" --rotary-interleaved" if a["rotary_interleaved"] else "")


def architecture_flags(args: Dict) -> List[str]:
    """Megatron flags that rebuild this model and its parallel layout."""
    a = args
    flags = [f"--tensor-model-parallel-size {a['tensor_model_parallel_size']}",
             f"--pipeline-model-parallel-size {a['pipeline_model_parallel_size']}"]
    if a.get("num_layers_per_virtual_pipeline_stage"):
        flags.append(f"--num-layers-per-virtual-pipeline-stage "
                     f"{a['num_layers_per_virtual_pipeline_stage']}")
    flags += [f"--num-layers {a['num_layers']}", f"--hidden-size {a['hidden_size']}",
              f"--ffn-hidden-size {a['ffn_hidden_size']}",
              f"--num-attention-heads {a['num_attention_heads']}"]
    if a["group_query_attention"]:
        flags.append(f"--group-query-attention --num-query-groups {a['num_query_groups']}")
    if a.get("kv_channels"):  # under MLA its q/k head dim, the one value MLA accepts
        flags.append(f"--kv-channels {a['kv_channels']}")
    if a.get("multi_latent_attention"):
        flags.append(_latent_attention_flags(a))
    flags += [f"--seq-length {a['seq_length']}",
              f"--max-position-embeddings {a['max_position_embeddings']}",
              f"--position-embedding-type {a['position_embedding_type']}"]
    if a["position_embedding_type"] == "rope":
        flags.append(f"--rotary-base {_num(a['rotary_base'])}")
        if a["use_rope_scaling"]:
            flags.append(f"--use-rope-scaling --rope-scaling-factor "
                         f"{_num(a['rope_scaling_factor'])} --rope-low-freq-factor "
                         f"{_num(a['rope_low_freq_factor'])} --rope-high-freq-factor "
                         f"{_num(a['rope_high_freq_factor'])} "
                         f"--rope-original-max-position-embeddings "
                         f"{a['rope_original_max_position_embeddings']}")
        if a.get("rope_type") == "yarn":
            flags.append(_yarn_flags(a))
    flags.append(f"--normalization {a['normalization']} --norm-epsilon "
                 f"{_num(a['norm_epsilon'])}")
    flags += [flag for flag, on in (
        ("--swiglu", a["swiglu"]), ("--openai-gelu", a.get("openai_gelu")),
        ("--quick-geglu", a.get("quick_geglu")),
        ("--disable-bias-linear", a["disable_bias_linear"]),
        ("--add-qkv-bias", a["add_qkv_bias"]),
        ("--untie-embeddings-and-output-weights", a["untie_embeddings_and_output_weights"]))
        if on]
    if a.get("glu_linear_offset"):
        flags.append(f"--glu-linear-offset {_num(a['glu_linear_offset'])}")
    if a.get("activation_func_clamp_value") is not None:
        flags.append(f"--activation-func-clamp-value {_num(a['activation_func_clamp_value'])}")
    if a.get("softmax_type", "vanilla") != "vanilla":
        flags.append(f"--softmax-type {a['softmax_type']}")
    if a.get("window_size"):
        left, right = a["window_size"]
        flags.append(f"--window-size {left},{right}")
        if a.get("window_attn_skip_freq"):
            flags.append(f"--window-attn-skip-freq {a['window_attn_skip_freq']}")
    flags.append(f"--attention-dropout {_num(a['attention_dropout'])} --hidden-dropout "
                 f"{_num(a['hidden_dropout'])} --init-method-std {_num(a['init_method_std'])}")
    if a.get("tokenizer_type") in ("PretrainedFromHF", "HuggingFaceTokenizer") and \
            a.get("tokenizer_name_or_path"):
        flags.append(f"--tokenizer-type {a['tokenizer_type']} --tokenizer-name-or-path "
                     f"{a['tokenizer_name_or_path']}")
    if a.get("padded_vocab_size"):  # rows its authors padded: keep them all
        flags.append(f"--padded-vocab-size {a['padded_vocab_size']}")
    else:
        flags.append(f"--make-vocab-size-divisible-by {a['make_vocab_size_divisible_by']}")
    return flags + megatron_moe_args.moe_flags(a)


def flags_text(args: Dict, checkpoint_dir: str, arch: str, source: str, release: bool,
               dtype_note: Optional[str] = None, resumable: bool = False) -> str:
    """megatron_flags.txt: comments, then one flag group per line (``grep -v '^#'`` gives
    the flags)."""
    script = "pretrain_llama.py" if arch == LLAMA else "pretrain_gpt.py"
    lines = [
        f"# Megatron flags for the checkpoint in {checkpoint_dir}",
        f"# (converted from {source}). Train from it with",
        f"#   torchrun --nproc-per-node N {script} $(grep -v '^#' megatron_flags.txt) \\",
        "#       --micro-batch-size ... --global-batch-size ... --train-iters ... --lr ... \\",
        "#       --data-path ... --save NEW_DIR",
        "# The parallel sizes below are the checkpoint's own; any other TP/PP/VPP loads it too",
        "# (the heads and query groups must divide by TP, the layers by PP).",
    ]
    if release:
        lines.append("# A 'release' checkpoint loads as --finetune does: weights only, from "
                     "iteration 0 with a fresh optimizer.")
    elif resumable:
        lines.append("# It holds the optimizer state, LR schedule and RNG states: resume with "
                     "the run's own flags and --load.")
    else:
        lines.append("# It holds no optimizer state: continue with --no-load-optim (same "
                     "iteration), or --finetune (from iteration 0).")
    if not (args.get("tokenizer_type") and args.get("tokenizer_name_or_path")):
        lines.append(f"# No tokenizer came with the model: add tokenizer flags for a "
                     f"{args['vocab_size']}-token vocabulary.")
    if dtype_note:
        lines.append(f"# {dtype_note}")
    lines += [f"--load {checkpoint_dir}"] + architecture_flags(args)
    return "\n".join(lines) + "\n"
