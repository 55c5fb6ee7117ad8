"""Megatron's command-line flags -> config dataclasses. The ONE place that knows flag names.

``parse_args(argv)`` returns a plain ``argparse.Namespace`` (checkpoints store ``vars(args)``),
with Megatron's old spellings folded into the current ones (``--RMSNorm`` -> ``normalization``,
``--use-rotary-position-embeddings`` -> ``position_embedding_type='rope'``, ...) and every check
that needs no world size done. ``build_configs(args, world_size)`` (in configs_from_args.py,
re-exported here) does the remaining checks (batch vs data parallel size, heads vs TP, data and
tokenizer files) and returns the configs.
Every problem raises ``ConfigError`` naming the flag and the fix; entry points print it and exit
non-zero before any process group or file is touched.
"""
import argparse
import difflib
import re
import sys
from typing import List, Optional, Sequence

from megatron.core.optimizer.optimizer_param_scheduler import (
    LR_DECAY_STYLES,
    WD_INCR_STYLES,
    WSD_DECAY_STYLES,
)
from megatron.training.errors import is_reporting_rank
from megatron.training.flag_ranges import check_flag_ranges
from megatron.training.tokenizer.build import add_tokenizer_args
from megatron.training.training_config import (
    ConfigError,
    MegatronConfigs,
    TrainingConfig,
)

__all__ = ["ConfigError", "MegatronConfigs", "TrainingConfig", "build_configs", "get_parser",
           "parse_args", "validate_args", "NOOP_FLAGS"]

# Flags accepted for compatibility that change nothing here: each only selects a CUDA kernel
# (apex / Megatron fused ops) or states what is always true in this framework.
NOOP_FLAGS = {
    "--use-flash-attn": "attention always uses torch SDPA, which runs flash attention on CUDA",
    "--causal-lm": "GPT and LLaMA models are always causal language models",
    "--no-masked-softmax-fusion": "no fused softmax kernel; SDPA does masking and softmax",
    "--no-bias-gelu-fusion": "no fused bias-GeLU kernel",
    "--no-bias-swiglu-fusion": "no fused bias-SwiGLU kernel",
    "--no-bias-dropout-fusion": "no fused bias-dropout-add kernel",
    "--no-rope-fusion": "no fused RoPE kernel",
    "--no-persist-layer-norm": "no persistent (apex) LayerNorm kernel",
    "--no-async-tensor-model-parallel-allreduce": "the backward's TP all-reduce always overlaps "
                                                  "the weight-gradient GEMM (no synchronous mode)",
}


