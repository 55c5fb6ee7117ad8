"""Checkpoints without a running job, in either format (``torch``: mp_rank_* files;
``torch_dist``: the sharded format, see offline_sharded.py): read a saved model into full
tensors, and write full tensors as a checkpoint for any (TP, PP, VPP) layout; read and write
a whole checkpoint (optimizer state, LR schedule, RNG states) to convert between formats. The
conversion tools (HF <-> Megatron, offline resharding, format conversion) are built on these.

Full tensors use this project's names (``decoder.layers.{global i}...``), are unsharded, and
hold the true vocabulary (no padding); ``write_model`` pads it as training will.
"""
import os
import re
import shutil
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

import torch

from megatron.core.pipeline_parallel.layer_split import chunk_layer_range
from megatron.core.utils import vocab_size_with_padding
from megatron.training.checkpointing import offline_experts as experts
from megatron.training.checkpointing import offline_sharded as sharded
from megatron.training.checkpointing.layout import model_key
from megatron.training.checkpointing.load import check_rank_dirs_complete, saved_rank_dirs
from megatron.training.checkpointing.paths import (
    MODEL_FILE,
    OPTIMIZER_FILE,
    RELEASE,
    STAGING_SUFFIX,
    TRACKER_FILE,
    CheckpointError,
    iteration_dir_name,
    publish,
    rank_dir_name,
    read_tracker,
)
from megatron.training.checkpointing.reshard import (
    join_optimizer_params,
    shard_for_rank,
    split_optimizer_params,
)
from megatron.training.checkpointing.resharder import full_from_files
from megatron.training.checkpointing.safe_io import atomic_save, safe_load
from megatron.training.checkpointing.save import CHECKPOINT_VERSION
from megatron.training.checkpointing.sharded_index import is_sharded_checkpoint

CKPT_FORMATS = ("torch_dist", "torch")


def find_iteration_dir(root: str, iteration: Optional[int] = None) -> str:
    """The directory of ``iteration``, or of the tracker's (latest / release) one."""
    if iteration is None:
        tracker = read_tracker(root)
        if tracker is None:
            raise CheckpointError(f"{root} holds no checkpoint ({TRACKER_FILE} is missing).")
        iteration, release = tracker
        path = os.path.join(root, iteration_dir_name(iteration, release))
    else:
        path = os.path.join(root, iteration_dir_name(iteration))
    if not os.path.isdir(path):
        raise CheckpointError(f"{path} does not exist.")
    return path


def read_model(iteration_dir: str) -> Tuple[Dict[str, torch.Tensor], Dict, Dict]:
    """(full tensors, the saved layout, the saved args) of a checkpoint directory, in either
    format."""
    if is_sharded_checkpoint(iteration_dir):
        full, layout, args = sharded.read_model(iteration_dir)
        return _stacked(full, iteration_dir), layout, args
    files = _torch_files(iteration_dir)
    layout = files[min(files)]["layout"]
    vpp = layout["virtual_pipeline_model_parallel_size"]
    full = full_from_files(files, layout, lambda rank, c: files[rank][model_key(c, vpp)])
    full.update(_expert_files(iteration_dir))
    return _stacked(full, iteration_dir), layout, dict(files[min(files)].get("args") or {})


def _expert_files(iteration_dir: str) -> Dict[str, torch.Tensor]:
    try:
        return experts.read_expert_files(iteration_dir)
    except (KeyError, RuntimeError, ValueError) as exc:
        raise CheckpointError(f"{iteration_dir}: its expert files do not fit together "
                              f"({exc}).") from None


def _stacked(full: Dict[str, torch.Tensor], iteration_dir: str) -> Dict[str, torch.Tensor]:
    """Per-expert entries (as checkpoints hold them) stacked per layer, as models hold them."""
    try:
        return experts.stack_experts(full)
    except (KeyError, RuntimeError) as exc:
        raise CheckpointError(f"{iteration_dir}: incomplete experts ({exc}).") from None


