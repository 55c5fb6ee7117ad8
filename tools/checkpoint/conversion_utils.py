"""What every conversion shares: the error a user sees, a progress line, and output
directories that appear whole or not at all."""
import contextlib
import os
import shutil
import sys
from typing import Dict

import torch

from megatron.training.checkpointing.disk_space import (
    DiskFullError,
    disk_full_message,
    free_bytes,
    looks_like_disk_full,
)
from megatron.training.checkpointing.preflight import output_path_problem


class ConversionError(Exception):
    """A problem the user can act on; convert.py prints it on one line and exits 1."""


def _shape_text(tensor: torch.Tensor) -> str:
    return str(list(tensor.shape))


def check_shapes(tensors: Dict[str, torch.Tensor], expected: Dict[str, torch.Tensor],
                 problem: str, source: str, fix: str) -> None:
    """ConversionError naming the first tensor of ``tensors`` (in ``expected``'s order) whose
    shape is not the one ``expected`` gives it, its shape and the expected one: ``problem``
    says what does not fit, ``source`` what implies the expected shapes, ``fix`` what to do.
    Names only one side has are left to the callers' name checks."""
    wrong = [name for name, want in expected.items()
             if name in tensors and tensors[name].shape != want.shape]
    if not wrong:
        return
    first = wrong[0]
    others = f" (and {len(wrong) - 1} more tensor(s))" if len(wrong) > 1 else ""
    raise ConversionError(f"{problem}: {first} has shape {_shape_text(tensors[first])} but "
                          f"{source} implies {_shape_text(expected[first])}{others}; {fix}")


def check_output_dir(path: str) -> str:
    """The absolute path of a new (or empty) output directory; nothing is ever overwritten.
    A path that is a file or lies under one is refused by pretrain's own --save check."""
    path = os.path.abspath(path)
    problem = output_path_problem(path, "--save", "the converted checkpoint")
    if problem is not None:
        raise ConversionError(problem)
    if os.path.exists(path) and (not os.path.isdir(path) or os.listdir(path)):
        raise ConversionError(f"output directory {path} exists and is not empty; give a new "
                              f"or empty directory (nothing is overwritten).")
    return path


@contextlib.contextmanager
def staged_output_dir(path: str, needed: int = 0):
    """Yield a staging directory next to ``path``, renamed to ``path`` when the block ends
    without an error and removed when it raises: a failed conversion leaves nothing behind.
    ``needed``: about how many bytes the output takes (named when the disk is full)."""
    path = check_output_dir(path)
    staging = path + ".partial"
    shutil.rmtree(staging, ignore_errors=True)  # a previous run's leftover
    os.makedirs(staging)
    free_at_start = free_bytes(staging)  # after a failure the removed files count as free
    try:
        yield staging
    except BaseException as exc:
        # DiskFullError: the checkpoint writers' own report, which knows one file's bytes
        # only; the whole output's estimate is said instead.
        full = isinstance(exc, DiskFullError) or (not isinstance(exc, ConversionError) and
                                                  looks_like_disk_full(exc, free_bytes(staging),
                                                                       needed))
        shutil.rmtree(staging, ignore_errors=True)
        if full:
            raise ConversionError(disk_full_message(path, needed, free_at_start)) from None
        raise
    if os.path.isdir(path):
        os.rmdir(path)  # empty, checked above
    os.rename(staging, path)


class Progress:
    """``what: [#####.....] 5/10`` on stderr: redrawn in place on a terminal, one line per
    step in a log file."""

    def __init__(self, what: str, total: int, stream=None, width: int = 30):
        self.what, self.total, self.width = what, max(int(total), 1), width
        self.stream = stream or sys.stderr
        self.tty = hasattr(self.stream, "isatty") and self.stream.isatty()

    def __call__(self, done: int, total: int = None, note: str = "") -> None:
        total = self.total if total is None else max(int(total), 1)
        filled = int(self.width * done / total)
        line = (f"{self.what}: [{'#' * filled}{'.' * (self.width - filled)}] {done}/{total}"
                f"{' ' + note if note else ''}")
        if self.tty:
            self.stream.write("\r" + line + ("\n" if done >= total else ""))
        else:
            self.stream.write(line + "\n")
        self.stream.flush()


def say(message: str) -> None:
    """A status line on stderr (stdout keeps only the final summary)."""
    print(message, file=sys.stderr, flush=True)
