"""Saving in the sharded format (``--ckpt-format torch_dist``): every rank writes only what
it owns, in parallel, with nothing gathered to one rank.

- Weights: each (TP, PP) position's tensors once per DP group, spread over its DP ranks
  (each parameter to the DP rank with the fewest bytes so far, the same choice everywhere).
- Optimizer state: with the distributed optimizer each DP rank its own shard (1/DP of it);
  with the plain one, replicated, spread over the DP ranks like the weights.
- RNG state: each rank its own, in its file's header.
- Rank 0: ``metadata.json``, the run's state and the index of every rank's pieces (gathered
  as plain data: names and numbers, no tensors).
Atomic as the torch format: all under ``iter_N.partial``, published once every rank wrote.
"""
import json
import os
import shutil
from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from megatron.core import device, parallel_state
from megatron.core.distributed.distributed_data_parallel import params_current_everywhere
from megatron.core.distributed.fsdp import is_fsdp2
from megatron.core.distributed.fsdp_checkpoint import first_replica, is_sharded, local_rows
from megatron.core.fp8.delayed import CHECKPOINT_KEY, capture_histories
from megatron.core.pipeline_parallel.model_chunks import unwrap_model
from megatron.training.checkpointing import checksums
from megatron.training.checkpointing.disk_space import SaveSpace, space_for_save
from megatron.training.checkpointing.experts import (
    expert_data_parallel,
    expert_shard,
    tensor_parts,
)
from megatron.training.checkpointing.layout import current_layout
from megatron.training.checkpointing.paths import (
    previous_checkpoint_note,
    STAGING_SUFFIX,
    iteration_dir_name,
    publish,
    remove_stale_staging,
)
from megatron.training.checkpointing.rng_state import capture_rng_state
from megatron.training.checkpointing.safe_io import as_disk_full, plain_data
from megatron.training.checkpointing.shard_file import write_shard_file
from megatron.training.checkpointing.sharded_index import (
    CHECKSUMS,
    DTYPE_NAMES,
    FORMAT,
    METADATA_FILE,
    VERSION,
    is_embedding_copy,
    shard_file_name,
)
from megatron.training.guards.fault_injection import maybe_crash_while_writing


class _Shard:
    """What this rank writes: 1-D tensors and their index entries."""

    def __init__(self, rank: int):
        self.file = shard_file_name(rank)
        self.tensors: List[Tuple[str, torch.Tensor]] = []
        self.index: List[Tuple[str, List[int], str, list]] = []  # name, shape, dtype, piece
        self.holds: Dict[str, list] = {}  # key -> [name, *piece] (kept with its checksums)

    def add(self, name: str, values: torch.Tensor, placement, begin: int = 0) -> None:
        """``values``: local flat elements ``[begin, begin + numel)`` of a tensor placed as
        ``placement`` in the global tensor ``name``. A tensor replicated over TP ranks is
        written by TP rank 0 only (the others hold the same values)."""
        if placement.dim is None and parallel_state.get_tensor_model_parallel_rank() != 0:
            return
        flat = values.reshape(-1)
        for piece, lo, hi in placement.pieces(begin, begin + flat.numel()):
            key = f"{name}@{len(self.tensors)}"
            self.tensors.append((key, flat[lo - begin:hi - begin]))
            where = [list(piece.box.offset), list(piece.box.shape), piece.start, piece.stop]
            self.index.append((name, list(placement.global_shape),
                               DTYPE_NAMES[values.dtype], [self.file, key, *where]))
            self.holds[key] = [name, *where]


def _balanced(sizes: Dict[str, int], ways: int) -> Dict[str, int]:
    """Each name to one of ``ways`` writers, largest first to the least loaded: every rank
    computes the same assignment from the same sizes."""
    load = [0] * ways
    owner = {}
    for name in sorted(sizes, key=lambda n: (-sizes[n], n)):
        writer = min(range(ways), key=lambda w: (load[w], w))
        owner[name] = writer
        load[writer] += sizes[name]
    return owner


def _chunk_naming(model_chunks, layout) -> List[Tuple[object, int]]:
    return [(unwrap_model(chunk), start) for chunk, (start, _) in
            zip(model_chunks, layout["layer_ranges"])]


def _owners(named, dp_rank: int, dp_size: int) -> List[bool]:
    """Whether this rank writes each (name, nbytes, is expert) of a replicated set: dense
    tensors spread over the DP ranks, experts over the expert-DP ranks (those holding them)."""
    edp_rank, edp_size = expert_data_parallel()
    dense = _balanced({n: b for n, b, e in named if not e}, dp_size)
    experts = _balanced({n: b for n, b, e in named if e}, edp_size)
    return [(experts[n] == edp_rank) if e else (dense[n] == dp_rank) for n, _, e in named]