def _torch_files(iteration_dir: str) -> Dict:
    """Every (TP, PP) position's model file of a torch-format checkpoint, checked complete."""
    files = {coords: safe_load(os.path.join(path, MODEL_FILE))
             for coords, path in saved_rank_dirs(iteration_dir).items()}
    layout = files[min(files)].get("layout")
    if layout is None:
        raise CheckpointError(f"{iteration_dir} is not a checkpoint written by this project "
                              f"(no layout record).")
    check_rank_dirs_complete(iteration_dir, files, layout)
    return files


def checkpoint_tensors(iteration_dir: str) -> Dict[str, torch.Tensor]:
    """Every tensor of a checkpoint directory, for comparing two checkpoints bit for bit.
    Torch format: all ranks' files (``args`` left out, as it holds the run's own paths),
    keyed "mp_rank_XX/file.pt/path/in/state". Sharded format: every global tensor whole
    and each rank's RNG tensors (see offline_sharded.checkpoint_tensors)."""
    if is_sharded_checkpoint(iteration_dir):
        return sharded.checkpoint_tensors(iteration_dir)
    out = {}
    for coords, rank_dir in saved_rank_dirs(iteration_dir).items():
        for file_name in sorted(os.listdir(rank_dir)):
            if not file_name.endswith(".pt"):
                continue
            stack = [(f"{os.path.basename(rank_dir)}/{file_name}",
                      safe_load(os.path.join(rank_dir, file_name)))]
            while stack:
                name, value = stack.pop()
                if isinstance(value, dict):
                    stack += [(f"{name}/{k}", v) for k, v in value.items() if k != "args"]
                elif isinstance(value, (list, tuple)):
                    stack += [(f"{name}/{i}", v) for i, v in enumerate(value)]
                elif torch.is_tensor(value):
                    out[name] = value
    return out


@dataclass
class TargetLayout:
    """How to cut a model for ``write_model``."""
    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    virtual_pipeline_model_parallel_size: Optional[int] = None
    make_vocab_size_divisible_by: int = 128
    num_layers_in_first_pipeline_stage: Optional[int] = None
    num_layers_in_last_pipeline_stage: Optional[int] = None
    expert_model_parallel_size: int = 1
    expert_tensor_parallel_size: Optional[int] = None  # None: the tensor-parallel size


def write_model(root: str, full: Dict[str, torch.Tensor], num_layers: int, vocab_size: int,
                gated_mlp: bool, tied_output: bool, target: TargetLayout, args: Dict,
                iteration: Optional[int] = None, progress=None,
                ckpt_format: str = "torch") -> str:
    """Write ``full`` as a checkpoint under ``root`` (``release`` when ``iteration`` is None),
    atomically: a staging directory renamed into place, the tracker last. Returns its path.
    ``progress(done, total)`` is called after each file.

    ``ckpt_format`` "torch": one file per (TP, PP) position of ``target``. "torch_dist": the
    sharded format, every tensor whole in one file; it loads at any layout, so its layout
    record says TP = PP = DP = 1 whatever ``target`` (which then only shapes ``args``).
    Stacked experts (``mlp.experts.weight1/2``) are written per global expert: in the sharded
    format as whole tensors, in the torch format as each (expert TP, PP, EP) position's
    ``experts.pt``, as training writes them."""
    dense, per_expert = experts.split_experts(full)
    if ckpt_format == "torch_dist":
        layout = sharded_layout(num_layers, vocab_size, gated_mlp, tied_output,
                                target.make_vocab_size_divisible_by)
        whole = {**dense, **{n: t.clone() for n, t in per_expert.items()}}
        path = sharded.write_checkpoint(_fresh(root), whole, layout, args, iteration)
        if progress is not None:
            progress(1, 1)
        return path
    _check_format(ckpt_format)
    layout = {"tensor_model_parallel_size": target.tensor_model_parallel_size,
              "pipeline_model_parallel_size": target.pipeline_model_parallel_size,
              "virtual_pipeline_model_parallel_size":
                  target.virtual_pipeline_model_parallel_size,
              "data_parallel_size": 1, "num_layers": num_layers, "vocab_size": vocab_size,
              "padded_vocab_size": vocab_size_with_padding(
                  vocab_size, target.make_vocab_size_divisible_by,
                  target.tensor_model_parallel_size),
              "gated_mlp": gated_mlp, "tied_output": tied_output,
              "distributed_optimizer": False,
              "expert_model_parallel_size": target.expert_model_parallel_size,
              "expert_tensor_parallel_size": target.expert_tensor_parallel_size
              or target.tensor_model_parallel_size}
    ranges = _stage_ranges(layout, target.num_layers_in_first_pipeline_stage,
                           target.num_layers_in_last_pipeline_stage)
    write_experts = None
    if per_expert:
        def write_experts(staging):
            experts.write_expert_files(staging, per_expert, layout, ranges,
                                       experts.num_experts(full))
    return _write_torch(root, dense, layout, ranges, args, iteration, None, progress,
                        write_experts)


