"""Checks made once the model is built and any checkpoint loaded, before data and iteration 1:
the --save directory can be written (and roughly holds a checkpoint), so can --tensorboard-dir,
and the tokenizer is the one the loaded checkpoint was trained with. A run must not train for
hours to find out."""
import errno
import os
import shutil
import sys
from typing import List, Optional

import torch.distributed as dist

from megatron.core import parallel_state
from megatron.core.pipeline_parallel.model_chunks import unwrap_model
from megatron.training.checkpointing.disk_space import space_for_save
from megatron.training.guards.errors import exit_with_error, is_reporting_rank
from megatron.training.tokenizer import fingerprint as tokenizer_fingerprint

_PROBE = ".megatron_write_probe"


def _missing_ancestors(path: str) -> List[str]:
    """``path`` and its parents that do not exist yet, outermost first."""
    missing = []
    while not os.path.exists(path) and os.path.dirname(path) != path:
        missing.append(path)
        path = os.path.dirname(path)
    return missing[::-1]


_SAVE_CONTENTS = "the checkpoints (a new one, or one holding earlier checkpoints)"


def output_path_problem(path: str, flag: str = "--save",
                        contents: str = _SAVE_CONTENTS) -> Optional[str]:
    """What stops ``path`` from ever being a directory, found without touching the file
    system: it is a file, or one of its parents is; the problem as one line, or None. Also
    the conversion tool's check of its --save (tools/checkpoint/conversion_utils.py)."""
    if os.path.isfile(path):
        return (f"{flag} {path} is a file, not a directory; give a directory path for "
                f"{contents}.")
    blocker = next((p for p in _parents(path) if os.path.exists(p) and not os.path.isdir(p)),
                   None)
    if blocker is not None:
        return (f"{flag} {path} cannot be created: {blocker} is a file, not a directory; "
                f"choose a {flag} path whose parents are directories.")
    return None


def create_output_directory(path: str, flag: str = "--save",
                            contents: str = _SAVE_CONTENTS) -> Optional[str]:
    """Create ``path`` as the writer would; the problem as one line (what and the fix), or
    None. ``flag`` names the flag, ``contents`` what the directory will hold."""
    problem = output_path_problem(path, flag, contents)
    if problem is not None:
        return problem
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as exc:
        return (f"{flag} {path} cannot be created ({_reason(exc)}); choose a {flag} directory "
                f"you can write to, or create it first.")
    return None


def _parents(path: str) -> List[str]:
    out = []
    while os.path.dirname(path) != path:
        path = os.path.dirname(path)
        out.append(path)
    return out


def _reason(exc: OSError) -> str:
    return "read-only file system" if exc.errno == errno.EROFS else str(exc.strerror).lower()


def probe_writable(path: str, flag: str = "--save") -> Optional[str]:
    """Create and remove a file in ``path`` (permission bits do not stop root, a read-only
    mount does: only a real write tells); the problem as one line, or None."""
    probe = os.path.join(path, f"{_PROBE}.{os.getpid()}")
    try:
        with open(probe, "wb") as f:
            f.write(b"x")
    except OSError as exc:
        return (f"{flag} {path} is not writable ({_reason(exc)}); make it writable or choose "
                f"another {flag} directory.")
    finally:
        if os.path.exists(probe):
            os.remove(probe)
    return None


