"""One rank's file of the sharded format: a safetensors file (readable by any safetensors
tool; no pickle, so loading it cannot run code), written by streaming each tensor's bytes
(no second copy of the state in memory), read a byte range at a time.

Layout (the safetensors spec): 8-byte little-endian header length, a JSON header
``{key: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {str: str}}`` padded
with spaces to 8 bytes, then the tensors' bytes.
"""
import json
import math
import os
import struct
from typing import Dict, List, Optional, Tuple

import torch

from megatron.training.checkpointing.paths import CheckpointError

DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16",
          torch.float64: "F64", torch.int64: "I64", torch.int32: "I32", torch.uint8: "U8",
          torch.int8: "I8", torch.bool: "BOOL"}
_BY_NAME = {v: k for k, v in DTYPES.items()}
_CHUNK_BYTES = 64 << 20  # written per call: bounded staging for non-contiguous sources


def _tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without a copy."""
    flat = tensor.reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy()) if flat.numel() else memoryview(b"")


def write_shard_file(path: str, tensors: List[Tuple[str, torch.Tensor]],
                     metadata: Optional[Dict[str, str]] = None) -> int:
    """Write ``tensors`` (CPU, any layout) to ``path`` (the caller makes it atomic). Returns
    the bytes written."""
    header: Dict = {}
    offset = 0
    for key, tensor in tensors:
        if tensor.dtype not in DTYPES:
            raise ValueError(f"{key}: dtype {tensor.dtype} cannot be stored")
        nbytes = tensor.numel() * tensor.element_size()
        header[key] = {"dtype": DTYPES[tensor.dtype], "shape": list(tensor.shape),
                       "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    if metadata:
        header["__metadata__"] = metadata
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(encoded)))
        f.write(encoded)
        for _, tensor in tensors:
            flat = tensor.detach().reshape(-1)
            step = max(1, _CHUNK_BYTES // max(1, flat.element_size()))
            for lo in range(0, flat.numel(), step):
                f.write(_tensor_bytes(flat[lo:lo + step].contiguous().cpu()))
        f.flush()
        os.fsync(f.fileno())
    return 8 + len(encoded) + offset


class ShardFile:
    """Reads ranges of the 1-D tensors of one shard file. Validates the header against the
    file's size (a truncated or crafted file is a CheckpointError naming it)."""

    def __init__(self, path: str):
        self.path = path
        try:
            size = os.path.getsize(path)
            with open(path, "rb") as f:
                head = f.read(8)
                if len(head) < 8:
                    raise ValueError("shorter than a header")
                (length,) = struct.unpack("<Q", head)
                if length > size - 8 or length > 100 << 20:
                    raise ValueError(f"header length {length} past the end of the file")
                header = json.loads(f.read(length))
        except FileNotFoundError:
            raise CheckpointError(f"{path} is missing: the checkpoint is incomplete; load "
                                  f"another iteration with --ckpt-step.") from None
        except (OSError, ValueError, UnicodeDecodeError) as exc:
            raise CheckpointError(f"{path} is not a readable shard file ({exc}); the "
                                  f"checkpoint is damaged: load another iteration with "
                                  f"--ckpt-step.") from None
        self.metadata = header.pop("__metadata__", {}) if isinstance(header, dict) else {}
        self.data_start = 8 + length
        self.entries = {}
        for key, entry in (header.items() if isinstance(header, dict) else []):
            self.entries[key] = self._checked(key, entry, size)

    def _checked(self, key, entry, size):
        try:
            dtype = _BY_NAME[entry["dtype"]]
            shape = [int(s) for s in entry["shape"]]
            begin, end = (int(x) for x in entry["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(f"{self.path}: entry {key!r} is malformed; the checkpoint "
                                  f"is damaged.") from None
        itemsize = torch.empty(0, dtype=dtype).element_size()
        numel = 1
        for s in shape:
            numel *= s
        if min(shape, default=1) < 0 or end - begin != numel * itemsize or begin < 0 or \
                self.data_start + end > size:
            raise CheckpointError(f"{self.path}: {key!r} lies past the end of the file (the "
                                  f"file is truncated or damaged); load another iteration "
                                  f"with --ckpt-step.")
        return dtype, shape, begin

    def read_into(self, key: str, start: int, out: torch.Tensor) -> None:
        """Elements ``[start, start + out.numel())`` of ``key`` into ``out`` (1-D,
        contiguous): straight from the file when the dtypes agree, no intermediate copy."""
        if key not in self.entries:
            self.read(key)  # the error naming it
        if self.entries[key][0] == out.dtype and out.is_contiguous():
            self._read_bytes(key, start, start + out.numel(), out)
        else:
            out.copy_(self.read(key, start, start + out.numel()))

    def read(self, key: str, start: int = 0, stop: Optional[int] = None) -> torch.Tensor:
        """Elements ``[start, stop)`` of the flattened tensor ``key``: only those bytes."""
        if key not in self.entries:
            raise CheckpointError(f"{self.path} has no tensor {key!r} (its index names it); "
                                  f"the checkpoint is damaged.")
        dtype, shape, _ = self.entries[key]
        stop = math.prod(shape) if stop is None else stop
        out = torch.empty(max(0, stop - start), dtype=dtype)
        self._read_bytes(key, start, stop, out)
        return out

    def _read_bytes(self, key: str, start: int, stop: int, out: torch.Tensor) -> None:
        dtype, shape, begin = self.entries[key]
        numel = math.prod(shape)
        if not 0 <= start <= stop <= numel:
            raise CheckpointError(f"{self.path}: range [{start}, {stop}) of {key!r} is "
                                  f"outside its {numel} elements; the index is damaged.")
        itemsize = torch.empty(0, dtype=dtype).element_size()
        if stop > start:
            with open(self.path, "rb") as f:
                f.seek(self.data_start + begin + start * itemsize)
                view = memoryview(out.view(torch.uint8).numpy())
                if f.readinto(view) != len(view):
                    raise CheckpointError(f"{self.path} is truncated; load another iteration "
                                          f"with --ckpt-step.")
