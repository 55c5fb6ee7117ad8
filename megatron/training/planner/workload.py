"""What to plan for: a model given as Megatron flags, its sequence length, global batch and
vocabulary. The flags are parsed by ``arguments.parse_args`` (so any command line that trains
also plans) after dropping every flag the planner chooses itself (``LAYOUT_DESTS``) and those
that mean something only with one of them (``without_layout_flags``)."""
import argparse
from dataclasses import dataclass
from typing import List, Optional, Sequence

from megatron.training.arguments import get_parser, parse_args
from megatron.training.arguments.dependencies import given_dests, left_without_partner
from megatron.training.training_config import ConfigError

# The parsed fields the planner decides: parallel layout (CP included), batch split,
# recomputation, optimizer sharding and precision. Their flags are removed from the input and
# set per layout.
LAYOUT_DESTS = frozenset({
    "tensor_model_parallel_size", "pipeline_model_parallel_size", "sequence_parallel",
    "context_parallel_size", "cp_comm_type",
    "num_layers_per_virtual_pipeline_stage", "num_virtual_stages_per_pipeline_rank",
    "decoder_first_pipeline_num_layers", "decoder_last_pipeline_num_layers",
    "account_for_embedding_in_pipeline_split", "account_for_loss_in_pipeline_split",
    "use_distributed_optimizer", "overlapped_distributed_optimizer", "overlap_grad_reduce",
    "overlap_param_gather", "accumulate_allreduce_grads_in_fp32", "recompute_activations",
    "recompute_granularity", "recompute_method", "recompute_num_layers",
    "distribute_saved_activations", "micro_batch_size", "global_batch_size", "fp16", "bf16",
    "grad_reduce_in_bf16", "shard_gradients", "use_torch_fsdp2", "reshard_after_forward",
    "optimizer_cpu_offload", "expert_model_parallel_size",
    "num_distributed_optimizer_instances", "fsdp2_reduce_gradients_once"})


def _without_dests(flags: Sequence[str], dests, parser) -> List[str]:
    """``flags`` minus those setting ``dests`` (``--flag value``, ``--flag=value``, switches)."""
    actions = parser._option_string_actions
    kept, i = [], 0
    while i < len(flags):
        token = flags[i]
        action = actions.get(token.split("=", 1)[0]) if token.startswith("--") else None
        if action is not None and action.dest in dests:
            takes_value = action.nargs != 0 and "=" not in token
            i += 2 if takes_value else 1
            continue
        kept.append(token)
        i += 1
    return kept


def _parser_for(flags: Sequence[str]) -> argparse.ArgumentParser:
    """The Megatron parser with what parse_args requires but the plan does not use filled in:
    defaults that any flag in ``flags`` replaces."""
    parser = get_parser()
    parser.set_defaults(micro_batch_size=1, lr=1e-4)
    if not any(t.split("=", 1)[0] in ("--train-iters", "--train-samples") for t in flags):
        parser.set_defaults(train_iters=1)
    return parser


def without_layout_flags(flags: Sequence[str]) -> List[str]:
    """``flags`` minus the planner's own (``LAYOUT_DESTS``), and minus the flags that only
    those gave a meaning (dependencies.py's table, ``left_without_partner``):
    ``--reduce-bucket-size`` goes with ``--overlapped-distributed-optimizer``, ``--loss-scale``
    with ``--fp16``, ``--pipeline-schedule`` with ``--pipeline-model-parallel-size``. A flag
    that did nothing in the input either stays, for parse_args to refuse."""
    kept = _without_dests(flags, LAYOUT_DESTS, get_parser())
    parser = _parser_for(kept)
    try:
        given_args, _ = parser.parse_known_args(list(flags))
        args, _ = parser.parse_known_args(kept)
    except ConfigError:  # a malformed value: parse_args names it
        return kept
    # Unfolded values (no validate_args): the two differ only in the layout dests, and the
    # rows are compared between them.
    removed = {dest: getattr(given_args, dest) for dest in LAYOUT_DESTS}
    dead = left_without_partner(parser, args, given_dests(parser, kept, args), removed)
    return _without_dests(kept, dead, parser)