def _check_format(ckpt_format: str) -> None:
    if ckpt_format not in CKPT_FORMATS:
        raise ValueError(f"unknown checkpoint format {ckpt_format!r} (one of {CKPT_FORMATS})")


def _fresh(root: str) -> str:
    """``root``, made, with no staging leftover of an earlier failed write."""
    os.makedirs(root, exist_ok=True)
    for name in os.listdir(root):
        if name.endswith(STAGING_SUFFIX):
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)
    return root


def sharded_layout(num_layers: int, vocab_size: int, gated_mlp: bool, tied_output: bool,
                   make_vocab_size_divisible_by: int = 128) -> Dict:
    """The layout record of a sharded checkpoint written offline (one rank held it all)."""
    return {"tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 1,
            "virtual_pipeline_model_parallel_size": None, "data_parallel_size": 1,
            "num_layers": num_layers, "layer_ranges": [[0, num_layers]],
            "vocab_size": vocab_size,
            "padded_vocab_size": vocab_size_with_padding(vocab_size,
                                                         make_vocab_size_divisible_by, 1),
            "gated_mlp": gated_mlp, "tied_output": tied_output,
            "distributed_optimizer": False}


def _stage_ranges(layout: Dict, first_stage: Optional[int], last_stage: Optional[int],
                  account_for_embedding: bool = False, account_for_loss: bool = False
                  ) -> List[List[List[int]]]:
    """Per pipeline rank, its chunks' [start, end) layer ranges."""
    pp, vpp = (layout["pipeline_model_parallel_size"],
               layout["virtual_pipeline_model_parallel_size"])
    return [[list(chunk_layer_range(layout["num_layers"], pp, pp_rank, c, vpp, first_stage,
                                    last_stage, account_for_embedding, account_for_loss))
             for c in range(vpp or 1)] for pp_rank in range(pp)]


def _write_torch(root: str, full: Dict[str, torch.Tensor], layout: Dict,
                 ranges: List[List[List[int]]], args: Dict, iteration: Optional[int],
                 state: Optional["FullCheckpoint"], progress, write_experts=None) -> str:
    """The torch format: each (TP, PP) position's files, cut from whole tensors; with
    ``state`` also its optimizer state, LR schedule, RNG states and counters;
    ``write_experts(staging)`` adds the expert files."""
    tp, pp = layout["tensor_model_parallel_size"], layout["pipeline_model_parallel_size"]
    name = iteration_dir_name(iteration or 0, release=iteration is None)
    staging = os.path.join(_fresh(root), name + STAGING_SUFFIX)
    for pp_rank in range(pp):
        for tp_rank in range(tp):
            file_layout = {**layout, "layer_ranges": ranges[pp_rank]}
            files = _torch_rank_files(full, file_layout, args, iteration, state, tp_rank,
                                      pp_rank)
            for file_name, obj in files.items():
                path = os.path.join(staging, rank_dir_name(tp_rank, pp_rank, pp), file_name)
                os.makedirs(os.path.dirname(path), exist_ok=True)
                atomic_save(obj, path)
            if progress is not None:
                progress(pp_rank * tp + tp_rank + 1, pp * tp)
    if write_experts is not None:
        write_experts(staging)
    publish(root, staging, name, RELEASE if iteration is None else iteration)
    return os.path.join(root, name)


