"""Telling a full disk from other write failures, and what a checkpoint needs on disk.

A full disk surfaces as OSError ENOSPC from Python writes, as torch's RuntimeError from its
zip writer ("unexpected pos 287680 vs 287568", "basic_ios::clear") and as safetensors' error
"(os error 28)"; the free space left when the write failed tells those apart from others."""
import errno
import os
import shutil
import socket
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from megatron.training.checkpointing.paths import CheckpointError

_ENOSPC_TEXTS = ("No space left on device", "os error 28", "unexpected pos",
                 "basic_ios::clear", "file write failed")


class DiskFullError(CheckpointError):
    """A write failed because the file system is full; the message says how much is needed."""


def _existing(path: str) -> str:
    """``path`` or its nearest existing parent."""
    path = os.path.abspath(path)
    while not os.path.exists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    return path


def free_bytes(path: str) -> Optional[int]:
    """Free bytes on the file system holding ``path`` (or its nearest existing parent)."""
    try:
        return shutil.disk_usage(_existing(path)).free
    except OSError:
        return None


@dataclass
class SaveSpace:
    """What one save writes on this rank's file system (all ranks sharing it, summed) and
    the free space there when the save began: the numbers a full disk is explained with."""
    needed: int
    free: Optional[int]
    ranks: int = 1


def space_for_save(directory: str, nbytes: int) -> SaveSpace:
    """Collective: every rank's ``nbytes`` summed over the ranks whose ``directory`` is on the
    same file system as this rank's (one node's ranks share a local disk; all share a network
    one), with this file system's free space now."""
    try:
        device_id = os.stat(_existing(directory)).st_dev
    except OSError:
        device_id = None
    mine = (socket.gethostname(), device_id, nbytes)
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    same = [n for host, dev, n in everyone if (host, dev) == mine[:2]]
    return SaveSpace(sum(same), free_bytes(directory), len(same))


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


def disk_full_message(directory: str, needed: int, free: Optional[int], ranks: int = 1) -> str:
    """``free``: measured before the write began (after it, the failed write's own removed
    files would count as free)."""
    who = f" (the {ranks} ranks writing there)" if ranks > 1 else ""
    free_text = "an unknown number of bytes were" if free is None else f"{free} were"
    shortfall = "" if free is None or free < needed else (
        " (more than the estimate: something else filled the disk meanwhile, or the "
        "file system's overhead)")
    return (f"no space left on device: writing {directory} needs about {needed} bytes on its "
            f"file system{who}, {free_text} free when it began{shortfall}; free some space or "
            f"choose a directory on a larger disk")
