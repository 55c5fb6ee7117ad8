"""Checkpoints without a running job: read a saved model into full tensors, and write full
tensors as a checkpoint for any (TP, PP, VPP) layout. The conversion tools (HF <-> Megatron,
offline resharding) are built on these two functions.

Full tensors use this project's names (``decoder.layers.{global i}...``), are unsharded, and
hold the true vocabulary (no padding); ``write_model`` pads it as training will.
"""
import os
import shutil
from dataclasses import dataclass
from typing import Dict, Optional, Tuple

import torch

from megatron.core.pipeline_parallel.layer_split import chunk_layer_range
from megatron.core.utils import vocab_size_with_padding
from megatron.training.checkpointing.layout import model_key
from megatron.training.checkpointing.load import check_rank_dirs_complete, saved_rank_dirs
from megatron.training.checkpointing.paths import (
    MODEL_FILE,
    RELEASE,
    STAGING_SUFFIX,
    TRACKER_FILE,
    CheckpointError,
    iteration_dir_name,
    rank_dir_name,
    read_tracker,
)
from megatron.training.checkpointing.reshard import shard_for_rank
from megatron.training.checkpointing.resharder import full_from_files
from megatron.training.checkpointing.safe_io import atomic_save, safe_load
from megatron.training.checkpointing.save import CHECKPOINT_VERSION, publish


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
    """(full tensors, the saved layout, the saved args) of a checkpoint directory."""
    files = {coords: safe_load(os.path.join(path, MODEL_FILE))
             for coords, path in saved_rank_dirs(iteration_dir).items()}
    first = files[min(files)]
    layout = first.get("layout")
    if layout is None:
        raise CheckpointError(f"{iteration_dir} is not a checkpoint written by this project "
                              f"(no layout record).")
    check_rank_dirs_complete(iteration_dir, files, layout)
    vpp = layout["virtual_pipeline_model_parallel_size"]
    full = full_from_files(files, layout, lambda rank, c: files[rank][model_key(c, vpp)])
    return full, layout, dict(first.get("args") or {})


def checkpoint_tensors(iteration_dir: str) -> Dict[str, torch.Tensor]:
    """Every tensor of a checkpoint directory (all ranks' files; ``args`` left out, as it holds
    the run's own paths), keyed "mp_rank_XX/file.pt/path/in/state": for comparing two
    checkpoints bit for bit."""
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


def write_model(root: str, full: Dict[str, torch.Tensor], num_layers: int, vocab_size: int,
                gated_mlp: bool, tied_output: bool, target: TargetLayout, args: Dict,
                iteration: Optional[int] = None, progress=None) -> str:
    """Write ``full`` as a checkpoint under ``root`` (``release`` when ``iteration`` is None),
    atomically: a staging directory renamed into place, the tracker last. Returns its path.
    ``progress(done, total)`` is called after each file."""
    tp, pp, vpp = (target.tensor_model_parallel_size, target.pipeline_model_parallel_size,
                   target.virtual_pipeline_model_parallel_size)
    padded = vocab_size_with_padding(vocab_size, target.make_vocab_size_divisible_by, tp)
    name = iteration_dir_name(iteration or 0, release=iteration is None)
    staging = os.path.join(root, name + STAGING_SUFFIX)
    shutil.rmtree(staging, ignore_errors=True)
    chunks = vpp or 1
    for pp_rank in range(pp):
        ranges = [list(chunk_layer_range(
            num_layers, pp, pp_rank, c, vpp, target.num_layers_in_first_pipeline_stage,
            target.num_layers_in_last_pipeline_stage)) for c in range(chunks)]
        for tp_rank in range(tp):
            state = {"checkpoint_version": CHECKPOINT_VERSION, "iteration": iteration or 0,
                     "args": {**args, "tensor_model_parallel_size": tp,
                              "pipeline_model_parallel_size": pp,
                              "virtual_pipeline_model_parallel_size": vpp},
                     "layout": {"tensor_model_parallel_size": tp,
                                "pipeline_model_parallel_size": pp,
                                "virtual_pipeline_model_parallel_size": vpp,
                                "data_parallel_size": 1, "num_layers": num_layers,
                                "layer_ranges": ranges, "vocab_size": vocab_size,
                                "padded_vocab_size": padded, "gated_mlp": gated_mlp,
                                "tied_output": tied_output, "distributed_optimizer": False}}
            for c, layer_range in enumerate(ranges):
                pre = pp_rank == 0 and c == 0
                post = pp_rank == pp - 1 and c == chunks - 1
                state[model_key(c, vpp)] = shard_for_rank(
                    full, tuple(layer_range), pre, post, tied_output, gated_mlp, padded, tp,
                    tp_rank)
            path = os.path.join(staging, rank_dir_name(tp_rank, pp_rank, pp), MODEL_FILE)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            atomic_save(state, path)
            if progress is not None:
                progress(pp_rank * tp + tp_rank + 1, pp * tp)
    os.makedirs(root, exist_ok=True)
    publish(root, staging, name, RELEASE if iteration is None else iteration)
    return os.path.join(root, name)
