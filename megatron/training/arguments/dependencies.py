"""Flags that mean something only with another flag or setting, in ONE table (``DEPENDENCIES``).

A user who passes such a flag without its partner trains a run the flag does not change (a
``--moe-*`` flag without ``--num-experts`` trains a dense model): ``parse_args`` refuses it with
one line naming the partner. Only flags the user typed are refused, and only with a value other
than the default: a default value changes nothing with or without the partner, and launch
scripts pass some of them harmlessly (``--expert-model-parallel-size 1`` on a dense model).

Not here, because an existing check already refuses them with its own message: virtual
pipeline stages and first/last stage layer counts at PP=1, ``--sequence-parallel`` at TP=1,
``--num-query-groups`` without ``--group-query-attention``, ``--start/end-weight-decay`` with a
constant weight decay (parse.py), the zbv and interleaved schedules at PP=1 (parse.py).
"""
import argparse
from dataclasses import dataclass
from typing import Callable, Dict, FrozenSet, List, Mapping, Sequence, Tuple

from megatron.training.training_config import ConfigError


@dataclass(frozen=True)
class Dependency:
    """``flag`` has an effect only when ``applies(args)``; ``needs`` says what makes it so."""
    flag: str
    applies: Callable[[argparse.Namespace], bool]
    needs: str

    def message(self) -> str:
        return f"{self.flag} has no effect without {self.needs}: add {self.needs} or drop " \
               f"{self.flag}."


def _moe(args) -> bool:
    return args.num_experts is not None


def _distributed_optimizer(args) -> bool:
    # FSDP2 counts too: it refuses these flags itself, saying to drop them (build_configs).
    return (args.use_distributed_optimizer or args.overlapped_distributed_optimizer
            or args.use_torch_fsdp2)


def _rope(args) -> bool:
    return args.position_embedding_type == "rope"


def _tensorboard_or_wandb(args) -> bool:
    return args.tensorboard_dir is not None or args.wandb_project is not None


_MOE_FLAGS = (
    "--moe-layer-freq", "--moe-ffn-hidden-size", "--moe-router-topk",
    "--moe-router-score-function", "--moe-router-pre-softmax", "--moe-router-topk-norm",
    "--moe-router-load-balancing-type", "--moe-aux-loss-coeff", "--moe-z-loss-coeff",
    "--moe-router-enable-expert-bias", "--moe-router-bias-update-rate", "--moe-router-bias",
    "--moe-router-num-groups", "--moe-router-group-topk", "--moe-router-topk-scaling-factor",
    "--moe-expert-capacity-factor", "--moe-token-drop-policy",
    "--moe-pad-expert-input-to-capacity", "--moe-shared-expert-intermediate-size",
    "--moe-shared-expert-gate", "--moe-grouped-gemm", "--moe-token-dispatcher-type",
    "--expert-model-parallel-size", "--expert-tensor-parallel-size")
_FP16_FLAGS = ("--loss-scale", "--initial-loss-scale", "--min-loss-scale",
               "--loss-scale-window", "--hysteresis")
_ROPE_SCALING_FLAGS = ("--rope-scaling-factor", "--rope-low-freq-factor",
                       "--rope-high-freq-factor", "--rope-original-max-position-embeddings")
# --no-...: the one spelling that differs from the default (rounding on).
_YARN_FLAGS = ("--rotary-scaling-factor", "--original-max-position-embeddings", "--beta-fast",
               "--beta-slow", "--mscale", "--mscale-all-dim",
               "--no-yarn-correction-range-round-to-int", "--yarn-attention-factor")
_TENSORBOARD_FLAGS = ("--log-timers-to-tensorboard", "--log-batch-size-to-tensorboard",
                      "--log-validation-ppl-to-tensorboard",
                      "--no-log-learning-rate-to-tensorboard",
                      "--no-log-loss-scale-to-tensorboard")

