"""Loading the sharded format into any layout: each rank reads, from the pieces the index
names, only the ranges its own tensors need (its TP/PP part of the weights; its DP range of
the distributed optimizer's state, read when the optimizer installs it), so TP, PP, VPP and
DP may all differ from the saved run's, with no offline step and no whole-model tensor.
"""
import json
import os
from typing import Dict, List, Optional

import torch
import torch.distributed as dist

from megatron.core import parallel_state
from megatron.core.distributed.fsdp_checkpoint import is_sharded, local_rows
from megatron.core.fp8.delayed import CHECKPOINT_KEY
from megatron.core.optimizer.named_state import SavedTensor
from megatron.core.pipeline_parallel.model_chunks import unwrap_model
from megatron.training.checkpointing.boxes import Placement, copy_overlap
from megatron.training.checkpointing.checksums import warn_unverified
from megatron.training.checkpointing.experts import expert_shard, tensor_parts
from megatron.training.checkpointing.paths import CheckpointError
from megatron.training.checkpointing.shard_file import ShardFile
from megatron.training.checkpointing.sharded_index import (
    CHECKSUMS,
    INDEX_DTYPES,
    pieces_of,
    shard_file_name,
)


class ShardedReader:
    """Reads ranges of a rank's local tensors from a sharded checkpoint directory, each
    saved piece checked to hold what the index says and its bytes against their checksums
    (shard_file.py). A checkpoint from before checksums is read unverified, with one
    warning (from rank 0) per reader, i.e. per load."""

    def __init__(self, iteration_dir: str, metadata: Dict):
        self.dir, self.meta = iteration_dir, metadata
        self.tensors = metadata["tensors"]
        self._files: Dict[str, ShardFile] = {}
        self.verified = metadata.get(CHECKSUMS) is not None
        if not self.verified:
            warn_unverified(iteration_dir)

    def file(self, name: str) -> ShardFile:
        if name not in self._files:
            self._files[name] = ShardFile(os.path.join(self.dir, name),
                                          require_checksums=self.verified)
        return self._files[name]

    def _piece(self, name: str, file: str, key: str, piece) -> ShardFile:
        """The shard file of a saved piece of ``name``, once it says it holds that piece."""
        shard = self.file(file)
        shard.check_holds(key, name, [list(piece.box.offset), list(piece.box.shape),
                                      piece.start, piece.stop])
        return shard

    def has(self, name: str) -> bool:
        return name in self.tensors

    def check_covered(self, name: str, placement: Placement) -> None:
        """What ``read`` checks, without reading data (zeros stand in for the values)."""
        self.read(name, placement, dtype=torch.uint8, dry_run=True)

    def read(self, name: str, placement: Placement, start: int = 0,
             stop: Optional[int] = None, dtype: Optional[torch.dtype] = None,
             dry_run: bool = False) -> torch.Tensor:
        """Local flat elements ``[start, stop)`` of the global tensor ``name`` placed as
        ``placement`` (vocabulary padding rows read as zeros)."""
        entry = self.tensors.get(name)
        if entry is None:
            raise CheckpointError(f"{self.dir} has no {name}: the checkpoint is for another "
                                  f"architecture (or was saved without it).")
        if tuple(entry["shape"]) != placement.global_shape:
            raise CheckpointError(
                f"the checkpoint is for another architecture: {name} has shape "
                f"{tuple(entry['shape'])} there and {placement.global_shape} here.")
        stop = placement.local_numel if stop is None else stop
        out = torch.empty(stop - start, dtype=dtype or INDEX_DTYPES[entry["dtype"]])
        saved = pieces_of(entry)
        done = start  # elements before it are written; gaps (vocabulary padding) are zeros
        for wanted, lo, hi in placement.pieces(start, stop):
            out[done - start:lo - start].zero_()
            done = hi
            target = out[lo - start:hi - start]
            holder = _holder(saved, wanted)
            if holder is not None:  # the common case (same TP): one saved piece holds it all
                file, key, piece = holder
                shard = self._piece(name, file, key, piece)
                if not dry_run:
                    shard.read_into(key, wanted.start - piece.start, target)
                continue
            covered = torch.zeros(hi - lo, dtype=torch.bool)
            for file, key, piece in saved:
                def read(a, b, file=file, key=key, piece=piece):
                    shard = self._piece(name, file, key, piece)  # only the pieces it overlaps
                    return torch.zeros(b - a, dtype=out.dtype) if dry_run else \
                        shard.read(key, a, b)
                copy_overlap(target, covered, wanted, piece, read, placement.global_shape)
            if not bool(covered.all()):
                raise CheckpointError(
                    f"{self.dir}: the pieces of {name} cover {int(covered.sum())} of the "
                    f"{hi - lo} elements this rank needs; the checkpoint is incomplete or "
                    f"damaged.")
        out[done - start:].zero_()
        return out


def _holder(saved, wanted):
    """The saved (file, key, piece) that holds all of ``wanted`` (same box, its range inside
    the piece's), or None."""
    for file, key, piece in saved:
        if piece.box == wanted.box and piece.start <= wanted.start and \
                wanted.stop <= piece.stop:
            return file, key, piece
    return None


