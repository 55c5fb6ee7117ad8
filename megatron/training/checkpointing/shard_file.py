"""One rank's file of the sharded format: a safetensors file (readable by any safetensors
tool; no pickle, so loading it cannot run code), written by streaming each tensor's bytes
(no second copy of the state in memory), read a byte range at a time.

Layout (the safetensors spec): 8-byte little-endian header length, a JSON header
``{key: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {str: str}}`` padded
with spaces to 8 bytes, then the tensors' bytes.

Checksums (checksums.py) live in ``__metadata__["checksums"]`` (a JSON string, so any
safetensors tool still reads the file): ``{"algorithm", "block_bytes", "tensors": {key:
{"holds": [global name, box offset, box shape, start, stop] or null, "blocks": hex CRCs}}}``.
``holds`` binds the bytes to the piece of the global tensor the index says they are: an index
edited to point one tensor's piece at another key is refused, not loaded. The CRCs are
computed while the bytes are written (never read back): the header is written with
placeholders of the same width, then rewritten in place once the data is out.
"""
import json
import math
import os
import struct
from concurrent.futures import ThreadPoolExecutor
from typing import Dict, List, Optional, Tuple

import torch

from megatron.training.checkpointing import checksums
from megatron.training.checkpointing.paths import CheckpointError

DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16",
          torch.float64: "F64", torch.int64: "I64", torch.int32: "I32", torch.uint8: "U8",
          torch.int8: "I8", torch.bool: "BOOL"}
_BY_NAME = {v: k for k, v in DTYPES.items()}
# Written per call (bounded staging for non-contiguous sources) and checksummed beside the
# write. Small enough that the CRC thread reads the chunk while the write's copy has it in
# cache: at 64 MiB the two streamed it from memory separately, and on 2 cores 8 of 20 1 GB
# shard writes stalled past 0.9 s against 1 of 20 without checksums; at 2 MiB none did and
# the checksums cost +1.8 % at the median (BENCHMARKS.md, "Checkpoint checksums, part 2").
_CHUNK_BYTES = 2 << 20
assert _CHUNK_BYTES % checksums.BLOCK_BYTES == 0  # a chunk's blocks are the tensor's blocks