def _add_weights(shard: _Shard, model_chunks, layout, dp_rank: int, dp_size: int) -> None:
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    cut = expert_shard()
    entries = []  # (name, placement, values, local start, is expert, FSDP2-sharded)
    for module, offset in _chunk_naming(model_chunks, layout):
        for local, tensor in module.state_dict().items():
            if not torch.is_tensor(tensor):
                raise TypeError(f"{local}: only tensors can be saved in the sharded format")
            if is_embedding_copy(local, layout["tied_output"], module.pre_process):
                continue  # the first stage saves the embedding it copies
            if is_sharded(tensor):  # FSDP2: each DP (expert-DP) rank writes the rows it holds
                if not first_replica(tensor):
                    continue  # HSDP: instance 0 writes the rows every instance holds
                begin, rows = local_rows(tensor)
                flat = rows.detach().reshape(-1)
                # Stacked experts are one part per global expert: this shard's share of each.
                for name, placement, first, _ in tensor_parts(local, tensor.shape, offset,
                                                              layout, tp_rank, cut):
                    lo = max(begin, first)
                    hi = min(begin + flat.numel(), first + placement.local_numel)
                    if lo < hi:
                        entries.append((f"model/{name}", placement,
                                        flat[lo - begin:hi - begin], lo - first, False, True))
                continue
            flat = tensor.detach().reshape(-1)
            for name, placement, first, expert in tensor_parts(local, tensor.shape, offset,
                                                               layout, tp_rank, cut):
                values = flat[first:first + placement.local_numel]
                entries.append((f"model/{name}", placement, values, 0, expert, False))
    replicated = [e for e in entries if not e[5]]
    owners = _owners([(e[0], e[2].numel() * e[2].element_size(), e[4]) for e in replicated],
                     dp_rank, dp_size)
    for (name, placement, values, _, _, _), mine in zip(replicated, owners):
        if mine:
            shard.add(name, values, placement)
    for name, placement, values, begin, _, _ in (e for e in entries if e[5]):
        shard.add(name, values, placement, begin)


def _add_optimizer(shard: _Shard, optimizer, model_chunks, layout, replicated: bool,
                   dp_rank: int, dp_size: int) -> Dict:
    """This rank's optimizer pieces; returns the non-tensor rest of the optimizer state."""
    parts, meta = optimizer.sharded_state()
    modules = _chunk_naming(model_chunks, layout)
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    cut = expert_shard()
    shapes = {f"{c}/{n}": p.shape for c, (m, _) in enumerate(modules)
              for n, p in m.named_parameters()}
    named = []  # (name, placement, begin within it, values, is expert)
    for name, begin, end, values in parts:
        chunk, local = name.split("/", 1)
        module, offset = modules[int(chunk)]
        if is_embedding_copy(local, layout["tied_output"], module.pre_process):
            continue
        for saved, placement, first, expert in tensor_parts(local, shapes[name], offset,
                                                            layout, tp_rank, cut):
            lo, hi = max(begin, first), min(end, first + placement.local_numel)
            if lo >= hi:
                continue
            for key, value in values.items():
                named.append((f"optim/{key}/{saved}", placement, lo - first,
                              value[lo - begin:hi - begin], expert))
    owners = _owners([(n, v.numel() * v.element_size(), e) for n, _, _, v, e in named],
                     dp_rank, dp_size) if replicated else [True] * len(named)
    for (name, placement, begin, value, _), mine in zip(named, owners):
        if mine:
            shard.add(name, value, placement, begin)
    return meta


