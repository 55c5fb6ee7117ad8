"""Parsing Megatron's flags: ``parse_args`` and ``validate_args``.

The flags themselves are defined in definitions.py (``get_parser``). ``parse_args(argv)``
returns a plain ``argparse.Namespace`` (checkpoints store ``vars(args)``), with Megatron's old
spellings folded into the current ones (``--RMSNorm`` -> ``normalization``,
``--use-rotary-position-embeddings`` -> ``position_embedding_type='rope'``, ...) and every check
that needs no world size done (numeric ranges: ranges.py). The remaining checks and the
mapping onto configs are ``build_configs`` in configs.py.
Every problem raises ``ConfigError`` naming the flag and the fix; entry points print it and exit
non-zero before any process group or file is touched.
"""
import argparse
import difflib
import sys
from typing import Callable, List, Optional, Sequence

from megatron.training.arguments.definitions import get_parser
from megatron.training.arguments.dependencies import check_flag_dependencies, given_dests
from megatron.training.arguments.ranges import check_flag_ranges
from megatron.training.guards.errors import is_reporting_rank
from megatron.training.training_config import ConfigError


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


_VIRTUAL_FLAGS = "--num-layers-per-virtual-pipeline-stage / --num-virtual-stages-per-pipeline-rank"


def _schedule_virtual_size(args, vpp: Optional[int]) -> Optional[int]:
    """The virtual pipeline size --pipeline-schedule runs with (``vpp``: the one the virtual
    stage flags ask for); zbv always has 2 chunks per rank, placed in a V."""
    schedule = getattr(args, "pipeline_schedule", None)
    if schedule is None:
        return vpp
    if schedule == "interleaved":
        _need(vpp is not None, "--pipeline-schedule interleaved needs virtual pipeline stages: "
              "add --num-layers-per-virtual-pipeline-stage (or "
              "--num-virtual-stages-per-pipeline-rank), or use --pipeline-schedule 1f1b.")
    elif schedule in ("1f1b", "zb-h1"):
        _need(vpp is None, f"--pipeline-schedule {schedule} runs one model chunk per pipeline "
              f"rank; drop {_VIRTUAL_FLAGS}, or use --pipeline-schedule interleaved or zbv.")
    elif schedule == "zbv":
        return _zbv_virtual_size(args, vpp)
    return vpp


def _zbv_virtual_size(args, vpp: Optional[int]) -> int:
    pp, layers = args.pipeline_model_parallel_size, args.num_layers
    _need(pp > 1, f"--pipeline-schedule zbv needs --pipeline-model-parallel-size >= 2, got {pp}.")
    _need(vpp in (None, 2), f"--pipeline-schedule zbv places 2 model chunks per pipeline rank "
          f"(in a V), but {_VIRTUAL_FLAGS} ask for {vpp}; drop them.")
    _need(args.decoder_first_pipeline_num_layers is None
          and args.decoder_last_pipeline_num_layers is None,
          "--pipeline-schedule zbv puts the first and the last stage on pipeline rank 0, so "
          "--decoder-first/last-pipeline-num-layers do not apply; drop them (or use "
          "--account-for-embedding/loss-in-pipeline-split).")
    accounted = args.account_for_embedding_in_pipeline_split or \
        args.account_for_loss_in_pipeline_split
    _need(accounted or layers % (2 * pp) == 0,  # the accounted split is checked by the config
          f"--pipeline-schedule zbv cuts the model into 2 x --pipeline-model-parallel-size {pp}"
          f" = {2 * pp} virtual stages; --num-layers {layers} is not a multiple of {2 * pp}.")
    return 2


def _virtual_pipeline_size(args) -> Optional[int]:
    return _schedule_virtual_size(args, _virtual_size_from_flags(args))


