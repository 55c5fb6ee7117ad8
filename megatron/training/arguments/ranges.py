"""Every numeric flag's valid range, checked before any rule that divides or compares by it
(so "--hidden-size -8" is named at start, not a "negative dimension" deep in the model, and no
message says "make it a multiple of 0")."""
import math
from dataclasses import dataclass

from megatron.training.training_config import ConfigError


@dataclass(frozen=True)
class _Range:
    """The valid values of a numeric flag: low..high, each end open or closed."""
    low: float
    high: float = math.inf
    low_open: bool = False
    high_open: bool = True

    def __contains__(self, value) -> bool:
        above = value > self.low if self.low_open else value >= self.low
        below = value < self.high if self.high_open else value <= self.high
        return above and below

    def __str__(self) -> str:
        if self.low == -math.inf and self.high == math.inf:
            return "a finite number"
        if self.high == math.inf:
            return f"{'>' if self.low_open else '>='} {self.low:g}"
        return (f"in {'(' if self.low_open else '['}{self.low:g}, {self.high:g}"
                f"{')' if self.high_open else ']'}")


_AT_LEAST_1 = _Range(1)
_NON_NEGATIVE = _Range(0)
_POSITIVE = _Range(0, low_open=True)
_PROBABILITY = _Range(0, 1)  # [0, 1): a dropout of 1 zeroes everything
_FRACTION = _Range(0, 1, high_open=False)
_FINITE = _Range(-math.inf)  # any value but inf and nan (check_flag_ranges refuses those)

