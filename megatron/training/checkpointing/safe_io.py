"""Writing checkpoint files atomically and reading them without running pickled code."""
import os
import pickle
from typing import Any

import torch

from megatron.training.checkpointing.checksums import verify_torch_file
from megatron.training.checkpointing.disk_space import (
    DiskFullError,
    SaveSpace,
    disk_full_message,
    free_bytes,
    looks_like_disk_full,
)
from megatron.training.checkpointing.paths import CheckpointError
from megatron.training.guards.fault_injection import maybe_crash_while_writing


def atomic_save(obj: Any, path: str, iteration: int = -1) -> None:
    """torch.save to ``path.tmp``, fsync, then rename: a reader sees all of it or nothing."""
    tmp = path + ".tmp"
    torch.serialization.set_crc32_options(True)  # its default; safe_load verifies the CRCs
    try:
        torch.save(obj, tmp)
        maybe_crash_while_writing(tmp, iteration)  # tests only: see guards/fault_injection.py
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:  # a full disk, an interrupt: leave no partial file filling the disk
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


def save_or_report_disk_full(obj: Any, path: str, directory: str, space: SaveSpace,
                             iteration: int = -1) -> None:
    """``atomic_save``; a full disk raises DiskFullError naming ``directory`` and what the
    save needs there (``space``; the temporary file is already removed)."""
    try:
        atomic_save(obj, path, iteration)
    except Exception as exc:
        raise as_disk_full(exc, directory, space) from exc


def as_disk_full(exc: BaseException, directory: str, space: SaveSpace) -> BaseException:
    """DiskFullError for a write that failed on a full disk, else ``exc`` itself."""
    if isinstance(exc, DiskFullError):
        return exc
    if looks_like_disk_full(exc, free_bytes(directory), space.needed):
        return DiskFullError(disk_full_message(directory, space.needed, space.free,
                                               space.ranks))
    return exc


def safe_load(path: str) -> Any:
    """``torch.load(weights_only=True)``, memory-mapped: only tensors and plain data are
    rebuilt, so a file crafted to run code on unpickling is refused instead. Every record is
    first checked against the CRC-32 torch.save stored for it (checksums.py); a file that is
    not a zip is left to torch.load, which refuses it (mmap needs the zip format)."""
    if not os.path.isfile(path):
        raise CheckpointError(f"checkpoint file {path} does not exist; the checkpoint is "
                              f"incomplete (or for another parallel layout).")
    verify_torch_file(path)
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except pickle.UnpicklingError as exc:
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        raise CheckpointError(
            f"refusing to load {path}: it holds objects other than tensors and plain data, "
            f"which could run code when unpickled ({first_line}). Only load checkpoints you "
            f"trust, and convert them with a tool that checks them.") from None
    except Exception as exc:  # torch raises RuntimeError/EOFError/... for a damaged zip
        raise CheckpointError(f"checkpoint file {path} is corrupt or truncated "
                              f"({type(exc).__name__}: {exc}); load an earlier iteration with "
                              f"--ckpt-step.") from None


def plain_data(value):
    """Args as plain data (weights_only loads nothing else)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return [plain_data(v) for v in value]
    if isinstance(value, dict):
        return {str(k): plain_data(v) for k, v in value.items()}
    return str(value)
