"""``--use-checkpoint-args``: the model's architecture from the checkpoint at --load, over
the command line's, before the model is built (Megatron's flag).

The args are read as ``load_checkpoint`` reads them (the same iteration: --ckpt-step, else
the tracker's; the sharded format's JSON index, or the torch format's first rank file through
``safe_load``, which unpickles tensors and plain containers only)."""
import os
from typing import Dict, Optional, Tuple

from megatron.training.checkpointing.architecture import take_architecture
from megatron.training.checkpointing.load import choose_iteration, read_iteration_record
from megatron.training.checkpointing.paths import CheckpointError, iteration_dir_name
from megatron.training.guards.errors import is_reporting_rank


def read_checkpoint_args(args) -> Optional[Tuple[str, Dict]]:
    """(iteration directory, the args it records) of the checkpoint ``args.load`` names, or
    None when there is none yet (auto-resume's first start). CheckpointError otherwise."""
    chosen = choose_iteration(args)
    if chosen is None:
        return None
    iteration_dir = os.path.join(args.load, iteration_dir_name(*chosen))
    if not os.path.isdir(iteration_dir):
        raise CheckpointError(f"--use-checkpoint-args: {iteration_dir} does not exist; load "
                              f"another iteration with --ckpt-step.")
    record = read_iteration_record(iteration_dir)
    saved = record.get("args") if isinstance(record, dict) else None
    if not isinstance(saved, dict) or not saved.get("num_layers"):
        raise CheckpointError(f"--use-checkpoint-args: {iteration_dir} records no model "
                              f"flags (no saved args); give the architecture flags instead.")
    return iteration_dir, saved


def use_checkpoint_args(args) -> None:
    """With --use-checkpoint-args, set the checkpoint's architecture on ``args`` (parsed, not
    yet checked: the flags it supplies may be missing from the command line) and say so in
    one line (rank 0)."""
    if not getattr(args, "use_checkpoint_args", False):
        return
    if args.load is None:
        raise CheckpointError("--use-checkpoint-args takes the architecture from the "
                              "checkpoint at --load: add --load DIR, or drop the flag.")
    found = read_checkpoint_args(args)
    if found is None:
        message = (f"--use-checkpoint-args: no checkpoint in {args.load} yet, so the "
                   f"command line's architecture is used")
    else:
        iteration_dir, saved = found
        message = (f"--use-checkpoint-args: took the architecture of the checkpoint at "
                   f"{iteration_dir}: {' '.join(take_architecture(saved, args))}")
    if is_reporting_rank():
        print(message, flush=True)
