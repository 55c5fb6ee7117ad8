"""The sharded format (``--ckpt-format torch_dist``) without a job: whole global tensors read
from a checkpoint's pieces, and a checkpoint written from whole tensors (see offline.py for
the format-independent functions the tools call).

A checkpoint written here holds every global tensor whole, one piece each, in
``shard_00000.safetensors`` (plus, when RNG states are carried, one small file per saved rank
holding only its RNG state), and ``metadata.json``. Its pieces say nothing about a layout, so
it loads at any TP/PP/VPP/DP like one written by training.
"""
import json
import os
import re
from typing import Dict, List, Optional, Tuple

import torch

from megatron.training.checkpointing import checksums
from megatron.training.checkpointing.boxes import Placement
from megatron.training.checkpointing.paths import (
    RELEASE,
    STAGING_SUFFIX,
    iteration_dir_name,
    publish,
)
from megatron.training.checkpointing.safe_io import plain_data
from megatron.training.checkpointing.shard_file import write_shard_file
from megatron.training.checkpointing.sharded_index import (
    CHECKSUMS,
    DTYPE_NAMES,
    FORMAT,
    METADATA_FILE,
    VERSION,
    read_metadata,
    shard_file_name,
)
from megatron.training.checkpointing.sharded_load import ShardedReader, read_rng_state
from megatron.training.checkpointing.sharded_save import write_atomic, write_json

_SHARD = re.compile(r"^shard_(\d{5,})\.safetensors$")
MODEL_PREFIX, OPTIM_PREFIX = "model/", "optim/"

Coords = Tuple[int, int, int]  # (tp rank, pp rank, dp rank)


def shard_ranks(iteration_dir: str) -> List[int]:
    """The global ranks whose shard files the directory holds."""
    return sorted(int(m.group(1)) for m in map(_SHARD.match, os.listdir(iteration_dir)) if m)


def rank_coords(rank: int, layout: Dict) -> Coords:
    """Megatron's rank order: ``rank = tp + dp * TP + pp * TP * DP``."""
    tp, dp = layout["tensor_model_parallel_size"], layout["data_parallel_size"]
    return rank % tp, rank // (tp * dp), (rank // tp) % dp


def coords_rank(coords: Coords, layout: Dict) -> int:
    tp_rank, pp_rank, dp_rank = coords
    tp, dp = layout["tensor_model_parallel_size"], layout["data_parallel_size"]
    return tp_rank + dp_rank * tp + pp_rank * tp * dp


def whole_tensor(reader: ShardedReader, name: str) -> torch.Tensor:
    """The global tensor ``name`` (vocabulary unpadded), from whichever pieces hold it."""
    shape = tuple(reader.tensors[name]["shape"])
    return reader.read(name, Placement(shape, shape)).view(shape)


def open_checkpoint(iteration_dir: str) -> Tuple[Dict, ShardedReader]:
    meta = read_metadata(iteration_dir)
    return meta, ShardedReader(iteration_dir, meta)


def read_model(iteration_dir: str) -> Tuple[Dict[str, torch.Tensor], Dict, Dict]:
    """(whole model tensors by global name, the saved layout, the saved args)."""
    meta, reader = open_checkpoint(iteration_dir)
    full = {name[len(MODEL_PREFIX):]: whole_tensor(reader, name)
            for name in sorted(reader.tensors) if name.startswith(MODEL_PREFIX)}
    return full, dict(meta.get("layout") or {}), dict(meta.get("args") or {})


def read_optimizer_tensors(reader: ShardedReader) -> Dict[str, Dict[str, torch.Tensor]]:
    """{state key: {global name: whole tensor}} of the optimizer state."""
    out: Dict[str, Dict[str, torch.Tensor]] = {}
    for name in sorted(reader.tensors):
        if name.startswith(OPTIM_PREFIX):
            key, param = name[len(OPTIM_PREFIX):].split("/", 1)
            out.setdefault(key, {})[param] = whole_tensor(reader, name)
    return out


def read_rng_states(iteration_dir: str, reader: ShardedReader, layout: Dict
                    ) -> Dict[Coords, Dict]:
    """Each saved rank's RNG state by its (tp, pp, dp) place in ``layout``."""
    out = {}
    for rank in shard_ranks(iteration_dir):
        state = read_rng_state(reader, rank)
        if state is not None:
            out[rank_coords(rank, layout)] = state
    return out