# Checked in order; a flag with two rows (an MoE flag that also needs another MoE flag) is
# told about the outer partner first.
DEPENDENCIES: Tuple[Dependency, ...] = (
    # mixture of experts
    *(Dependency(flag, _moe, "--num-experts N") for flag in _MOE_FLAGS),
    Dependency("--moe-router-bias-update-rate", lambda a: a.moe_router_enable_expert_bias,
               "--moe-router-enable-expert-bias"),
    *(Dependency(flag, lambda a: a.moe_expert_capacity_factor is not None,
                 "--moe-expert-capacity-factor F")
      for flag in ("--moe-token-drop-policy", "--moe-pad-expert-input-to-capacity")),
    Dependency("--moe-shared-expert-gate",
               lambda a: a.moe_shared_expert_intermediate_size is not None,
               "--moe-shared-expert-intermediate-size N"),
    # parallelism
    *(Dependency(flag, lambda a: a.pipeline_model_parallel_size > 1,
                 "--pipeline-model-parallel-size N (N >= 2)")
      for flag in ("--pipeline-schedule", "--account-for-embedding-in-pipeline-split",
                   "--account-for-loss-in-pipeline-split")),
    Dependency("--cp-comm-type", lambda a: a.context_parallel_size > 1,
               "--context-parallel-size N (N >= 2)"),
    Dependency("--overlap-param-gather", _distributed_optimizer, "--use-distributed-optimizer"),
    Dependency("--shard-gradients", _distributed_optimizer, "--use-distributed-optimizer"),
    Dependency("--reduce-bucket-size", lambda a: a.overlapped_distributed_optimizer,
               "--overlapped-distributed-optimizer"),
    Dependency("--no-reshard-after-forward", lambda a: a.use_torch_fsdp2, "--use-torch-fsdp2"),
    Dependency("--fsdp2-reduce-gradients-once", lambda a: a.use_torch_fsdp2,
               "--use-torch-fsdp2"),
    *(Dependency(flag, lambda a: a.recompute_granularity == "full",
                 "--recompute-granularity full")
      for flag in ("--recompute-method", "--recompute-num-layers",
                   "--distribute-saved-activations")),
    # the MLP's activation
    *(Dependency(flag, lambda a: a.swiglu or a.quick_geglu, "--swiglu or --quick-geglu")
      for flag in ("--glu-linear-offset", "--activation-func-clamp-value")),
    # attention
    Dependency("--window-attn-skip-freq", lambda a: a.window_size is not None,
               "--window-size LEFT,0"),
    *(Dependency(flag, lambda a: a.multi_latent_attention, "--multi-latent-attention")
      for flag in ("--q-lora-rank", "--kv-lora-rank", "--qk-head-dim", "--qk-pos-emb-head-dim",
                   "--v-head-dim", "--rotary-interleaved")),
    Dependency("--mtp-loss-scaling-factor", lambda a: a.mtp_num_layers is not None,
               "--mtp-num-layers D"),
    # FP8
    *(Dependency(flag, lambda a: a.fp8_format is not None, "--fp8-format e4m3|hybrid")
      for flag in ("--fp8-recipe", "--fp8-margin", "--first-last-layers-bf16",
                   "--fp8-param-gather")),
    Dependency("--fp8-param-gather", _distributed_optimizer, "--use-distributed-optimizer"),
    *(Dependency(flag, lambda a: a.fp8_recipe == "delayed", "--fp8-recipe delayed")
      for flag in ("--fp8-amax-history-len", "--fp8-amax-compute-algo")),
    *(Dependency(flag, lambda a: a.first_last_layers_bf16, "--first-last-layers-bf16")
      for flag in ("--num-layers-at-start-in-bf16", "--num-layers-at-end-in-bf16")),
    # mixed precision
    *(Dependency(flag, lambda a: a.fp16, "--fp16") for flag in _FP16_FLAGS),
    Dependency("--grad-reduce-in-bf16", lambda a: a.bf16, "--bf16"),
    # positions
    *(Dependency(flag, _rope, "--position-embedding-type rope")
      for flag in ("--rotary-base", "--rotary-percent", "--use-rope-scaling", "--rope-type")),
    *(Dependency(flag, lambda a: a.use_rope_scaling, "--use-rope-scaling")
      for flag in _ROPE_SCALING_FLAGS),
    *(Dependency(flag, lambda a: a.rope_type == "yarn", "--rope-type yarn")
      for flag in _YARN_FLAGS),
    # optimizer and learning rate
    *(Dependency(flag, lambda a: a.lr_decay_style == "WSD", "--lr-decay-style WSD")
      for flag in ("--lr-wsd-decay-style", "--lr-wsd-decay-iters", "--lr-wsd-decay-samples")),
    Dependency("--lr-warmup-init", lambda a: bool(a.lr_warmup_iters or a.lr_warmup_samples
                                                  or a.lr_warmup_fraction),
               "a warmup (--lr-warmup-iters, --lr-warmup-samples or --lr-warmup-fraction)"),
    Dependency("--sgd-momentum", lambda a: a.optimizer == "sgd", "--optimizer sgd"),
    *(Dependency(flag, lambda a: a.optimizer in ("adam", "muon"), "--optimizer adam")
      for flag in ("--adam-beta1", "--adam-beta2", "--adam-eps")),
    *(Dependency(flag, lambda a: a.optimizer == "muon", "--optimizer muon")
      for flag in ("--muon-momentum", "--muon-use-nesterov", "--muon-num-ns-steps",
                   "--muon-scale-mode", "--muon-extra-scale-factor", "--muon-split-qkv",
                   "--muon-ns-dtype")),  # --muon-tp-mode, --muon-scalar-optimizer: one choice
    *(Dependency(flag, lambda a: a.qk_clip, "--qk-clip")
      for flag in ("--qk-clip-threshold", "--qk-clip-alpha")),
    # checkpointing
    *(Dependency(flag, lambda a: a.save is not None, "--save DIR")
      for flag in ("--save-interval", "--no-save-optim", "--no-save-rng", "--async-save")),
    *(Dependency(flag, lambda a: a.load is not None, "--load DIR")
      for flag in ("--no-load-optim", "--no-load-rng", "--finetune", "--ckpt-step")),
    Dependency("--ckpt-format", lambda a: a.save is not None or a.load is not None,
               "--save DIR or --load DIR"),
    # logging
    Dependency("--tensorboard-queue-size", lambda a: a.tensorboard_dir is not None,
               "--tensorboard-dir DIR"),
    *(Dependency(flag, _tensorboard_or_wandb, "--tensorboard-dir DIR or --wandb-project NAME")
      for flag in _TENSORBOARD_FLAGS),
    *(Dependency(flag, lambda a: a.wandb_project is not None, "--wandb-project NAME")
      for flag in ("--wandb-exp-name", "--wandb-save-dir")),
    Dependency("--pipeline-trace-iteration", lambda a: a.pipeline_trace_dir is not None,
               "--pipeline-trace-dir DIR"),
    # tokenizer
    *(Dependency(flag, lambda a: a.tokenizer_type == "TikTokenizer",
                 "--tokenizer-type TikTokenizer")
      for flag in ("--tiktoken-pattern", "--tiktoken-num-special-tokens",
                   "--tiktoken-special-tokens")),
)


