"""Checksums of checkpoint bytes, computed while writing and verified when read.

Shard files (the sharded format): a CRC-32 of every ``BLOCK_BYTES`` block of each stored
tensor, so a partial read (resharding, a DP rank's range) verifies only the whole blocks it
overlaps. CRC-32 (``zlib.crc32``) because, measured on the 2-core dev VM over 1 MiB blocks
(GB/s): crc32 6.7, adler32 4.0, sha1 2.1, blake2b 1.4, md5 0.9; a numpy sum of uint64 words
times odd position weights ran at 14-17 but misses paired flips of a word's top bit, while
CRC-32 detects every burst up to 32 bits. It is also what the torch format already stores.

Torch files (``torch.save``'s zip): torch writes each record's CRC-32 into the zip while
saving, so nothing is added at save time; ``verify_torch_file`` checks them at load.
"""
import sys
import zipfile
import zlib
from typing import List

import torch.distributed as dist

from megatron.training.checkpointing.paths import CheckpointError

ALGORITHM = "crc32"
BLOCK_BYTES = 1 << 20  # small enough that a partial read verifies little beyond its range
HEX_WIDTH = 8  # one block's CRC as fixed-width hex: a header's length is known before writing

DAMAGED = "the checkpoint is damaged: load another iteration with --ckpt-step."


def block_count(nbytes: int) -> int:
    return -(-nbytes // BLOCK_BYTES)


def block_sums(data: memoryview) -> List[int]:
    """The CRC of each block of ``data`` (which starts on a block boundary)."""
    return [zlib.crc32(data[lo:lo + BLOCK_BYTES]) for lo in range(0, len(data), BLOCK_BYTES)]


def to_hex(sums: List[int]) -> str:
    return "".join(f"{s:0{HEX_WIDTH}x}" for s in sums)


def from_hex(text: str) -> List[int]:
    """Raises ValueError for anything but whole fixed-width hex CRCs."""
    if len(text) % HEX_WIDTH:
        raise ValueError("a truncated checksum")
    return [int(text[i:i + HEX_WIDTH], 16) for i in range(0, len(text), HEX_WIDTH)]


def verify_torch_file(path: str) -> None:
    """Check every record of a ``torch.save`` zip against the CRC-32 torch stored for it;
    raise CheckpointError naming the record whose bytes do not match. A file that is not a
    zip (truncated, or torch's legacy format) is left to torch.load, which refuses it."""
    if not zipfile.is_zipfile(path):
        return
    try:
        with zipfile.ZipFile(path) as archive:
            bad = archive.testzip()  # reads each record, compares its CRC-32
    except (OSError, zipfile.BadZipFile, EOFError, ValueError) as exc:
        raise CheckpointError(f"checkpoint file {path} is not readable ({exc}); "
                              f"{DAMAGED}") from None
    if bad is not None:
        raise CheckpointError(f"checkpoint file {path}: record {bad} does not match its "
                              f"checksum; {DAMAGED}")


def warn_unverified(checkpoint: str) -> None:
    """The one warning (rank 0) of a load of a checkpoint saved before checksums."""
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(f"warning: {checkpoint} carries no checksums (saved before they were added), so "
              f"its bytes are loaded unverified; save it again to add them.", file=sys.stderr,
              flush=True)
