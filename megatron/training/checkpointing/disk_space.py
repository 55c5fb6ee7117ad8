"""Telling a full disk from other write failures, and what a checkpoint needs on disk.

A full disk surfaces as OSError ENOSPC from Python writes, as torch's RuntimeError from its
zip writer ("unexpected pos 287680 vs 287568", "basic_ios::clear") and as safetensors' error
"(os error 28)"; the free space left when the write failed tells those apart from others."""
import errno
import os
import shutil
from typing import Optional

import torch

from megatron.training.checkpointing.paths import CheckpointError

_ENOSPC_TEXTS = ("No space left on device", "os error 28", "unexpected pos",
                 "basic_ios::clear", "file write failed")


class DiskFullError(CheckpointError):
    """A write failed because the file system is full; the message says how much is needed."""


def free_bytes(path: str) -> Optional[int]:
    """Free bytes on the file system holding ``path`` (or its nearest existing parent)."""
    path = os.path.abspath(path)
    while not os.path.exists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return None


def tree_nbytes(tree) -> int:
    """Bytes of every tensor storage in a nested dict/list (what torch.save will write)."""
    seen, total, stack = set(), 0, [tree]
    while stack:
        value = stack.pop()
        if torch.is_tensor(value):
            storage = value.untyped_storage()
            key = (storage.device, storage.data_ptr())
            if key not in seen:
                seen.add(key)
                total += storage.nbytes()
        elif isinstance(value, dict):
            stack.extend(value.values())
        elif isinstance(value, (list, tuple)):
            stack.extend(value)
    return total


def looks_like_disk_full(exc: BaseException, free: Optional[int], needed: int) -> bool:
    """ENOSPC itself, or a write error (torch's, safetensors') while the disk is full."""
    if isinstance(exc, OSError) and exc.errno == errno.ENOSPC:
        return True
    if not any(text in str(exc) for text in _ENOSPC_TEXTS):
        return False
    return "No space left" in str(exc) or "os error 28" in str(exc) or \
        (free is not None and free < max(needed, 1 << 20))


def disk_full_message(directory: str, needed: int, free: Optional[int]) -> str:
    free_text = "unknown" if free is None else f"{free}"
    return (f"no space left on device: writing {directory} needs about {needed} bytes, "
            f"{free_text} free; free some space or choose a directory on a larger disk")