def _placements(model_chunks, layout) -> List[Dict[str, list]]:
    """Per chunk: {local name: [(global name, placement, first local flat element)]} for
    this rank (one entry per local expert for a stacked expert weight)."""
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    cut = expert_shard()
    out = []
    for chunk, (start, _) in zip(model_chunks, layout["layer_ranges"]):
        names = {}
        for local, tensor in unwrap_model(chunk).state_dict().items():
            names[local] = [(name, placement, first) for name, placement, first, _ in
                            tensor_parts(local, tensor.shape, start, layout, tp_rank, cut)]
        out.append(names)
    return out


class ModelReads:
    """The model weights of a sharded checkpoint for this rank: checked first (names, shapes,
    every element covered by the index: no data read), then read and copied one tensor at a
    time, so a load holds at most one tensor's copy beyond the model itself."""

    def __init__(self, reader: ShardedReader, model_chunks, layout):
        self.reader = reader
        self.names = _placements(model_chunks, layout)

    def check(self) -> None:
        """Raise CheckpointError (before any weight is changed) if a tensor is missing, has
        another shape, or is not wholly covered by the saved pieces."""
        for names in self.names:
            for parts in names.values():
                for name, placement, _ in parts:
                    self.reader.check_covered(f"model/{name}", placement)

    def apply(self, model_chunks) -> None:
        with torch.no_grad():
            for chunk, names in zip(model_chunks, self.names):
                state = unwrap_model(chunk).state_dict(keep_vars=True)
                for local, parts in names.items():
                    target = state[local]
                    if is_sharded(target):  # FSDP2: only the rows this rank holds
                        begin, rows = local_rows(target)
                        flat = rows.view(-1)
                        for name, placement, first in parts:  # one per expert if stacked
                            lo = max(begin, first)
                            hi = min(begin + flat.numel(), first + placement.local_numel)
                            if lo < hi:
                                flat[lo - begin:hi - begin].copy_(self.reader.read(
                                    f"model/{name}", placement, lo - first, hi - first,
                                    dtype=rows.dtype))
                        continue
                    flat = target.view(-1)
                    for name, placement, first in parts:
                        n = placement.local_numel
                        flat[first:first + n].copy_(self.reader.read(
                            f"model/{name}", placement, dtype=target.dtype))


def _read_parts(reader: ShardedReader, key: str, parts, start: int, stop: int
                ) -> torch.Tensor:
    """Local flat elements [start, stop) of a tensor made of ``parts`` (fp32)."""
    pieces = []
    for name, placement, first in parts:
        lo, hi = max(start, first), min(stop, first + placement.local_numel)
        if lo < hi:
            pieces.append(reader.read(f"optim/{key}/{name}", placement, lo - first,
                                      hi - first, torch.float32))
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces)


def read_optimizer(reader: ShardedReader, model_chunks, layout) -> Optional[Dict]:
    """The named optimizer state with every per-parameter tensor a SavedTensor: the
    optimizer reads the ranges it owns when it installs them."""
    meta = reader.meta.get("optimizer")
    if meta is None:
        return None
    keys = ["param"] + list(meta["state_keys"])
    params = {}
    for c, names in enumerate(_placements(model_chunks, layout)):
        for local, parts in names.items():
            entry = {}
            numel = sum(placement.local_numel for _, placement, _ in parts)
            for key in keys:
                if all(reader.has(f"optim/{key}/{name}") for name, _, _ in parts):
                    entry[key] = SavedTensor(
                        numel, lambda a, b, k=key, p=parts: _read_parts(reader, k, p, a, b))
            params[f"{c}/{local}"] = entry
    return {**meta, "params": params}


def read_rng_state(reader: ShardedReader, rank: int) -> Optional[Dict]:
    """The RNG state global rank ``rank`` saved (None where it saved none)."""
    shard = reader.file(shard_file_name(rank))
    text = shard.metadata.get("rng_state")
    if text is None:
        return None

    def build(value):
        if isinstance(value, dict) and "__tensor__" in value:
            dtype = getattr(torch, value["dtype"].replace("torch.", ""))
            return shard.read(value["__tensor__"]).to(dtype).view(value["shape"])
        if isinstance(value, dict):
            return {k: build(v) for k, v in value.items()}
        if isinstance(value, list):
            return [build(v) for v in value]
        return value

    try:
        return build(json.loads(text))
    except (ValueError, TypeError, AttributeError) as exc:
        raise CheckpointError(f"{shard.path}: its RNG state is damaged ({exc}); resume with "
                              f"--no-load-rng or load another iteration.") from None


def saved_histories(reader: ShardedReader, saved_layout: Dict, same_ranks: bool):
    """FP8 delayed scaling's saved histories (fp8/delayed.py) for this rank: its own file's
    at the same layout; at another, every saved pipeline stage's merged by name (they are
    the same on every TP, CP and DP rank of a stage: one file a stage, its first rank's, is
    read), so each linear finds its own whatever the new cut. None where none were saved."""
    def of(rank: int):
        text = reader.file(shard_file_name(rank)).metadata.get(CHECKPOINT_KEY)
        return json.loads(text) if text is not None else None
    if same_ranks:
        return of(dist.get_rank())
    stride = 1
    for key in ("tensor_model_parallel_size", "context_parallel_size", "data_parallel_size"):
        stride *= saved_layout.get(key) or 1
    merged = {}
    for stage in range(saved_layout.get("pipeline_model_parallel_size") or 1):
        saved = of(stage * stride)
        if not isinstance(saved, dict):  # an older checkpoint's list: its own layout only
            return None
        merged.update(saved)
    return merged