def _virtual_size_from_flags(args) -> Optional[int]:
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
    _need(not (getattr(args, "use_rope_scaling", False)
               and getattr(args, "rope_type", "rope") == "yarn"),
          "--use-rope-scaling (LLaMA-3.1) and --rope-type yarn both rescale the rotary "
          "frequencies; give one.")
    activations = [flag for flag, dest in (("--swiglu", "swiglu"), ("--quick-geglu", "quick_geglu"),
                                           ("--openai-gelu", "openai_gelu"))
                   if getattr(args, dest, False)]
    _need(len(activations) < 2,
          f"{' and '.join(activations)} {'all' if len(activations) > 2 else 'both'} choose "
          f"the MLP activation; give one.")
    _need(args.num_query_groups == 1 or args.group_query_attention,
          "--num-query-groups needs --group-query-attention (Megatron ignores it otherwise).")
    _need(not args.sequence_parallel or args.tensor_model_parallel_size > 1,
          "--sequence-parallel needs --tensor-model-parallel-size > 1 (Megatron silently turns "
          "it off); drop the flag or raise the TP size.")
    _need(not getattr(args, "mtp_num_layers", None) or args.pipeline_model_parallel_size == 1
          or args.position_embedding_type != "learned_absolute",
          "--mtp-num-layers under pipeline parallelism looks the tokens up on the last stage, "
          "which has no copy of the learned position embeddings: use --position-embedding-type "
          "rope (or none), or --pipeline-model-parallel-size 1.")
    _need(not (getattr(args, "multi_latent_attention", False) and args.add_qkv_bias),
          "--add-qkv-bias: multi-latent attention's query and key/value projections have no "
          "biases (Megatron's); drop --add-qkv-bias.")
    _check_positions(args)
    _check_context_parallel(args)
    args.virtual_pipeline_model_parallel_size = _virtual_pipeline_size(args)


def _check_context_parallel(args):
    """CP cuts each sequence into 2 x CP chunks (rank r holds r and 2CP-1-r); under SP each
    rank's s / CP tokens are split again over TP. --allow-math-attention is allowed: under CP
    it accepts the fp32 reference block kernel on CUDA (configs.py checks when it would run)."""
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


def _check_positions(args):
    """--seq-length against --max-position-embeddings: learned positions have a table of that
    size (an error past it); RoPE computes positions (the value is only recorded: a warning
    naming the rope scaling flags); no position embedding: nothing to check."""
    seq, table = args.seq_length, args.max_position_embeddings
    if seq <= table:
        return
    _need(args.position_embedding_type != "learned_absolute",
          f"--seq-length {seq} is longer than --max-position-embeddings {table}, the size of "
          f"the learned position table (positions past it have no embedding); raise "
          f"--max-position-embeddings to {seq} or shorten --seq-length.")
    if args.position_embedding_type == "rope":
        # Past the trained context, unscaled RoPE meets rotation angles it never saw: name
        # the scaling flags unless they are on already.
        scaled = getattr(args, "use_rope_scaling", False) or \
            getattr(args, "rope_type", "rope") == "yarn"
        scaling = "" if scaled else (
            f", or, to extend a model trained at {table} positions, --use-rope-scaling "
            f"--rope-scaling-factor {seq / table:g} --rope-original-max-position-embeddings "
            f"{table}")
        _warn(f"--seq-length {seq} is longer than --max-position-embeddings {table}: RoPE "
              f"computes every position, so training uses all {seq}, but the model records "
              f"a context of {table} (an HF export's max_position_embeddings); pass "
              f"--max-position-embeddings {seq} to record the length trained on{scaling}.")


def parse_args(argv: Optional[Sequence[str]] = None,
               parser: Optional[argparse.ArgumentParser] = None,
               before_checks: Optional[Callable[[argparse.Namespace], None]] = None
               ) -> argparse.Namespace:
    """Parse Megatron flags (``sys.argv[1:]`` when ``argv`` is None); ConfigError on any problem,
    a flag typed without the flag it needs included (dependencies.py).

    Scripts add their own flags by passing a parser from ``get_parser()`` they extended.
    ``before_checks`` may fill in flags first (--use-checkpoint-args: the checkpoint's
    architecture, so those flags need not be on the command line)."""
    parser = parser or get_parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    args, extras = parser.parse_known_args(argv)
    if extras:
        raise _unknown_flags_error(parser, extras)
    given = given_dests(parser, argv, args)  # before validate_args folds and derives values
    if before_checks is not None:
        before_checks(args)
    validate_args(args)
    # Only here: a Namespace from a checkpoint (validate_args alone) has no command line.
    check_flag_dependencies(parser, args, given)
    return args


def validate_args(args: argparse.Namespace) -> argparse.Namespace:
    """``parse_args``' folding of old spellings, derived values and checks, for a Namespace
    built another way (e.g. from a checkpoint's saved args: ``training/checkpoint_model.py``)."""
    check_flag_ranges(args)  # first: the other rules divide and multiply by these values
    _fold_aliases(args)
    _check_flags(args)
    return args