def checkpoint_tensors(iteration_dir: str) -> Dict[str, torch.Tensor]:
    """Every global tensor whole (``model/...``, ``optim/...``) and each shard file's RNG
    tensors (``shard_00003.safetensors/rng/...``): two checkpoints of the same layout compare
    bit for bit, and any two whatever their layouts compare on their global tensors."""
    _, reader = open_checkpoint(iteration_dir)
    out = {name: whole_tensor(reader, name) for name in sorted(reader.tensors)}
    for rank in shard_ranks(iteration_dir):
        shard = reader.file(shard_file_name(rank))
        for key in shard.entries:
            if key.startswith("rng/"):
                out[f"{shard_file_name(rank)}/{key}"] = shard.read(key)
    return out


# --- writing ----------------------------------------------------------------------------------
class _ShardWriter:
    """One shard file's tensors (whole, flat) and the index entries they make."""

    def __init__(self, rank: int):
        self.file = shard_file_name(rank)
        self.tensors: List[Tuple[str, torch.Tensor]] = []
        self.header: Dict[str, str] = {}
        self.holds: Dict[str, list] = {}  # key -> [name, *piece] (kept with its checksums)

    def add_whole(self, name: str, tensor: torch.Tensor, index: Dict) -> None:
        shape = list(tensor.shape)
        flat = tensor.detach().reshape(-1).contiguous()
        self.tensors.append((name, flat))
        where = [[0] * len(shape), shape, 0, flat.numel()]
        index[name] = {"shape": shape, "dtype": DTYPE_NAMES[tensor.dtype],
                       "pieces": [[self.file, name, *where]]}
        self.holds[name] = [name, *where]

    def add_rng(self, state: Dict) -> None:
        """As training writes it: tensors into the file, the rest as JSON in the header."""
        def walk(value, path):
            if torch.is_tensor(value):
                key = f"rng/{path}"
                self.tensors.append((key, value.detach().cpu().reshape(-1).contiguous()))
                return {"__tensor__": key, "dtype": str(value.dtype),
                        "shape": list(value.shape)}
            if isinstance(value, dict):
                return {k: walk(v, f"{path}.{k}") for k, v in value.items()}
            if isinstance(value, (list, tuple)):
                return [walk(v, f"{path}.{i}") for i, v in enumerate(value)]
            return value

        self.header["rng_state"] = json.dumps(walk(state, "state"))


def write_checkpoint(root: str, model: Dict[str, torch.Tensor], layout: Dict, args: Dict,
                     iteration: Optional[int], optimizer: Optional[Dict] = None,
                     optimizer_meta: Optional[Dict] = None, scheduler: Optional[Dict] = None,
                     rng: Optional[Dict[Coords, Dict]] = None, consumed_train_samples: int = 0,
                     consumed_valid_samples: int = 0) -> str:
    """Write whole global tensors as a sharded checkpoint under ``root`` (``release`` when
    ``iteration`` is None), atomically (staging directory, then the tracker). ``optimizer``:
    {state key: {global name: tensor}}; ``rng``: {(tp, pp, dp): state} of ``layout``'s ranks.
    Returns the directory."""
    name = iteration_dir_name(iteration or 0, release=iteration is None)
    staging = os.path.join(root, name + STAGING_SUFFIX)
    os.makedirs(staging)
    index: Dict[str, Dict] = {}
    first = _ShardWriter(0)
    for global_name in sorted(model):
        first.add_whole(MODEL_PREFIX + global_name, model[global_name], index)
    for key in sorted(optimizer or {}):
        for global_name in sorted(optimizer[key]):
            first.add_whole(f"{OPTIM_PREFIX}{key}/{global_name}", optimizer[key][global_name],
                            index)
    writers = {0: first}
    for coords, state in sorted((rng or {}).items()):
        rank = coords_rank(coords, layout)
        writers.setdefault(rank, _ShardWriter(rank)).add_rng(state)
    for writer in writers.values():
        write_atomic(os.path.join(staging, writer.file), staging, None,
                     lambda path, w=writer: write_shard_file(path, w.tensors, w.header,
                                                             w.holds))
    metadata = {"format": FORMAT, "version": VERSION, CHECKSUMS: checksums.ALGORITHM,
                "iteration": iteration or 0,
                "args": plain_data(args), "layout": layout,
                "consumed_train_samples": consumed_train_samples,
                "consumed_valid_samples": consumed_valid_samples,
                "opt_param_scheduler": plain_data(scheduler) if optimizer else None,
                "optimizer": plain_data(optimizer_meta) if optimizer else None,
                "tensors": index}
    write_atomic(os.path.join(staging, METADATA_FILE), staging, None,
                 lambda path: write_json(path, metadata))
    publish(root, staging, name, RELEASE if iteration is None else iteration)
    return os.path.join(root, name)