def _option_actions(parser: argparse.ArgumentParser, token: str):
    """The actions ``token`` (``--flag`` or ``--flag=value``) names: exact, or, where the
    parser allows abbreviations, the one flag it is a unique prefix of."""
    flag = token.split("=", 1)[0]
    actions = parser._option_string_actions
    if flag in actions:
        return [actions[flag]]
    if parser.allow_abbrev and flag.startswith("--"):
        matches = {actions[s] for s in actions if s.startswith(flag)}
        return list(matches) if len(matches) == 1 else []
    return []


def given_dests(parser: argparse.ArgumentParser, argv: Sequence[str],
                args: argparse.Namespace) -> FrozenSet[str]:
    """The dests the command line set to a value other than their default."""
    dests = set()
    for token in argv:
        if token == "--":
            break
        if token.startswith("-"):
            dests.update(action.dest for action in _option_actions(parser, token))
    return frozenset(d for d in dests if getattr(args, d, None) != parser.get_default(d))


def unmet_dependencies(parser: argparse.ArgumentParser, args: argparse.Namespace,
                       given: FrozenSet[str]) -> List[Dependency]:
    """Every row, in order, whose flag is ``given`` (dests) and would do nothing."""
    # The parser knows the dest (--no-reshard-after-forward sets reshard_after_forward).
    return [row for row in DEPENDENCIES
            if parser._option_string_actions[row.flag].dest in given and not row.applies(args)]


def check_flag_dependencies(parser: argparse.ArgumentParser, args: argparse.Namespace,
                            given: FrozenSet[str]) -> None:
    """ConfigError for the first row whose flag is ``given`` (dests) and would do nothing."""
    unmet = unmet_dependencies(parser, args, given)
    if unmet:
        raise ConfigError(unmet[0].message())


def left_without_partner(parser: argparse.ArgumentParser, args: argparse.Namespace,
                         given: FrozenSet[str], removed: Mapping[str, object]) -> FrozenSet[str]:
    """The ``given`` dests that do nothing in ``args`` only because flags were removed from
    the command line: with the removed flags' values put back (``removed``: dest -> value),
    every row of theirs is met. A tool that replaces some flags by its own (the planner's
    layout flags) drops these too, so the rest still parses: ``--reduce-bucket-size`` goes
    with ``--overlapped-distributed-optimizer``. Flags that do nothing either way stay, for
    ``check_flag_dependencies`` to refuse."""
    restored = argparse.Namespace(**{**vars(args), **removed})
    unmet: Dict[str, List[Dependency]] = {}
    for row in unmet_dependencies(parser, args, given):
        unmet.setdefault(parser._option_string_actions[row.flag].dest, []).append(row)
    return frozenset(dest for dest, rows in unmet.items()
                     if all(row.applies(restored) for row in rows))
