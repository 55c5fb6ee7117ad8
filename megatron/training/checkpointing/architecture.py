"""The model settings a checkpoint's saved args record, compared with this run's flags.

A checkpoint loads into any model whose tensors have the same shapes, so a converted LLaMA-3
loaded without ``--rotary-base 500000``, or with another ``--norm-epsilon``, would train
silently on a different function. ``ARCHITECTURE`` is the one table of such settings: the
load check (``architecture_mismatch``) and ``--use-checkpoint-args`` (``take_architecture``)
both walk it. Parallel layout flags (TP, PP, DP, ...) are not in it: resharding is allowed.
"""
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple

from megatron.training.tokenizer.fingerprint import FINGERPRINT_ARG


def _number(value) -> str:
    """500000.0 -> '500000', 1e-05 -> '1e-05': as a user would type it."""
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e15:
        return str(int(value))
    return str(value)


def _always(args: Dict) -> bool:
    return True


def _rope(args: Dict) -> bool:
    return args.get("position_embedding_type") == "rope"


def _rope_scaling(args: Dict) -> bool:
    return _rope(args) and bool(args.get("use_rope_scaling"))


def _yarn(args: Dict) -> bool:
    return _rope(args) and args.get("rope_type") == "yarn"


def _latent_attention(args: Dict) -> bool:
    return bool(args.get("multi_latent_attention"))


def _learned_positions(args: Dict) -> bool:
    return args.get("position_embedding_type") == "learned_absolute"


def _gated(args: Dict) -> bool:
    """--swiglu or --quick-geglu: the MLP has [gate; up] halves to clamp and offset."""
    return bool(args.get("swiglu") or args.get("quick_geglu"))


def _experts(args: Dict) -> bool:
    return args.get("num_experts") is not None


def _null_tokenizer(args: Dict) -> bool:
    return args.get("tokenizer_type") == "NullTokenizer" and args.get("vocab_size") is not None


@dataclass(frozen=True)
class Setting:
    """One architecture setting. ``dest``: its key in the saved args (the argparse dest);
    ``flag``: how a user spells it. ``applies``: whether it shapes the model given the other
    settings (rotary base only with RoPE); both sides must agree on that to compare it, and
    the earlier row that switches it (position type, GQA, experts) catches a disagreement.
    ``value``: the effective value when a default depends on others (None: unset)."""
    dest: str
    flag: str
    applies: Callable[[Dict], bool] = _always
    value: Optional[Callable[[Dict], Any]] = None
    switch: bool = False  # a store_true flag: shown as "--flag" or "no --flag"
    taken: bool = True  # --use-checkpoint-args copies it (the vocabulary stays the tokenizer's)
    unset_is_unknown: bool = False  # None means "not recorded" (else None is a value: dense)
    needs: Tuple[str, ...] = ()  # the other keys ``value`` reads: compared only if recorded
    fix: str = ("pass the checkpoint's value, or --use-checkpoint-args to take the "
                "checkpoint's architecture")

    def of(self, args: Dict) -> Any:
        return self.value(args) if self.value is not None else args.get(self.dest)

    def show(self, value) -> str:
        if self.switch or value is None:
            return self.flag if value else f"no {self.flag}"
        return f"{self.flag} {_number(value)}"


def _query_groups(args: Dict):
    """Key/value heads: --num-query-groups counts only with --group-query-attention."""
    if args.get("group_query_attention"):
        return args.get("num_query_groups")
    return args.get("num_attention_heads")


def _groups_queries(args: Dict) -> bool:
    """--group-query-attention with as many groups as heads is plain multi-head attention."""
    return _query_groups(args) != args.get("num_attention_heads")


def _kv_channels(args: Dict):
    heads, hidden = args.get("num_attention_heads"), args.get("hidden_size")
    if args.get("kv_channels") is not None or not heads or hidden is None:
        return args.get("kv_channels")
    return hidden // heads  # the default


def _moe_ffn_hidden_size(args: Dict):
    return args.get("moe_ffn_hidden_size") or args.get("ffn_hidden_size")


