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
from megatron.training.checkpointing.disk_space import free_bytes
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


def create_output_directory(path: str, flag: str = "--save",
                          contents: str = _SAVE_CONTENTS) -> Optional[str]:
    """Create ``path`` as the writer would; the problem as one line (what and the fix), or
    None. ``flag`` names the flag, ``contents`` what the directory will hold."""
    if os.path.isfile(path):
        return (f"{flag} {path} is a file, not a directory; give a directory path for "
                f"{contents}.")
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as exc:
        blocker = next((p for p in _parents(path) if os.path.exists(p) and not
                        os.path.isdir(p)), None)
        if blocker is not None:
            return (f"{flag} {path} cannot be created: {blocker} is a file, not a directory; "
                    f"choose a {flag} path whose parents are directories.")
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
    """This rank's share of one checkpoint (weights + optimizer state); 0 where it writes none
    (data-parallel ranks > 0)."""
    if parallel_state.get_data_parallel_rank(with_context_parallel=True) != 0:
        return 0
    weights, numel = 0, 0
    for chunk in model_chunks:
        for tensor in unwrap_model(chunk).state_dict().values():
            weights += tensor.numel() * tensor.element_size()
            numel += tensor.numel()
    if configs.training.no_save_optim:
        return weights
    o = configs.optimizer
    per_param = (8 if o.optimizer == "adam" else 4) + (4 if (o.fp16 or o.bf16) else 0)
    return weights + numel * per_param


def _agree(problem: Optional[str]) -> Optional[str]:
    problems = [None] * dist.get_world_size()
    dist.all_gather_object(problems, problem)
    return next((p for p in problems if p is not None), None)


def check_save_directory(save: Optional[str], model_chunks, configs) -> None:
    """Collective. Exit 2 (every rank, one line from rank 0) if --save cannot be written;
    warn when the disk has less free space than one checkpoint needs. A directory created
    only for the probe is removed again (the save creates it)."""
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
    needed = [0] * dist.get_world_size()
    dist.all_gather_object(needed, estimated_checkpoint_bytes(model_chunks, configs))
    free = free_bytes(save) if dist.get_rank() == 0 else None
    if created and os.path.isdir(created[0]):
        shutil.rmtree(created[0], ignore_errors=True)
    dist.barrier()
    if problem is not None:
        exit_with_error(problem, code=2)
    if dist.get_rank() == 0 and free is not None and free < sum(needed):
        print(f"warning: --save {save} has {free} bytes free but one checkpoint needs about "
              f"{sum(needed)} bytes: the save will fail; free some space or choose a larger "
              f"disk.", file=sys.stderr, flush=True)


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