def _given_global_batch(flags: Sequence[str]) -> Optional[int]:
    """The input's own --global-batch-size (read before the layout flags are dropped)."""
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    parser.add_argument("--global-batch-size", type=int, default=None)
    try:
        return parser.parse_known_args(list(flags))[0].global_batch_size
    except SystemExit:  # a malformed value: parse_args below names it
        return None


@dataclass
class Workload:
    """The model (layout-free parsed flags) and the batch the plan is for."""
    args: argparse.Namespace
    flags: List[str]  # the layout-free flags, with the planner's overrides: a row's flags follow
    global_batch_size: int

    @property
    def seq_length(self) -> int:
        return self.args.seq_length

    @property
    def vocab_size(self) -> int:
        return self.args.vocab_size

    def describe(self) -> str:
        a = self.args
        groups = a.num_query_groups if a.group_query_attention else a.num_attention_heads
        experts = ""
        if getattr(a, "num_experts", None):
            experts = (f", {a.num_experts} experts (top-{a.moe_router_topk}, expert FFN "
                       f"{a.moe_ffn_hidden_size or a.ffn_hidden_size})")
        fp8 = ""
        if getattr(a, "fp8_format", None):
            fp8 = (f"; FP8 {a.fp8_format} {a.fp8_recipe} (mem GiB includes the FP8 weight "
                   f"copies; the step time is at the bf16 efficiency until a GPU run measures "
                   f"FP8's: bench/fp8_step.py)")
        return (f"{a.num_layers} layers, hidden {a.hidden_size}, {a.num_attention_heads} heads "
                f"({groups} query groups), FFN {a.ffn_hidden_size}"
                f"{' SwiGLU' if a.swiglu else ''}{experts}, vocabulary {a.vocab_size}, sequence "
                f"{a.seq_length}, global batch {self.global_batch_size} "
                f"({self.global_batch_size * a.seq_length:,} tokens){fp8}")


def workload_from_flags(flags: Sequence[str], *, seq_length: Optional[int] = None,
                        global_batch_size: Optional[int] = None,
                        vocab_size: Optional[int] = None) -> Workload:
    """Parse the model flags; ``seq_length`` / ``global_batch_size`` / ``vocab_size`` override
    theirs. ConfigError when the flags do not parse or a needed value is missing."""
    if global_batch_size is None:
        global_batch_size = _given_global_batch(flags)
    kept = without_layout_flags(flags)
    if seq_length is not None:
        kept += ["--seq-length", str(seq_length)]
    if vocab_size is not None:
        kept += ["--vocab-size", str(vocab_size)]
    if not any(t in ("--torch-compile", "--no-torch-compile") for t in kept):
        kept.append("--torch-compile")  # what the GPUs planned for run by default
    parser = _parser_for(kept)
    try:
        args = parse_args(kept, parser)
    except ConfigError as exc:
        raise ConfigError(f"the model flags do not parse: {exc}") from None
    for value, fix in ((args.num_layers, "--num-layers"), (args.hidden_size, "--hidden-size"),
                       (args.num_attention_heads, "--num-attention-heads")):
        if value is None:
            raise ConfigError(f"the model flags lack {fix}; give the whole model.")
    if args.vocab_size is None:
        raise ConfigError("the vocabulary size is unknown: pass --vocab-size N (LLaMA and "
                          "LLaMA-2: 32000; GPT-2: 50257).")
    if global_batch_size is None:
        raise ConfigError("the global batch size is unknown: pass --global-batch-size N "
                          "(sequences per optimizer step).")
    if global_batch_size < 1:
        raise ConfigError(f"--global-batch-size must be >= 1, got {global_batch_size}.")
    return Workload(args, kept, global_batch_size)