class _Parser(argparse.ArgumentParser):
    """argparse that raises ConfigError instead of printing usage and calling sys.exit(2)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # A value like -1e-3 is a number, not a flag (Python 3.11's argparse knows only -1 and
        # -.5 forms, and says "--lr: expected one argument").
        self._negative_number_matcher = re.compile(r"^-(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?$")

    def error(self, message):
        raise ConfigError(message)


def _int_from_float(text: str) -> int:
    """Integers also written like '2e8' (Megatron-LLaMA's --reduce-bucket-size=2e8)."""
    value = float(text)
    if not value.is_integer():
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number")
    return int(value)


def _add_network_args(parser):
    g = parser.add_argument_group("network size and architecture")
    g.add_argument("--num-layers", type=int, default=None)
    g.add_argument("--hidden-size", type=int, default=None)
    g.add_argument("--ffn-hidden-size", type=int, default=None,
                   help="Default 4 * hidden; with --swiglu int(4 * hidden * 2/3 / 64) * 64.")
    g.add_argument("--num-attention-heads", type=int, default=None)
    g.add_argument("--kv-channels", type=int, default=None)
    g.add_argument("--group-query-attention", action="store_true")
    g.add_argument("--num-query-groups", type=int, default=1)
    g.add_argument("--seq-length", type=int, default=None)
    g.add_argument("--max-position-embeddings", type=int, default=None,
                   help="Default --seq-length. Learned absolute positions: the size of the "
                        "position table, so it must be >= --seq-length. RoPE has no table "
                        "(positions are computed): the value is only recorded as the model's "
                        "context (an HF export's max_position_embeddings); a --seq-length "
                        "beyond it trains anyway, with a warning.")
    g.add_argument("--position-embedding-type", default="learned_absolute",
                   choices=["learned_absolute", "rope", "none"])
    g.add_argument("--use-rotary-position-embeddings", action="store_true",
                   help="Old spelling of --position-embedding-type rope.")
    g.add_argument("--no-position-embedding", action="store_true",
                   help="No learned absolute position embedding (rope if asked, else none).")
    g.add_argument("--rotary-base", type=float, default=10000.0)
    g.add_argument("--rotary-percent", type=float, default=1.0)
    g.add_argument("--use-rope-scaling", action="store_true", help="LLaMA-3.1 RoPE scaling.")
    g.add_argument("--rope-scaling-factor", type=float, default=8.0)
    g.add_argument("--rope-low-freq-factor", type=float, default=1.0,
                   help="LLaMA-3.1 RoPE scaling (with --use-rope-scaling).")
    g.add_argument("--rope-high-freq-factor", type=float, default=4.0,
                   help="LLaMA-3.1 RoPE scaling (with --use-rope-scaling).")
    g.add_argument("--rope-original-max-position-embeddings", type=int, default=8192,
                   help="LLaMA-3.1 RoPE scaling: the context length before scaling (with "
                        "--use-rope-scaling).")
    g.add_argument("--normalization", default="LayerNorm", choices=["LayerNorm", "RMSNorm"])
    g.add_argument("--RMSNorm", action="store_true", help="Old spelling of --normalization RMSNorm.")
    g.add_argument("--norm-epsilon", "--layernorm-epsilon", dest="norm_epsilon", type=float,
                   default=1e-5)
    g.add_argument("--swiglu", action="store_true")
    g.add_argument("--openai-gelu", action="store_true",
                   help="GeLU's tanh approximation (GPT-2's 'gelu_new') instead of the exact one.")
    g.add_argument("--disable-bias-linear", action="store_true")
    g.add_argument("--add-qkv-bias", action="store_true")
    g.add_argument("--untie-embeddings-and-output-weights", action="store_true")
    g.add_argument("--init-method-std", type=float, default=0.02)
    g.add_argument("--attention-dropout", type=float, default=0.1)
    g.add_argument("--hidden-dropout", type=float, default=0.1)
    g.add_argument("--allow-math-attention", action="store_true",
                   help="On CUDA, accept a configuration in which SDPA would run its math "
                        "kernel ([b, heads, s, s] scores per layer: slow, out of memory at long "
                        "sequences); without it such a run stops at start saying why.")
    for flag, why in NOOP_FLAGS.items():
        g.add_argument(flag, action="store_true", help=f"Accepted, no effect: {why}.")


def _add_parallel_args(parser):
    g = parser.add_argument_group("parallelism")
    g.add_argument("--tensor-model-parallel-size", type=int, default=1)
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    g.add_argument("--sequence-parallel", action="store_true")
    g.add_argument("--context-parallel-size", type=int, default=1,
                   help="Split each sequence over this many ranks (ring attention); the "
                        "world is TP x CP x DP x PP.")
    g.add_argument("--cp-comm-type", choices=("p2p", "all_gather"), default="p2p",
                   help="How context-parallel attention sees the other ranks' keys and "
                        "values: p2p passes blocks around a ring, overlapped with compute; "
                        "all_gather gathers them once (simpler, more memory).")
    g.add_argument("--num-layers-per-virtual-pipeline-stage", type=int, default=None)
    g.add_argument("--num-virtual-stages-per-pipeline-rank", type=int, default=None)
    g.add_argument("--decoder-first-pipeline-num-layers", type=int, default=None)
    g.add_argument("--decoder-last-pipeline-num-layers", type=int, default=None)
    g.add_argument("--account-for-embedding-in-pipeline-split", action="store_true")
    g.add_argument("--account-for-loss-in-pipeline-split", action="store_true")
    g.add_argument("--use-distributed-optimizer", action="store_true")
    g.add_argument("--overlapped-distributed-optimizer", action="store_true",
                   help="Megatron-LLaMA's: distributed optimizer, reduce-scatter and all-gather "
                        "overlapped in buckets of --reduce-bucket-size elements.")
    g.add_argument("--reduce-bucket-size", type=_int_from_float, default=500_000_000)
    g.add_argument("--overlap-grad-reduce", action="store_true")
    g.add_argument("--overlap-param-gather", action="store_true")
    g.add_argument("--ddp-bucket-size", type=_int_from_float, default=None)
    g.add_argument("--accumulate-allreduce-grads-in-fp32", action="store_true")
    g.add_argument("--recompute-activations", action="store_true",
                   help="Old spelling of --recompute-granularity selective.")
    g.add_argument("--recompute-granularity", default=None, choices=["full", "selective"],
                   help="full: recompute whole layers (see --recompute-method). selective: "
                        "recompute the attention core only where it keeps the s x s softmax "
                        "(the unfused kernel: CPU with attention dropout, or CUDA's math "
                        "kernel); with flash / memory-efficient attention it is a no-op "
                        "(nothing to save, no recompute cost).")
    g.add_argument("--recompute-method", default=None, choices=["uniform", "block"])
    g.add_argument("--recompute-num-layers", type=int, default=None)
    g.add_argument("--distribute-saved-activations", action="store_true")


def _add_mixed_precision_args(parser):
    g = parser.add_argument_group("mixed precision")
    g.add_argument("--fp16", action="store_true")
    g.add_argument("--bf16", action="store_true",
                   help="bf16 params; gradients are accumulated and reduced in fp32 (as in "
                        "Megatron-LM) unless --grad-reduce-in-bf16.")
    g.add_argument("--grad-reduce-in-bf16", action="store_true",
                   help="With --bf16: accumulate and reduce gradients in bf16 (half the "
                        "gradient memory and traffic, less exact sums).")
    g.add_argument("--loss-scale", type=float, default=None)
    g.add_argument("--initial-loss-scale", type=float, default=2.0 ** 32)
    g.add_argument("--min-loss-scale", type=float, default=1.0)
    g.add_argument("--loss-scale-window", type=float, default=1000)
    g.add_argument("--hysteresis", type=int, default=2)


def _add_optimizer_args(parser):
    g = parser.add_argument_group("optimizer and learning rate")
    g.add_argument("--optimizer", default="adam", choices=["adam", "sgd"])
    g.add_argument("--lr", type=float, default=None)
    g.add_argument("--min-lr", type=float, default=0.0)
    g.add_argument("--lr-decay-style", default="linear", choices=LR_DECAY_STYLES)
    g.add_argument("--lr-wsd-decay-style", default="exponential", choices=WSD_DECAY_STYLES)
    g.add_argument("--lr-decay-iters", type=int, default=None)
    g.add_argument("--lr-decay-samples", type=int, default=None)
    g.add_argument("--lr-wsd-decay-iters", type=int, default=None)
    g.add_argument("--lr-wsd-decay-samples", type=int, default=None)
    g.add_argument("--lr-warmup-fraction", type=float, default=None)
    g.add_argument("--lr-warmup-iters", type=int, default=0)
    g.add_argument("--lr-warmup-samples", type=int, default=0)
    g.add_argument("--lr-warmup-init", type=float, default=0.0)
    g.add_argument("--override-opt_param-scheduler", "--override-opt-param-scheduler",
                   dest="override_opt_param_scheduler", action="store_true")
    g.add_argument("--use-checkpoint-opt_param-scheduler",
                   "--use-checkpoint-opt-param-scheduler",
                   dest="use_checkpoint_opt_param_scheduler", action="store_true")
    g.add_argument("--weight-decay", type=float, default=0.01)
    g.add_argument("--start-weight-decay", type=float, default=None)
    g.add_argument("--end-weight-decay", type=float, default=None)
    g.add_argument("--weight-decay-incr-style", default="constant", choices=WD_INCR_STYLES)
    g.add_argument("--clip-grad", type=float, default=1.0)
    g.add_argument("--adam-beta1", type=float, default=0.9)
    g.add_argument("--adam-beta2", type=float, default=0.999)
    g.add_argument("--adam-eps", type=float, default=1e-8)
    g.add_argument("--sgd-momentum", type=float, default=0.9)


def _add_training_args(parser):
    g = parser.add_argument_group("training")
    g.add_argument("--micro-batch-size", type=int, default=None)
    g.add_argument("--global-batch-size", type=int, default=None,
                   help="Default micro batch x data-parallel size.")
    g.add_argument("--train-iters", type=int, default=None)
    g.add_argument("--train-samples", type=int, default=None)
    g.add_argument("--eval-interval", type=int, default=1000)
    g.add_argument("--eval-iters", type=int, default=100)
    g.add_argument("--seed", type=int, default=1234)
    g.add_argument("--exit-interval", type=int, default=None)
    g.add_argument("--exit-duration-in-mins", type=float, default=None)
    g.add_argument("--exit-signal-handler", action="store_true",
                   help="On SIGTERM (Slurm, preemption): finish the iteration, save, exit 0.")
    g.add_argument("--check-for-nan-in-loss-and-grad", dest="check_for_nan_in_loss_and_grad",
                   action="store_true", default=True,
                   help="Skip (and log) an update whose gradients are not finite (default).")
    g.add_argument("--no-check-for-nan-in-loss-and-grad", dest="check_for_nan_in_loss_and_grad",
                   action="store_false")
    g.add_argument("--max-consecutive-nan-iterations", type=int, default=3,
                   help="Stop (saving the last good state) after this many skipped updates in "
                        "a row with non-finite gradients.")
    g.add_argument("--dataloader-type", default="single", choices=["single", "cyclic"])
    g.add_argument("--num-workers", type=int, default=2)
    g.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    g.add_argument("--distributed-timeout-minutes", type=int, default=10,
                   help="How long a collective waits for the other ranks before the job fails "
                        "(also how long ranks wait for rank 0 to build dataset indices).")
    g.add_argument("--job-name", default=None)
    g.add_argument("--peak-tflops", type=float, default=None,
                   help="Per-device peak for MFU, in TFLOP/s. Default: 989 (H100 SXM dense "
                        "BF16) on CUDA; on CPU none, and MFU is not printed.")
    g.add_argument("--no-gradient-accumulation-fusion", dest="gradient_accumulation_fusion",
                   action="store_false",
                   help="Compute each weight gradient separately and add it to the DDP buffer "
                        "(default: the weight-gradient GEMM accumulates into it directly).")
    g.add_argument("--torch-compile", action="store_true",
                   help="torch.compile each layer's element-wise regions (norms, residual adds, "
                        "activation, RoPE); GEMMs, attention and TP collectives stay eager.")


def _add_checkpoint_args(parser):
    g = parser.add_argument_group("checkpointing")
    g.add_argument("--save", default=None)
    g.add_argument("--load", default=None)
    g.add_argument("--save-interval", type=int, default=None)
    g.add_argument("--no-save-optim", action="store_true")
    g.add_argument("--no-save-rng", action="store_true")
    g.add_argument("--no-load-optim", action="store_true")
    g.add_argument("--no-load-rng", action="store_true")
    g.add_argument("--finetune", action="store_true")
    g.add_argument("--ckpt-step", type=int, default=None)
    g.add_argument("--async-save", action="store_true")
    g.add_argument("--ckpt-format", default="torch_dist", choices=["torch_dist", "torch"],
                   help="torch_dist (default): every rank writes its own shard (safetensors "
                        "files and a JSON index), loadable at any TP/PP/VPP/DP; torch: "
                        "Megatron's mp_rank_* files. Both load whatever the flag says.")


def _add_logging_args(parser):
    g = parser.add_argument_group("logging")
    g.add_argument("--log-interval", type=int, default=100)
    g.add_argument("--tensorboard-dir", default=None)
    g.add_argument("--tensorboard-queue-size", type=int, default=1000)
    g.add_argument("--log-timers-to-tensorboard", action="store_true")
    g.add_argument("--timing-log-level", type=int, default=0, choices=[0, 1, 2],
                   help="Timers printed at --log-interval: 1 adds forward-backward, optimizer "
                        "and all-grads-sync; 2 also forward-compute and batch-generator.")
    g.add_argument("--timing-log-option", default="minmax", choices=["max", "minmax", "all"],
                   help="Timer report across ranks: the max, min and max, or every rank.")
    g.add_argument("--log-batch-size-to-tensorboard", action="store_true")
    g.add_argument("--log-validation-ppl-to-tensorboard", action="store_true")
    g.add_argument("--no-log-learning-rate-to-tensorboard", dest="log_learning_rate_to_tensorboard",
                   action="store_false")
    g.add_argument("--no-log-loss-scale-to-tensorboard", dest="log_loss_scale_to_tensorboard",
                   action="store_false")
    g.add_argument("--log-params-norm", action="store_true")
    g.add_argument("--log-num-zeros-in-grad", action="store_true")
    g.add_argument("--log-throughput", action="store_true")
    g.add_argument("--wandb-project", default=None,
                   help="Log the TensorBoard scalars to this W&B project too (from the last "
                        "rank; offline when WANDB_MODE is unset and W&B cannot be reached).")
    g.add_argument("--wandb-exp-name", default=None, help="The W&B run's name.")
    g.add_argument("--wandb-save-dir", default=None,
                   help="Where the W&B run's files go (default: <--save>/wandb, else ./wandb).")
    g.add_argument("--pipeline-trace-dir", default=None,
                   help="Ours (Megatron has none): write each rank's pipeline schedule trace "
                        "(forward, backward, waits) of one iteration as DIR/trace_rankNNNNN.json;"
                        " draw it with tools/plot_pipeline.py DIR --out FILE.png.")
    g.add_argument("--pipeline-trace-iteration", type=int, default=2,
                   help="Ours: the iteration --pipeline-trace-dir traces (default 2, past the "
                        "first iteration's warm-up).")


def _add_data_args(parser):
    g = parser.add_argument_group("data")
    g.add_argument("--data-path", nargs="*", default=None,
                   help="'prefix' or 'w1 prefix1 w2 prefix2 ...' (one or many words).")
    g.add_argument("--split", default="969, 30, 1")
    g.add_argument("--train-data-path", nargs="*", default=None)
    g.add_argument("--valid-data-path", nargs="*", default=None)
    g.add_argument("--test-data-path", nargs="*", default=None)
    g.add_argument("--data-cache-path", default=None)
    g.add_argument("--mock-data", action="store_true")
    g.add_argument("--data-impl", default="mmap", choices=["mmap"],
                   help="Accepted, no effect: .bin/.idx mmap is the only format.")
    g.add_argument("--reset-position-ids", action="store_true")
    g.add_argument("--reset-attention-mask", action="store_true")
    g.add_argument("--eod-mask-loss", action="store_true")


def get_parser() -> argparse.ArgumentParser:
    parser = _Parser(description="Megatron arguments", allow_abbrev=False)
    for add in (_add_network_args, _add_parallel_args, _add_mixed_precision_args,
                _add_optimizer_args, _add_training_args, _add_checkpoint_args,
                _add_logging_args, _add_data_args):
        add(parser)
    add_tokenizer_args(parser)
    return parser


def _unknown_flags_error(parser, extras: List[str]) -> ConfigError:
    known = list(parser._option_string_actions)
    lines = []
    for token in extras:
        if not token.startswith("-"):
            continue
        flag = token.split("=", 1)[0]
        close = difflib.get_close_matches(flag, known, n=3, cutoff=0.6)
        hint = f"; did you mean {' or '.join(close)}?" if close else ""
        lines.append(f"unknown flag {flag}{hint}")
    if not lines:
        lines.append(f"unexpected value(s) {' '.join(extras)} (no flag takes them)")
    return ConfigError("\n".join(lines))


def _need(ok: bool, message: str):
    if not ok:
        raise ConfigError(message)


def _warn(message: str) -> None:
    """A start-time warning: one line, from rank 0 only."""
    if is_reporting_rank():
        print(f"warning: {message}", file=sys.stderr, flush=True)


def _fold_aliases(args):
    """Old Megatron / Megatron-LLaMA spellings -> the current fields (kept in ``args``)."""
    if args.RMSNorm:
        args.normalization = "RMSNorm"
    if args.use_rotary_position_embeddings:
        args.position_embedding_type = "rope"
    elif args.no_position_embedding and args.position_embedding_type == "learned_absolute":
        args.position_embedding_type = "none"
    if args.recompute_activations:
        _need(args.recompute_granularity in (None, "selective"),
              "--recompute-activations means --recompute-granularity selective; it conflicts "
              f"with --recompute-granularity {args.recompute_granularity}. Drop one.")
        args.recompute_granularity = "selective"
    if args.max_position_embeddings is None:
        args.max_position_embeddings = args.seq_length
    if args.bf16:  # Megatron-LM's rule: bf16 gradients are summed in fp32 unless asked not to
        args.accumulate_allreduce_grads_in_fp32 = not getattr(args, "grad_reduce_in_bf16", False)
    if args.ffn_hidden_size is None and args.hidden_size is not None:
        if args.swiglu:  # Megatron: ~2/3 of 4h (same parameters), down to a multiple of 64
            args.ffn_hidden_size = int((4 * args.hidden_size * 2 / 3) / 64) * 64
            _need(args.ffn_hidden_size > 0, f"--swiglu with --hidden-size {args.hidden_size} "
                  "gives an FFN size of 0; pass --ffn-hidden-size.")
        else:
            args.ffn_hidden_size = 4 * args.hidden_size
    for name in ("data_path", "train_data_path", "valid_data_path", "test_data_path"):
        words = getattr(args, name)  # a quoted "0.2 D1 0.3 D2" is one argv word
        if words is not None:
            setattr(args, name, " ".join(words).split())


def _virtual_pipeline_size(args) -> Optional[int]:
    pp = args.pipeline_model_parallel_size
    per_stage, per_rank = (args.num_layers_per_virtual_pipeline_stage,
                           args.num_virtual_stages_per_pipeline_rank)
    _need(per_stage is None or per_rank is None,
          "--num-layers-per-virtual-pipeline-stage and --num-virtual-stages-per-pipeline-rank "
          "both set the interleaved schedule; give one.")
    if per_stage is None and per_rank is None:
        return None
    _need(pp > 1, "virtual pipeline stages need --pipeline-model-parallel-size > 1.")
    if per_rank is not None:
        return per_rank
    _need(args.decoder_first_pipeline_num_layers is None
          and args.decoder_last_pipeline_num_layers is None,
          "with --decoder-first/last-pipeline-num-layers give "
          "--num-virtual-stages-per-pipeline-rank instead of "
          "--num-layers-per-virtual-pipeline-stage.")
    _need(per_stage >= 1 and args.num_layers % (pp * per_stage) == 0,
          f"--num-layers {args.num_layers} is not divisible by --pipeline-model-parallel-size "
          f"{pp} x --num-layers-per-virtual-pipeline-stage {per_stage}.")
    return args.num_layers // (pp * per_stage)


def _check_flags(args):
    """Checks that need no world size and no file system."""
    for flag in ("num_layers", "hidden_size", "num_attention_heads", "seq_length",
                 "micro_batch_size", "lr"):
        _need(getattr(args, flag) is not None, f"--{flag.replace('_', '-')} is required.")
    _need(not (args.fp16 and args.bf16), "--fp16 and --bf16 are exclusive; pick one.")
    if args.pipeline_trace_dir is not None:
        last, n = args.train_iters, args.pipeline_trace_iteration
        _need(1 <= n <= (last or n), f"--pipeline-trace-iteration {n} is not an iteration of "
              f"this run: pick one from 1" + (f" to --train-iters {last}." if last else "."))
    _need(not (args.use_distributed_optimizer and args.overlapped_distributed_optimizer),
          "--use-distributed-optimizer and --overlapped-distributed-optimizer are exclusive; "
          "pick one (the overlapped one is the distributed optimizer with overlapped "
          "communication).")
    _need((args.train_iters is None) != (args.train_samples is None),
          "give exactly one of --train-iters or --train-samples (got "
          + ("both" if args.train_iters is not None else "neither") + ").")
    by_iters = args.train_iters is not None
    mixed = ([f for f in ("lr_decay_samples", "lr_wsd_decay_samples") if getattr(args, f)]
             + (["lr_warmup_samples"] if args.lr_warmup_samples else [])) if by_iters else \
        ([f for f in ("lr_decay_iters", "lr_wsd_decay_iters") if getattr(args, f)]
         + (["lr_warmup_iters"] if args.lr_warmup_iters else []))
    _need(not mixed, f"--train-{'iters' if by_iters else 'samples'} counts the schedule in "
          f"{'iterations' if by_iters else 'samples'}; replace "
          f"{', '.join('--' + f.replace('_', '-') for f in mixed)} with the "
          f"{'-iters' if by_iters else '-samples'} spelling.")
    if args.lr_warmup_fraction is not None:
        _need(not args.lr_warmup_iters and not args.lr_warmup_samples,
              "--lr-warmup-fraction and --lr-warmup-iters/--lr-warmup-samples both set the "
              "warmup; give one.")
    if args.weight_decay_incr_style == "constant":
        _need(args.start_weight_decay is None and args.end_weight_decay is None,
              "--start-weight-decay/--end-weight-decay need --weight-decay-incr-style linear or "
              "cosine; with constant, use --weight-decay.")
        args.start_weight_decay = args.end_weight_decay = args.weight_decay
    else:
        _need(args.start_weight_decay is not None and args.end_weight_decay is not None,
              f"--weight-decay-incr-style {args.weight_decay_incr_style} needs "
              "--start-weight-decay and --end-weight-decay.")
    _need(not getattr(args, "use_rope_scaling", False)
          or args.rope_high_freq_factor > args.rope_low_freq_factor,
          f"--rope-high-freq-factor {args.rope_high_freq_factor} must be greater than "
          f"--rope-low-freq-factor {args.rope_low_freq_factor} (LLaMA-3.1: 4 and 1).")
    _need(not (args.swiglu and args.openai_gelu),
          "--swiglu and --openai-gelu both choose the MLP activation; give one.")
    _need(args.num_query_groups == 1 or args.group_query_attention,
          "--num-query-groups needs --group-query-attention (Megatron ignores it otherwise).")
    _need(not args.sequence_parallel or args.tensor_model_parallel_size > 1,
          "--sequence-parallel needs --tensor-model-parallel-size > 1 (Megatron silently turns "
          "it off); drop the flag or raise the TP size.")
    _check_positions(args)
    _check_context_parallel(args)
    args.virtual_pipeline_model_parallel_size = _virtual_pipeline_size(args)


def _check_context_parallel(args):
    """CP cuts each sequence into 2 x CP chunks (rank r holds r and 2CP-1-r); under SP each
    rank's s / CP tokens are split again over TP."""
    cp, seq, tp = args.context_parallel_size, args.seq_length, args.tensor_model_parallel_size
    if cp == 1:
        return
    _need(seq % (2 * cp) == 0,
          f"--seq-length {seq} is not divisible by 2 x --context-parallel-size {cp} = {2 * cp} "
          f"(each sequence is cut into 2 x CP equal chunks); use a sequence length that is a "
          f"multiple of {2 * cp} or another CP size.")
    _need(not args.sequence_parallel or (seq // cp) % tp == 0,
          f"--sequence-parallel with --context-parallel-size {cp} splits each rank's "
          f"{seq // cp} tokens over --tensor-model-parallel-size {tp}, which does not divide "
          f"them; use a sequence length that is a multiple of {cp * tp * 2}.")
    _need(not args.allow_math_attention,
          "--allow-math-attention asks for SDPA's math kernel, which cannot be split over "
          "--context-parallel-size ranks (context parallelism runs its own blocked attention "
          "with log-sum-exp merging); drop one of the two flags.")


def _check_positions(args):
    """--seq-length against --max-position-embeddings: learned positions have a table of that
    size (an error past it); RoPE computes positions (the value is only recorded: a warning)."""
    seq, table = args.seq_length, args.max_position_embeddings
    if seq <= table:
        return
    _need(args.position_embedding_type != "learned_absolute",
          f"--seq-length {seq} is longer than --max-position-embeddings {table}, the size of "
          f"the learned position table (positions past it have no embedding); raise "
          f"--max-position-embeddings to {seq} or shorten --seq-length.")
    if args.position_embedding_type == "rope":
        _warn(f"--seq-length {seq} is longer than --max-position-embeddings {table}: RoPE "
              f"computes every position, so training uses all {seq}, but the model records "
              f"a context of {table} (an HF export's max_position_embeddings); pass "
              f"--max-position-embeddings {seq} to record the length trained on.")


def parse_args(argv: Optional[Sequence[str]] = None,
               parser: Optional[argparse.ArgumentParser] = None) -> argparse.Namespace:
    """Parse Megatron flags (``sys.argv[1:]`` when ``argv`` is None); ConfigError on any problem.

    Scripts add their own flags by passing a parser from ``get_parser()`` they extended."""
    parser = parser or get_parser()
    args, extras = parser.parse_known_args(argv)
    if extras:
        raise _unknown_flags_error(parser, extras)
    return validate_args(args)


def validate_args(args: argparse.Namespace) -> argparse.Namespace:
    """``parse_args``' folding of old spellings, derived values and checks, for a Namespace
    built another way (e.g. from a checkpoint's saved args: ``training/checkpoint_model.py``)."""
    check_flag_ranges(args)  # first: the other rules divide and multiply by these values
    _fold_aliases(args)
    _check_flags(args)
    return args


# ---------------------------------------------------------------------------------------------
# Namespace -> configs


# The mapping onto configs lives next door (it needs the world size and the file system).
from megatron.training.configs_from_args import build_configs  # noqa: E402