def _cut(full: Dict[str, torch.Tensor], layout: Dict, tp_rank: int, pp_rank: int, chunk: int
         ) -> Dict[str, torch.Tensor]:
    """One chunk's tensors (chunk-local names, vocabulary padded) for a (TP, PP) position."""
    pp, chunks = layout["pipeline_model_parallel_size"], len(layout["layer_ranges"])
    pre = pp_rank == 0 and chunk == 0
    post = pp_rank == pp - 1 and chunk == chunks - 1
    return shard_for_rank(full, tuple(layout["layer_ranges"][chunk]), pre, post,
                          layout["tied_output"], layout["gated_mlp"],
                          layout["padded_vocab_size"], layout["tensor_model_parallel_size"],
                          tp_rank)


def _torch_rank_files(full, layout, args, iteration, state, tp_rank, pp_rank) -> Dict:
    vpp = layout["virtual_pipeline_model_parallel_size"]
    chunks = range(len(layout["layer_ranges"]))
    model_state = {"checkpoint_version": CHECKPOINT_VERSION, "iteration": iteration or 0,
                   "args": {**args,
                            "tensor_model_parallel_size": layout["tensor_model_parallel_size"],
                            "pipeline_model_parallel_size":
                                layout["pipeline_model_parallel_size"],
                            "virtual_pipeline_model_parallel_size": vpp},
                   "layout": layout}
    for c in chunks:
        model_state[model_key(c, vpp)] = _cut(full, layout, tp_rank, pp_rank, c)
    files = {MODEL_FILE: model_state}
    if state is None:
        return files
    model_state["args"] = dict(args)  # a resumable checkpoint keeps its run's args as saved
    model_state.update(consumed_train_samples=state.consumed_train_samples,
                       consumed_valid_samples=state.consumed_valid_samples)
    if state.optimizer is not None:
        params = {}
        for c in chunks:
            per_key = {key: _cut(tensors, layout, tp_rank, pp_rank, c)
                       for key, tensors in state.optimizer.items()}
            params.update(join_optimizer_params(per_key, c))
        optimizer = {**state.optimizer_meta, "params": params}
        model_state["opt_param_scheduler"] = state.scheduler
        if layout.get("distributed_optimizer"):
            files[OPTIMIZER_FILE] = optimizer
        else:
            model_state["optimizer"] = optimizer
    rng = [state.rng.get((tp_rank, pp_rank, dp)) for dp in range(layout["data_parallel_size"])]
    if all(r is not None for r in rng):
        model_state["rng_state"] = rng
    return files


# --- whole checkpoints (model, optimizer, schedule, RNG), for converting between formats -----
@dataclass
class FullCheckpoint:
    """Everything a checkpoint holds, layout-free: tensors whole by global name (vocabulary
    unpadded), the RNG states by the saved ranks' (tp, pp, dp) places in ``layout``."""
    model: Dict[str, torch.Tensor]
    layout: Dict
    args: Dict
    iteration: Optional[int]  # None: release
    consumed_train_samples: int = 0
    consumed_valid_samples: int = 0
    optimizer: Optional[Dict[str, Dict[str, torch.Tensor]]] = None  # key -> name -> tensor
    optimizer_meta: Optional[Dict] = None  # step, state_keys, param_groups, ...
    scheduler: Optional[Dict] = None
    rng: Dict[Tuple[int, int, int], Dict] = field(default_factory=dict)


def _iteration_of(iteration_dir: str) -> Optional[int]:
    match = re.fullmatch(r"iter_(\d+)", os.path.basename(iteration_dir.rstrip(os.sep)))
    return int(match.group(1)) if match else None