# Every numeric flag's valid values, checked before any rule that divides or multiplies by
# them (so "--hidden-size -8" is named, not a "negative dimension" deep in the model, and no
# message says "make it a multiple of 0"). dest -> (range, why: shown with the fix, or "").
# Not here: --timing-log-level (argparse choices) and --pipeline-trace-iteration (checked
# against --train-iters when --pipeline-trace-dir uses it).
FLAG_RANGES = {
    **{dest: (_AT_LEAST_1, "") for dest in (
        "num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "kv_channels",
        "num_query_groups", "seq_length", "max_position_embeddings",
        "rope_original_max_position_embeddings", "num_layers_per_virtual_pipeline_stage",
        "num_virtual_stages_per_pipeline_rank", "decoder_first_pipeline_num_layers",
        "decoder_last_pipeline_num_layers", "recompute_num_layers", "micro_batch_size",
        "global_batch_size", "train_iters", "train_samples", "lr_decay_iters",
        "lr_decay_samples", "eval_interval", "exit_interval", "save_interval", "log_interval",
        "tensorboard_queue_size", "vocab_size", "padded_vocab_size",
        "make_vocab_size_divisible_by", "hysteresis",
        "loss_scale_window", "max_consecutive_nan_iterations", "distributed_timeout_minutes")},
    "tensor_model_parallel_size": (_AT_LEAST_1, "1 = no tensor parallelism"),
    "pipeline_model_parallel_size": (_AT_LEAST_1, "1 = no pipeline parallelism"),
    "context_parallel_size": (_AT_LEAST_1, "1 = no context parallelism"),
    "num_distributed_optimizer_instances": (_AT_LEAST_1, "1 = one sharded optimizer, no HSDP"),
    "num_experts": (_AT_LEAST_1, "routed experts per MoE layer"),
    "moe_ffn_hidden_size": (_AT_LEAST_1, ""),
    "moe_router_topk": (_AT_LEAST_1, "experts per token"),
    "moe_shared_expert_intermediate_size": (_AT_LEAST_1, ""),
    "expert_model_parallel_size": (_AT_LEAST_1, "1 = no expert parallelism"),
    "expert_tensor_parallel_size": (_AT_LEAST_1, "each expert's TP size"),
    "moe_aux_loss_coeff": (_NON_NEGATIVE, "0 = no load-balancing loss"),
    "moe_z_loss_coeff": (_NON_NEGATIVE, ""),
    "moe_router_bias_update_rate": (_POSITIVE, ""),
    "moe_router_num_groups": (_AT_LEAST_1, "groups of experts"),
    "moe_router_group_topk": (_AT_LEAST_1, "groups each token may route to"),
    "moe_router_topk_scaling_factor": (_POSITIVE, "multiplies the gate weights"),
    "moe_expert_capacity_factor": (_POSITIVE, "unset = no token dropping"),
    "tiktoken_num_special_tokens": (_NON_NEGATIVE, "ids reserved below the BPE ranks"),
    "fp8_margin": (_NON_NEGATIVE, "0 = amax at the largest FP8 value"),
    "fp8_amax_history_len": (_AT_LEAST_1, "delayed scaling's window of steps"),
    "window_attn_skip_freq": (_AT_LEAST_1, "every N-th layer keeps full attention"),
    "q_lora_rank": (_AT_LEAST_1, "the query latent; unset = none"),
    "kv_lora_rank": (_AT_LEAST_1, "the key/value latent; DeepSeek-V3 512"),
    "qk_head_dim": (_AT_LEAST_1, "a query/key head's channels without position"),
    "qk_pos_emb_head_dim": (_AT_LEAST_1, "a query/key head's rotated channels"),
    "v_head_dim": (_AT_LEAST_1, "a value head's channels"),
    "mtp_num_layers": (_AT_LEAST_1, "multi-token prediction depths"),
    "mtp_loss_scaling_factor": (_NON_NEGATIVE, "the MTP losses' weight; DeepSeek-V3 0.1-0.3"),
    "activation_func_clamp_value": (_POSITIVE, "the bound of both halves; gpt-oss 7"),
    "glu_linear_offset": (_FINITE, "added to the up half; gpt-oss 1"),
    "rotary_scaling_factor": (_AT_LEAST_1, "YaRN's context extension; 1 = none"),
    "original_max_position_embeddings": (_AT_LEAST_1, "YaRN's context before scaling"),
    "beta_fast": (_POSITIVE, "YaRN: rotations over the original context, e.g. 32"),
    "beta_slow": (_POSITIVE, "YaRN: rotations over the original context, e.g. 1"),
    "mscale": (_NON_NEGATIVE, ""),
    "mscale_all_dim": (_NON_NEGATIVE, "0 = plain YaRN temperature"),
    "yarn_attention_factor": (_POSITIVE, "unset = derived from the factor"),
    "num_layers_at_start_in_bf16": (_NON_NEGATIVE, ""),
    "num_layers_at_end_in_bf16": (_NON_NEGATIVE, ""),
    "reduce_bucket_size": (_AT_LEAST_1, "elements per bucket"),
    "ddp_bucket_size": (_AT_LEAST_1, "elements per bucket"),
    **{dest: (_NON_NEGATIVE, "") for dest in (
        "lr_wsd_decay_iters", "lr_wsd_decay_samples", "lr_warmup_iters", "lr_warmup_samples",
        "ckpt_step", "min_lr", "lr_warmup_init", "weight_decay", "start_weight_decay",
        "end_weight_decay")},
    "lr": (_NON_NEGATIVE, "the peak learning rate, e.g. 3e-4"),
    "eval_iters": (_NON_NEGATIVE, "0 = no evaluation"),
    "num_workers": (_NON_NEGATIVE, "0 = load data in the main process"),
    "seed": (_AT_LEAST_1, "Megatron's rule"),
    "clip_grad": (_NON_NEGATIVE, "0 = no clipping"),
    "sgd_momentum": (_PROBABILITY, ""),
    "adam_beta1": (_PROBABILITY, "an exponential decay rate"),
    "adam_beta2": (_PROBABILITY, "an exponential decay rate"),
    "muon_momentum": (_PROBABILITY, "an exponential decay rate"),
    "muon_num_ns_steps": (_AT_LEAST_1, "Newton-Schulz iterations, 5 as a rule"),
    "muon_extra_scale_factor": (_POSITIVE, ""),
    "qk_clip_threshold": (_POSITIVE, "the largest logit a head keeps; Kimi K2 100"),
    "qk_clip_alpha": (_FRACTION, "the clip's share on the queries; 0.5 = even"),
    "attention_dropout": (_PROBABILITY, "a dropout probability; 0 = no dropout"),
    "hidden_dropout": (_PROBABILITY, "a dropout probability; 0 = no dropout"),
    "lr_warmup_fraction": (_FRACTION, "a fraction of the decay steps"),
    "rotary_percent": (_Range(0, 1, low_open=True, high_open=False),
                       "the fraction of each head's channels rotated"),
    **{dest: (_POSITIVE, "") for dest in (
        "rotary_base", "rope_scaling_factor", "rope_low_freq_factor", "rope_high_freq_factor",
        "norm_epsilon", "init_method_std", "adam_eps", "loss_scale", "initial_loss_scale",
        "min_loss_scale", "exit_duration_in_mins", "peak_tflops")},
}


def _flag_name(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def check_flag_ranges(args) -> None:
    """Each numeric flag given (not None) is finite and in its FLAG_RANGES range."""
    for dest, (valid, why) in FLAG_RANGES.items():
        value = getattr(args, dest, None)  # saved args may predate a flag
        if value is None:
            continue
        note = f" ({why})" if why else ""
        finite = not isinstance(value, float) or math.isfinite(value)
        if not (finite and value in valid):
            raise ConfigError(f"{_flag_name(dest)} must be {valid}, got {value}{note}.")
