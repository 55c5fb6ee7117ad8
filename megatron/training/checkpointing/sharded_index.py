"""The sharded format's index (``metadata.json``) and its global tensor names.

    iter_0000100/metadata.json                 written by rank 0: the run's state and the index
    iter_0000100/shard_00003.safetensors       what global rank 3 owns (1-D pieces)

Global names are layout-free: ``model/<name>`` and ``optim/<key>/<name>`` where ``<name>``
has global layer numbers (``decoder.layers.17....``); a tied output layer is the embedding.
Each entry of ``tensors`` gives the global shape and dtype and the pieces that hold it:
``[file, key, box offset, box shape, start, stop]`` (see boxes.py). JSON only: reading an
index cannot run code, and every field is checked before it is used. ``checksums`` (the
algorithm's name) says every shard file carries its blocks' checksums and the piece each key
holds (shard_file.py); an index without it is from before checksums and is read unverified.
"""
import json
import os
import re
from typing import Dict, List, Optional, Tuple

import torch

from megatron.core.models.tp_sharding import MTP_EMBEDDING_COPY
from megatron.training.checkpointing import checksums
from megatron.training.checkpointing.boxes import Box, Piece
from megatron.training.checkpointing.paths import CheckpointError

FORMAT = "megatron-sharded"
VERSION = 1
METADATA_FILE = "metadata.json"
CHECKSUMS = "checksums"  # the index field: present (= checksums.ALGORITHM) since issue 38
_SHARD_FILE = re.compile(r"^shard_(\d{5,})\.safetensors$")
_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.*)$")
# The dtypes an index may name, and the torch dtype of each.
INDEX_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16,
                "float16": torch.float16, "float64": torch.float64}
DTYPE_NAMES = {dtype: name for name, dtype in INDEX_DTYPES.items()}


def shard_file_name(rank: int) -> str:
    return f"shard_{rank:05d}.safetensors"


def is_sharded_checkpoint(iteration_dir: str) -> bool:
    return os.path.isfile(os.path.join(iteration_dir, METADATA_FILE))


def global_name(local_name: str, layer_offset: int, tied_output: bool) -> str:
    """A chunk's parameter name -> its layout-free name (global layer number; a tied output
    layer, or multi-token prediction's copy of the embedding, is the embedding it copies)."""
    if (tied_output and local_name == "output_layer.weight") or \
            local_name == MTP_EMBEDDING_COPY:
        return "embedding.word_embeddings.weight"
    match = _LAYER.match(local_name)
    if match:
        return f"decoder.layers.{int(match.group(1)) + layer_offset}.{match.group(2)}"
    return local_name


def is_embedding_copy(local_name: str, tied_output: bool, pre_process: bool) -> bool:
    """A later stage's copy of the embedding (not saved: the first stage saves the
    embedding)."""
    return not pre_process and global_name(local_name, 0, tied_output) == \
        "embedding.word_embeddings.weight"


def read_metadata(iteration_dir: str) -> Dict:
    """The checked index of a sharded checkpoint directory."""
    path = os.path.join(iteration_dir, METADATA_FILE)
    try:
        with open(path) as f:
            meta = json.load(f)
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{path} cannot be read ({exc}); the checkpoint is damaged: "
                              f"load another iteration with --ckpt-step.") from None
    _check(isinstance(meta, dict) and meta.get("format") == FORMAT, path,
           f"not a {FORMAT} index")
    _check(meta.get("version") == VERSION, path,
           f"index version {meta.get('version')!r}, this code reads {VERSION}")
    _check(meta.get(CHECKSUMS) in (None, checksums.ALGORITHM), path,
           f"checksums {meta.get(CHECKSUMS)!r}, this code reads {checksums.ALGORITHM!r}")
    tensors = meta.get("tensors")
    _check(isinstance(tensors, dict), path, "no tensor index")
    for name, entry in tensors.items():
        _check_entry(path, name, entry)
    return meta


def _check(ok: bool, path: str, what: str) -> None:
    if not ok:
        raise CheckpointError(f"{path}: {what}; the checkpoint is damaged or was not written "
                              f"by this project: load another iteration with --ckpt-step.")


def _ints(value, length: Optional[int] = None) -> bool:
    return isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool)
                                           and v >= 0 for v in value) and \
        (length is None or len(value) == length)


def _check_entry(path: str, name: str, entry) -> None:
    _check(isinstance(name, str) and isinstance(entry, dict), path, "a malformed entry")
    shape = entry.get("shape")
    _check(_ints(shape), path, f"{name}: a malformed shape")
    _check(entry.get("dtype") in INDEX_DTYPES, path, f"{name}: dtype {entry.get('dtype')!r}")
    pieces = entry.get("pieces")
    _check(isinstance(pieces, list), path, f"{name}: no pieces")
    for piece in pieces:
        _check(isinstance(piece, list) and len(piece) == 6, path, f"{name}: a malformed piece")
        file, key, offset, box, start, stop = piece
        _check(isinstance(file, str) and _SHARD_FILE.match(file) is not None, path,
               f"{name}: piece file {file!r} is not a shard file name")
        _check(isinstance(key, str), path, f"{name}: a malformed piece key")
        _check(_ints(offset, len(shape)) and _ints(box, len(shape)), path,
               f"{name}: a piece's box does not match its shape")
        _check(all(o + b <= s for o, b, s in zip(offset, box, shape)), path,
               f"{name}: a piece lies outside the tensor")
        numel = 1
        for b in box:
            numel *= b
        _check(_ints([start, stop]) and start <= stop <= numel, path,
               f"{name}: a piece's range lies outside its box")


def pieces_of(entry: Dict) -> List[Tuple[str, str, Piece]]:
    """(file, key, piece) of a checked index entry."""
    return [(file, key, Piece(Box(tuple(offset), tuple(box)), start, stop))
            for file, key, offset, box, start, stop in entry["pieces"]]