def _tokenizer_vocabulary(args: Dict):
    fingerprint = args.get(FINGERPRINT_ARG)
    return fingerprint.get("vocab_size") if isinstance(fingerprint, dict) else None


class _Vocabulary(Setting):
    def show(self, value) -> str:
        return f"a tokenizer of {value} tokens"


def _window(args: Dict):
    window = args.get("window_size")
    return None if window is None else tuple(window)  # a list after a JSON round trip


def _windowed(args: Dict) -> bool:
    return args.get("window_size") is not None


def _softmax_type(args: Dict):
    return args.get("softmax_type") or "vanilla"  # checkpoints from before the flag


class _BooleanPair(Setting):
    """A --flag / --no-flag pair (argparse.BooleanOptionalAction): shown as typed."""
    def show(self, value) -> str:
        return self.flag if value else self.flag.replace("--", "--no-", 1)


class _Window(Setting):
    def show(self, value) -> str:
        return f"{self.flag} {value[0]},{value[1]}" if value else f"no {self.flag}"


_GROUPS = ("group_query_attention", "num_query_groups", "num_attention_heads")

# Order matters: a row that switches others on (position type, RoPE scaling, GQA, experts)
# comes before them, so the message names the switch.
ARCHITECTURE: List[Setting] = [
    Setting("num_layers", "--num-layers"),
    Setting("hidden_size", "--hidden-size"),
    Setting("ffn_hidden_size", "--ffn-hidden-size"),
    Setting("num_attention_heads", "--num-attention-heads"),
    Setting("group_query_attention", "--group-query-attention", value=_groups_queries,
            switch=True, needs=_GROUPS),
    Setting("num_query_groups", "--num-query-groups", value=_query_groups, needs=_GROUPS),
    Setting("kv_channels", "--kv-channels", value=_kv_channels,
            needs=("hidden_size", "num_attention_heads")),
    Setting("position_embedding_type", "--position-embedding-type"),
    Setting("max_position_embeddings", "--max-position-embeddings", _learned_positions),
    Setting("rotary_base", "--rotary-base", _rope),
    Setting("rotary_percent", "--rotary-percent", _rope),
    Setting("use_rope_scaling", "--use-rope-scaling", _rope, switch=True),
    Setting("rope_scaling_factor", "--rope-scaling-factor", _rope_scaling),
    Setting("rope_low_freq_factor", "--rope-low-freq-factor", _rope_scaling),
    Setting("rope_high_freq_factor", "--rope-high-freq-factor", _rope_scaling),
    Setting("rope_original_max_position_embeddings", "--rope-original-max-position-embeddings",
            _rope_scaling),
    Setting("rope_type", "--rope-type", _rope),
    Setting("rotary_scaling_factor", "--rotary-scaling-factor", _yarn),
    Setting("original_max_position_embeddings", "--original-max-position-embeddings", _yarn),
    Setting("beta_fast", "--beta-fast", _yarn),
    Setting("beta_slow", "--beta-slow", _yarn),
    Setting("mscale", "--mscale", _yarn),
    Setting("mscale_all_dim", "--mscale-all-dim", _yarn),
    _BooleanPair("yarn_correction_range_round_to_int", "--yarn-correction-range-round-to-int",
                 _yarn),
    Setting("yarn_attention_factor", "--yarn-attention-factor", _yarn),
    Setting("normalization", "--normalization"),
    Setting("norm_epsilon", "--norm-epsilon"),
    Setting("swiglu", "--swiglu", switch=True),
    Setting("quick_geglu", "--quick-geglu", switch=True),
    Setting("glu_linear_offset", "--glu-linear-offset", _gated),
    Setting("activation_func_clamp_value", "--activation-func-clamp-value", _gated),
    Setting("openai_gelu", "--openai-gelu", switch=True),
    Setting("disable_bias_linear", "--disable-bias-linear", switch=True),
    Setting("add_qkv_bias", "--add-qkv-bias", switch=True),
    Setting("qk_layernorm", "--qk-layernorm", switch=True),
    Setting("multi_latent_attention", "--multi-latent-attention", switch=True),
    Setting("q_lora_rank", "--q-lora-rank", _latent_attention),
    Setting("kv_lora_rank", "--kv-lora-rank", _latent_attention),
    Setting("qk_head_dim", "--qk-head-dim", _latent_attention),
    Setting("qk_pos_emb_head_dim", "--qk-pos-emb-head-dim", _latent_attention),
    Setting("v_head_dim", "--v-head-dim", _latent_attention),
    Setting("rotary_interleaved", "--rotary-interleaved", _latent_attention, switch=True),
    _Window("window_size", "--window-size", value=_window),
    Setting("window_attn_skip_freq", "--window-attn-skip-freq", _windowed),
    Setting("softmax_type", "--softmax-type", value=_softmax_type),
    Setting("mtp_num_layers", "--mtp-num-layers"),
    Setting("untie_embeddings_and_output_weights", "--untie-embeddings-and-output-weights",
            switch=True),
    Setting("num_experts", "--num-experts"),
    Setting("moe_router_topk", "--moe-router-topk", _experts),
    # How the router turns logits into the chosen experts and their weights.
    Setting("moe_router_score_function", "--moe-router-score-function", _experts),
    Setting("moe_router_pre_softmax", "--moe-router-pre-softmax", _experts, switch=True),
    Setting("moe_router_topk_norm", "--moe-router-topk-norm", _experts, switch=True),
    Setting("moe_router_enable_expert_bias", "--moe-router-enable-expert-bias", _experts,
            switch=True),
    Setting("moe_router_bias", "--moe-router-bias", _experts, switch=True),
    Setting("moe_router_num_groups", "--moe-router-num-groups", _experts),
    Setting("moe_router_group_topk", "--moe-router-group-topk", _experts),
    Setting("moe_router_topk_scaling_factor", "--moe-router-topk-scaling-factor", _experts),
    Setting("moe_ffn_hidden_size", "--moe-ffn-hidden-size", _experts,
            value=_moe_ffn_hidden_size, needs=("ffn_hidden_size",)),
    Setting("moe_layer_freq", "--moe-layer-freq", _experts),
    Setting("moe_shared_expert_intermediate_size", "--moe-shared-expert-intermediate-size",
            _experts),
    Setting("moe_shared_expert_gate", "--moe-shared-expert-gate", _experts, switch=True),
    Setting("vocab_size", "--vocab-size", _null_tokenizer, taken=False,
            fix="pass the checkpoint's value (the vocabulary is the tokenizer's: "
                "--use-checkpoint-args does not change it)"),
    # The vocabulary of any tokenizer, from the fingerprint the args record (padded sizes
    # depend on TP, so the unpadded count is compared).
    _Vocabulary(FINGERPRINT_ARG, "the tokenizer flags", value=_tokenizer_vocabulary,
                taken=False, unset_is_unknown=True,
                fix="use the checkpoint's tokenizer (--use-checkpoint-args does not change "
                    "it)"),
]


def architecture_mismatch(saved: Dict, current: Dict, checkpoint: str) -> Optional[str]:
    """The first setting ``saved`` (a checkpoint's args) records with another value than
    ``current`` (this run's args), as one message naming both and the fix; None when all
    agree. Settings the saved args lack (older checkpoints) are not compared."""
    for setting in ARCHITECTURE:
        recorded = all(key in saved for key in (setting.dest, *setting.needs))
        if not (recorded and setting.applies(saved) and setting.applies(current)):
            continue
        theirs, ours = setting.of(saved), setting.of(current)
        if theirs == ours or (setting.unset_is_unknown and None in (theirs, ours)):
            continue
        return (f"the checkpoint at {checkpoint} was trained with {setting.show(theirs)}, "
                f"this run has {setting.show(ours)}: {setting.fix}.")
    return None


def take_architecture(saved: Dict, args) -> List[str]:
    """Set on ``args`` (a Namespace) every architecture setting ``saved`` records; returns
    them as flags, for the line that says what was taken."""
    taken = []
    for setting in ARCHITECTURE:
        if setting.taken and setting.dest in saved:
            setattr(args, setting.dest, saved[setting.dest])
            if setting.applies(saved):
                taken.append(setting.show(saved[setting.dest]))
    return taken
