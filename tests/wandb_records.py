"""Reading an offline W&B run (``<dir>/wandb/offline-run-*/run-*.wandb``) back, for tests.

wandb >= 0.18 writes the file from its Go core and ships no Python reader, so this is one:
the file is a LevelDB-style log (a 7-byte header ``:W&B``, magic 0xBEE1, version 0; then
32 KiB blocks of chunks, each ``crc32 (4) | length (2) | kind (1) | data``, a record split
over blocks as FIRST, MIDDLE..., LAST) of ``wandb_internal_pb2.Record`` messages.
"""
import glob
import json
import os
import struct
import zlib
from typing import Dict, Iterator, List

FILE_HEADER = b":W&B" + struct.pack("<HB", 0xBEE1, 0)
BLOCK = 32 * 1024
CHUNK_HEADER = struct.Struct("<IHB")  # crc32 (seeded with the kind byte), length, kind
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def run_files(save_dir: str) -> List[str]:
    """The .wandb files of the offline runs under ``--wandb-save-dir save_dir``."""
    return sorted(glob.glob(os.path.join(save_dir, "wandb", "offline-run-*", "run-*.wandb")))


def _payloads(data: bytes) -> Iterator[bytes]:
    assert data[:len(FILE_HEADER)] == FILE_HEADER, data[:16]
    pos, parts = len(FILE_HEADER), []
    while pos + CHUNK_HEADER.size <= len(data):
        if BLOCK - pos % BLOCK < CHUNK_HEADER.size:  # a block's tail too short for a header
            pos += BLOCK - pos % BLOCK
            continue
        crc, length, kind = CHUNK_HEADER.unpack_from(data, pos)
        if kind == 0:  # zero padding: the writer stopped here
            break
        start = pos + CHUNK_HEADER.size
        chunk = data[start:start + length]
        assert zlib.crc32(chunk, zlib.crc32(bytes([kind]))) == crc, f"bad crc at {pos}"
        pos = start + length
        parts.append(chunk)
        if kind in (FULL, LAST):
            yield b"".join(parts)
            parts = []


def records(path: str):
    from wandb.proto import wandb_internal_pb2

    with open(path, "rb") as f:
        data = f.read()
    for payload in _payloads(data):
        yield wandb_internal_pb2.Record.FromString(payload)


def history_rows(path: str) -> List[Dict[str, float]]:
    """Every ``run.log`` row, W&B's own keys (``_step``, ``_runtime``...) left out."""
    rows = []
    for record in records(path):
        if record.WhichOneof("record_type") == "history":
            row = {"/".join(item.nested_key) or item.key: json.loads(item.value_json)
                   for item in record.history.item}
            rows.append({k: v for k, v in row.items() if not k.startswith("_")})
    return rows


def run_record(path: str):
    """The run's RunRecord (name, project, config)."""
    for record in records(path):
        if record.WhichOneof("record_type") == "run":
            return record.run
    raise AssertionError(f"{path}: no run record")


def run_config(path: str) -> Dict[str, object]:
    """The run's config (``wandb.init(config=...)``)."""
    return {item.key: json.loads(item.value_json)
            for item in run_record(path).config.update if not item.key.startswith("_")}


def scalars(rows: List[Dict[str, float]], tag: str, axis: str = "iteration"):
    """[(step, value)] of one tag, the step read from the row's ``axis`` value."""
    return [(row[axis], row[tag]) for row in rows if tag in row]