def estimated_checkpoint_bytes(model_chunks, configs) -> int:
    """This rank's share of one checkpoint (weights + optimizer state): in the sharded format
    every data-parallel rank writes 1/DP of its (TP, PP) position's bytes; in the torch
    format DP rank 0 writes them all and the others nothing."""
    weights, numel = 0, 0
    for chunk in model_chunks:
        for tensor in unwrap_model(chunk).state_dict().values():
            weights += tensor.numel() * tensor.element_size()
            numel += tensor.numel()
    total = weights
    if not configs.training.no_save_optim:
        o = configs.optimizer
        total += numel * ((8 if o.optimizer == "adam" else 4) + (4 if (o.fp16 or o.bf16) else 0))
    dp_rank = parallel_state.get_data_parallel_rank(with_context_parallel=True)
    if configs.training.ckpt_format == "torch_dist":
        dp = parallel_state.get_data_parallel_world_size(with_context_parallel=True)
        return -(-total // dp)
    return total if dp_rank == 0 else 0


def _space_problem(save: str, space, skip: bool) -> Optional[str]:
    """The line for a checkpoint that cannot fit (None when it fits or is unknown)."""
    if space.free is None or space.free >= space.needed:
        return None
    who = f" ({space.ranks} ranks write there)" if space.ranks > 1 else ""
    what = (f"--save {save} has {space.free} bytes free on its file system but one checkpoint "
            f"needs about {space.needed} bytes there{who}")
    if skip:
        return f"warning: {what}: the save will fail unless space is freed meanwhile."
    return (f"{what}; free some space, choose a --save directory on a larger disk, or pass "
            f"--skip-disk-space-check to train anyway.")


def _agree(problem: Optional[str]) -> Optional[str]:
    problems = [None] * dist.get_world_size()
    dist.all_gather_object(problems, problem)
    return next((p for p in problems if p is not None), None)


def check_save_directory(save: Optional[str], model_chunks, configs) -> None:
    """Collective. Exit 2 (every rank, one line from rank 0) if --save cannot be written or
    its file system has less free space than one checkpoint needs (a warning with
    --skip-disk-space-check). A directory created only for the probe is removed again (the
    save creates it)."""
    if save is None:
        return
    save = os.path.abspath(save)
    created = []
    problem = None
    if dist.get_rank() == 0:
        created = _missing_ancestors(save)
        problem = create_output_directory(save)
    problem = _agree(problem)
    if problem is None and parallel_state.get_data_parallel_rank(with_context_parallel=True) == 0:
        problem = probe_writable(save)  # the ranks that will write
    problem = _agree(problem)
    skip = configs.training.skip_disk_space_check
    space = space_for_save(save, estimated_checkpoint_bytes(model_chunks, configs))
    if problem is None:  # the first rank whose file system is too small speaks for all
        problem = _agree(_space_problem(save, space, skip))
    if created and os.path.isdir(created[0]):
        shutil.rmtree(created[0], ignore_errors=True)
    dist.barrier()
    if problem is not None and problem.startswith("warning: "):
        if dist.get_rank() == 0:
            print(problem, file=sys.stderr, flush=True)
    elif problem is not None:
        exit_with_error(problem, code=2)


def check_tensorboard_directory(tensorboard_dir: Optional[str]) -> None:
    """Collective. Exit 2 (one line) if --tensorboard-dir cannot be written, probed on the rank
    that writes the event files (the last), as --save is; a directory created only for the
    probe is removed again (TensorBoard's writer creates it)."""
    if tensorboard_dir is None:
        return
    path = os.path.abspath(tensorboard_dir)
    problem = None
    if dist.get_rank() == dist.get_world_size() - 1:
        created = _missing_ancestors(path)
        problem = (create_output_directory(path, "--tensorboard-dir", "the TensorBoard event "
                                         "files") or probe_writable(path, "--tensorboard-dir"))
        if created and os.path.isdir(created[0]):
            shutil.rmtree(created[0], ignore_errors=True)
    problem = _agree(problem)
    if problem is not None:
        exit_with_error(problem, code=2)


def record_tokenizer_fingerprint(args, tokenizer=None) -> Optional[dict]:
    """Record this run's tokenizer fingerprint in ``args`` (saved with every checkpoint; the
    load compares its vocabulary size with the checkpoint's); None without tokenizer flags."""
    current = getattr(args, tokenizer_fingerprint.FINGERPRINT_ARG, None)
    if current is not None:
        return current
    try:
        current = tokenizer_fingerprint.fingerprint_from_args(args, tokenizer)
    except (ValueError, FileNotFoundError):  # no tokenizer flags (a test's bare args)
        return None
    setattr(args, tokenizer_fingerprint.FINGERPRINT_ARG, current)
    return current


def check_tokenizer(args, resumed, tokenizer=None) -> None:
    """Record this run's tokenizer fingerprint in ``args`` and warn, on rank 0, when the
    loaded checkpoint was trained with another tokenizer."""
    current = record_tokenizer_fingerprint(args, tokenizer)
    if current is None:
        return
    saved = getattr(resumed, "tokenizer", None)
    if is_reporting_rank() and tokenizer_fingerprint.differ(saved, current):
        print(tokenizer_fingerprint.mismatch_warning(saved, current, resumed.path,
                                                     bool(getattr(args, "finetune", False))),
              file=sys.stderr, flush=True)


def check_checkpoint_start(args, configs, model_chunks, resumed, tokenizer=None) -> None:
    """Everything above, in the order a user would want to learn it (``tokenizer``: the run's,
    if built already)."""
    check_tokenizer(args, resumed, tokenizer)
    check_save_directory(configs.training.save, model_chunks, configs)
    check_tensorboard_directory(configs.training.tensorboard_dir)