def _rng_header(shard: _Shard) -> Dict[str, str]:
    """This rank's RNG state: tensors into the shard, the rest as JSON in the header."""
    def walk(value, path):
        if torch.is_tensor(value):
            key = f"rng/{path}"
            shard.tensors.append((key, value.detach().cpu().reshape(-1).contiguous()))
            return {"__tensor__": key, "dtype": str(value.dtype), "shape": list(value.shape)}
        if isinstance(value, dict):
            return {k: walk(v, f"{path}.{k}") for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [walk(v, f"{path}.{i}") for i, v in enumerate(value)]
        return value

    return {"rng_state": json.dumps(walk(capture_rng_state(), "state"))}


def _index(pieces_per_rank: List[list]) -> Dict:
    tensors: Dict[str, Dict] = {}
    for pieces in pieces_per_rank:
        for name, shape, dtype, piece in pieces:
            entry = tensors.setdefault(name, {"shape": shape, "dtype": dtype, "pieces": []})
            entry["pieces"].append(piece)
    return tensors


def save_sharded(root: str, iteration: int, model_chunks, optimizer, scheduler, configs,
                 args: Dict, consumed_train_samples: int, consumed_valid_samples: int,
                 writer) -> None:
    """Collective: every rank calls it (as save_checkpoint)."""

    t = configs.training
    writer.wait()
    params_current_everywhere(model_chunks)  # as save_checkpoint
    layout = current_layout(model_chunks, configs)
    dp_rank = parallel_state.get_data_parallel_rank(with_context_parallel=True)
    dp_size = parallel_state.get_data_parallel_world_size(with_context_parallel=True)
    shard = _Shard(dist.get_rank())
    _add_weights(shard, model_chunks, layout, dp_rank, dp_size)
    optimizer_meta = None
    if not t.no_save_optim:
        replicated = not (configs.optimizer.sharded or is_fsdp2(model_chunks))
        optimizer_meta = _add_optimizer(shard, optimizer, model_chunks, layout, replicated,
                                        dp_rank, dp_size)
    header = {} if t.no_save_rng else _rng_header(shard)
    histories = capture_histories(model_chunks)  # --fp8-recipe delayed (fp8/delayed.py)
    if histories is not None:
        header[CHECKPOINT_KEY] = json.dumps(histories)
    if writer.async_save:  # host copies now; the thread writes them while training goes on
        writer.host.start()
        # Only the bytes written (a file holds each tensor's own bytes): a DP rank's share of
        # the distributed optimizer's parameter buffer, not the whole buffer.
        copies = writer.host.snapshot({key: value for key, value in shard.tensors}, "sharded",
                                      whole_storages=False)
        shard.tensors = [(key, copies[key]) for key, _ in shard.tensors]

    gathered = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(shard.index, gathered, dst=0)
    staging = os.path.join(root, iteration_dir_name(iteration) + STAGING_SUFFIX)
    metadata = None
    if dist.get_rank() == 0:
        metadata = {"format": FORMAT, "version": VERSION, CHECKSUMS: checksums.ALGORITHM,
                    "iteration": iteration,
                    "args": plain_data(args), "layout": layout,
                    "consumed_train_samples": consumed_train_samples,
                    "consumed_valid_samples": consumed_valid_samples,
                    "opt_param_scheduler": plain_data(scheduler.state_dict())
                    if optimizer_meta is not None else None,
                    "optimizer": plain_data(optimizer_meta), "tensors": _index(gathered)}
        os.makedirs(root, exist_ok=True)
        remove_stale_staging(root)
        os.makedirs(staging)
    dist.barrier()
    space = space_for_save(root, sum(t.numel() * t.element_size() for _, t in shard.tensors))

    def write():
        def write_shard(path):
            write_shard_file(path, shard.tensors, header, shard.holds)
            maybe_crash_while_writing(path, iteration)  # tests only: see guards/fault_injection.py

        write_atomic(os.path.join(staging, shard.file), staging, space, write_shard)
        if metadata is not None:
            write_atomic(os.path.join(staging, METADATA_FILE), staging, space,
                          lambda path: write_json(path, metadata))

    def finalize():
        if dist.get_rank() == 0:
            publish(root, staging, iteration_dir_name(iteration), iteration)

    def abort():
        if dist.get_rank() == 0:
            shutil.rmtree(staging, ignore_errors=True)

    writer.submit(write, finalize, ready=device.record_event(), abort=abort,
                  previous=lambda: previous_checkpoint_note(root))


def write_json(path: str, value) -> None:
    """``value`` as JSON, fsynced (the index)."""
    with open(path, "w") as f:
        json.dump(value, f)
        f.flush()
        os.fsync(f.fileno())


def write_atomic(path: str, directory: str, space: Optional[SaveSpace], write) -> None:
    """``write(tmp)`` then rename to ``path``; on failure the temporary file is removed and
    a full disk is reported as such (``space``: what the save needs in ``directory``; None:
    the caller reports it)."""
    tmp = path + ".tmp"
    try:
        write(tmp)
        os.replace(tmp, path)
    except BaseException as exc:
        if os.path.exists(tmp):
            os.remove(tmp)
        if isinstance(exc, Exception) and space is not None:
            raise as_disk_full(exc, directory, space) from exc
        raise