def _tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without a copy."""
    flat = tensor.reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy()) if flat.numel() else memoryview(b"")


def write_shard_file(path: str, tensors: List[Tuple[str, torch.Tensor]],
                     metadata: Optional[Dict[str, str]] = None,
                     holds: Optional[Dict[str, list]] = None) -> int:
    """Write ``tensors`` (CPU, any layout) to ``path`` (the caller makes it atomic), with the
    checksums of their blocks. ``holds``: key -> [global name, box offset, box shape, start,
    stop], the index piece each key is (keys without one, e.g. RNG state, are checksummed
    only). Returns the bytes written."""
    header: Dict = {}
    record: Dict = {}
    offset = 0
    for key, tensor in tensors:
        if tensor.dtype not in DTYPES:
            raise ValueError(f"{key}: dtype {tensor.dtype} cannot be stored")
        nbytes = tensor.numel() * tensor.element_size()
        header[key] = {"dtype": DTYPES[tensor.dtype], "shape": list(tensor.shape),
                       "data_offsets": [offset, offset + nbytes]}
        record[key] = {"holds": (holds or {}).get(key),
                       "blocks": "0" * checksums.HEX_WIDTH * checksums.block_count(nbytes)}
        offset += nbytes

    def encoded_header() -> bytes:
        meta = dict(metadata or {})
        meta["checksums"] = json.dumps({"algorithm": checksums.ALGORITHM,
                                        "block_bytes": checksums.BLOCK_BYTES,
                                        "tensors": record}, separators=(",", ":"))
        text = json.dumps({**header, "__metadata__": meta}, separators=(",", ":")).encode()
        return text + b" " * (-len(text) % 8)

    placeholder = encoded_header()
    # The CRCs run on a second thread while the same chunk is written (both release the GIL).
    with open(path, "wb") as f, ThreadPoolExecutor(max_workers=1) as pool:
        f.write(struct.pack("<Q", len(placeholder)))
        f.write(placeholder)
        for key, tensor in tensors:
            flat = tensor.detach().reshape(-1)
            step = max(1, _CHUNK_BYTES // max(1, flat.element_size()))
            sums: List[int] = []
            for lo in range(0, flat.numel(), step):
                data = _tensor_bytes(flat[lo:lo + step].contiguous().cpu())
                pending = pool.submit(checksums.block_sums, data)
                f.write(data)
                sums += pending.result()
            record[key]["blocks"] = checksums.to_hex(sums)
        final = encoded_header()
        assert len(final) == len(placeholder)  # fixed-width hex: same length, same offsets
        f.seek(8)
        f.write(final)
        f.flush()
        os.fsync(f.fileno())
    return 8 + len(final) + offset


class ShardFile:
    """Reads ranges of the 1-D tensors of one shard file. Validates the header against the
    file's size (a truncated or crafted file is a CheckpointError naming it) and every block
    it reads against its checksum. ``require_checksums``: the index says the checkpoint has
    them, so a file without them is damaged (not an old checkpoint)."""

    def __init__(self, path: str, require_checksums: bool = False):
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
        self.sums = self._checksums(require_checksums)  # None: an old file, none stored
        self._verified = set()  # (key, block) already checked: later reads skip the CRC

    def _damaged(self, what: str) -> CheckpointError:
        return CheckpointError(f"{self.path}: {what}; {checksums.DAMAGED}")

    def _checksums(self, required: bool) -> Optional[Dict[str, Tuple[Optional[list], list]]]:
        """key -> (the piece it holds, its blocks' CRCs), checked against the entries."""
        text = self.metadata.get("checksums") if isinstance(self.metadata, dict) else None
        if text is None:
            if required:
                raise self._damaged("it carries no checksums although its index says the "
                                    "checkpoint has them")
            return None
        try:
            record = json.loads(text)
            if record["algorithm"] != checksums.ALGORITHM or \
                    record["block_bytes"] != checksums.BLOCK_BYTES:
                raise ValueError(f"checksums {record['algorithm']} over "
                                 f"{record['block_bytes']}-byte blocks")
            out = {}
            for key, (dtype, shape, _) in self.entries.items():
                entry = record["tensors"][key]
                blocks = checksums.from_hex(entry["blocks"])
                nbytes = math.prod(shape) * torch.empty(0, dtype=dtype).element_size()
                if len(blocks) != checksums.block_count(nbytes):
                    raise ValueError(f"{key!r} has {len(blocks)} checksums")
                holds = entry["holds"]
                if not (holds is None or isinstance(holds, list) and len(holds) == 5):
                    raise ValueError(f"{key!r} holds {holds!r}")
                out[key] = (holds, blocks)
            return out
        except (KeyError, TypeError, ValueError) as exc:
            raise self._damaged(f"its checksums are malformed ({exc})") from None

    def check_holds(self, key: str, name: str, piece: list) -> None:
        """Refuse an index piece of ``name`` (``[box offset, box shape, start, stop]``) that
        points at a key holding other bytes (another tensor, or another range of it)."""
        if self.sums is None:
            return
        if key not in self.sums:
            self.read(key)  # the error naming it
        held = self.sums[key][0]
        if held != [name, *piece]:
            what = "no tensor of the index" if held is None else \
                f"{held[0]} (box offset {held[1]}, shape {held[2]}, elements " \
                f"[{held[3]}, {held[4]}))"
            raise self._damaged(f"the index says {key!r} holds {name} (box offset "
                                f"{piece[0]}, shape {piece[1]}, elements [{piece[2]}, "
                                f"{piece[3]})) but it holds {what}")

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
        if stop == start:
            return
        view = memoryview(out.view(torch.uint8).numpy())
        with open(self.path, "rb") as f:
            if self.sums is None:  # an old file: nothing to verify
                f.seek(self.data_start + begin + start * itemsize)
                self._read_exactly(f, view)
                return
            self._read_verified(f, key, itemsize, start * itemsize, stop * itemsize, view)

    def _read_verified(self, f, key: str, itemsize: int, lo: int, hi: int,
                       view: memoryview) -> None:
        """Bytes [lo, hi) of ``key`` into ``view``, reading every block they overlap whole
        (straight into ``view`` where a block lies inside it) and checking its CRC."""
        _, shape, begin = self.entries[key]
        nbytes, size = math.prod(shape) * itemsize, checksums.BLOCK_BYTES
        first = lo // size
        f.seek(self.data_start + begin + first * size)
        for block in range(first, (hi - 1) // size + 1):
            b_lo, b_hi = block * size, min(nbytes, (block + 1) * size)
            inside = lo <= b_lo and b_hi <= hi
            data = view[b_lo - lo:b_hi - lo] if inside else memoryview(bytearray(b_hi - b_lo))
            self._read_exactly(f, data)
            if (key, block) not in self._verified:
                if checksums.block_sums(data) != [self.sums[key][1][block]]:
                    held = self.sums[key][0]
                    raise self._damaged(
                        f"the bytes of {held[0] if held else repr(key)} (its elements from "
                        f"{b_lo // itemsize}, block {block} of {key!r}) do not match their "
                        f"checksum")
                self._verified.add((key, block))
            if not inside:
                a, b = max(lo, b_lo), min(hi, b_hi)
                view[a - lo:b - lo] = data[a - b_lo:b - b_lo]

    def _read_exactly(self, f, view: memoryview) -> None:
        if f.readinto(view) != len(view):
            raise CheckpointError(f"{self.path} is truncated; load another iteration "
                                  f"with --ckpt-step.")