def read_checkpoint(iteration_dir: str) -> FullCheckpoint:
    """Every part of a checkpoint directory of either format."""
    if is_sharded_checkpoint(iteration_dir):
        return _read_sharded_checkpoint(iteration_dir)
    files = _torch_files(iteration_dir)
    if _expert_files(iteration_dir):
        raise CheckpointError(f"{iteration_dir} holds experts in the torch format: converting "
                              f"its whole state (optimizer included) is not supported; convert "
                              f"the weights with layout flags, or resume and save with "
                              f"--ckpt-format torch_dist.")
    first = files[min(files)]
    layout = first["layout"]
    vpp = layout["virtual_pipeline_model_parallel_size"]
    out = FullCheckpoint(
        full_from_files(files, layout, lambda rank, c: files[rank][model_key(c, vpp)]),
        layout, dict(first.get("args") or {}), _iteration_of(iteration_dir),
        int(first.get("consumed_train_samples", 0)),
        int(first.get("consumed_valid_samples", 0)))
    rank_dirs = saved_rank_dirs(iteration_dir)
    states = {}
    for coords, state in files.items():
        path = os.path.join(rank_dirs[coords], OPTIMIZER_FILE)
        states[coords] = state.get("optimizer") or (safe_load(path) if os.path.isfile(path)
                                                    else None)
        for dp, rng in enumerate(state.get("rng_state") or []):
            out.rng[(*coords, dp)] = rng
    if all(s is not None for s in states.values()):
        keys = sorted({k for s in states.values() for e in s["params"].values() for k in e})
        out.optimizer = {key: full_from_files(files, layout, lambda rank, c, k=key:
                                              split_optimizer_params(states[rank]["params"], c)
                                              .get(k, {})) for key in keys}
        out.optimizer_meta = {k: v for k, v in states[min(states)].items() if k != "params"}
        out.scheduler = first.get("opt_param_scheduler")
    return out


def _read_sharded_checkpoint(iteration_dir: str) -> FullCheckpoint:
    meta, reader = sharded.open_checkpoint(iteration_dir)
    model, layout, args = sharded.read_model(iteration_dir)
    out = FullCheckpoint(model, layout, args, _iteration_of(iteration_dir),
                         int(meta.get("consumed_train_samples", 0)),
                         int(meta.get("consumed_valid_samples", 0)))
    out.rng = sharded.read_rng_states(iteration_dir, reader, layout)
    if meta.get("optimizer") is not None:
        out.optimizer = sharded.read_optimizer_tensors(reader)
        out.optimizer_meta = {k: v for k, v in meta["optimizer"].items() if k != "params"}
        out.scheduler = meta.get("opt_param_scheduler")
    return out


def write_checkpoint(root: str, checkpoint: FullCheckpoint, ckpt_format: str) -> str:
    """Write ``checkpoint`` under ``root`` in ``ckpt_format`` at its own layout (so the RNG
    states still belong to the same ranks): a run of that layout resumes from it as from the
    original. Returns the iteration directory."""
    c = checkpoint
    if ckpt_format == "torch_dist":
        return sharded.write_checkpoint(
            _fresh(root), c.model, c.layout, c.args, c.iteration, c.optimizer,
            c.optimizer_meta, c.scheduler, c.rng, c.consumed_train_samples,
            c.consumed_valid_samples)
    _check_format(ckpt_format)
    if any(experts.is_expert_name(n) for n in c.model):
        raise CheckpointError("an MoE checkpoint's whole state (optimizer included) cannot be "
                              "written in the torch format here; convert the weights with "
                              "layout flags instead.")
    a = c.args
    ranges = _stage_ranges(c.layout, a.get("num_layers_in_first_pipeline_stage"),
                           a.get("num_layers_in_last_pipeline_stage"),
                           bool(a.get("account_for_embedding_in_pipeline_split")),
                           bool(a.get("account_for_loss_in_pipeline_split")))
    if ranges[0] != [list(r) for r in c.layout["layer_ranges"]]:
        raise CheckpointError(f"the saved layer ranges {c.layout['layer_ranges']} are not "
                              f"what the saved args give ({ranges[0]}).")
    layout = {k: v for k, v in c.layout.items() if k != "layer_ranges"}
    return _write_torch(root, c.model, layout, ranges, c.args, c.iteration, c, None)
