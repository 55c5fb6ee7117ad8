"""Routed experts in the torch format: one file per (expert-TP, PP, EP) position.

The (TP, PP) files keep the dense entries (written by DP rank 0, as without experts);
expert-DP rank 0 of each (ETP, PP, EP) position writes ``mp_rank_{etp:02d}_{pp:03d}_{ep:03d}/
experts.pt``: its experts' weights and optimizer state by layout-free name (global layer
and expert numbers, ETP shards). A load at any layout merges the ETP shards of the experts
it needs and cuts its own (see experts.py).
"""
import os
import re
from typing import Dict, List, Optional, Tuple

import torch

from megatron.core import parallel_state
from megatron.core.pipeline_parallel.model_chunks import unwrap_model
from megatron.training.checkpointing.experts import (
    expert_shard,
    is_stacked_expert,
    merge_expert_tensor_parallel,
    split_stacked,
    stack_for_rank,
)
from megatron.training.checkpointing.reshard import renumber_layers
from megatron.training.checkpointing.safe_io import safe_load

EXPERT_FILE = "experts.pt"
_EXPERT_DIR = re.compile(r"mp_rank_(\d{2})_(\d{3})_(\d{3})")


def has_experts(model_chunks) -> bool:
    return any(is_stacked_expert(n) for c in model_chunks
               for n in unwrap_model(c).state_dict())


def expert_dir_name() -> str:
    shard = expert_shard()
    return (f"mp_rank_{shard.etp_rank:02d}_"
            f"{parallel_state.get_pipeline_model_parallel_rank():03d}_{shard.ep_rank:03d}")


def _chunk_key(name: str) -> Tuple[int, str]:
    chunk, local = name.split("/", 1)
    return int(chunk), local


def without_experts(model_state: Dict, optimizer_state: Optional[Dict]):
    """The dense part of a chunk's model state and of the named optimizer state."""
    dense = {n: t for n, t in model_state.items() if not is_stacked_expert(n)}
    if optimizer_state is None:
        return dense, None
    params = {n: e for n, e in optimizer_state["params"].items() if not is_stacked_expert(n)}
    return dense, {**optimizer_state, "params": params}


def expert_file_state(model_states: List[Dict], optimizer_state: Optional[Dict],
                      layer_ranges, layout: Dict) -> Dict:
    """This rank's experts by layout-free name (copies: a view would save its whole stack)."""
    ep_rank = expert_shard().ep_rank

    def per_expert(name, tensor, chunk):
        local = split_stacked(name, tensor, ep_rank)
        return renumber_layers({n: t.clone() for n, t in local}, layer_ranges[chunk][0])

    model = {}
    for c, state in enumerate(model_states):
        for name, tensor in state.items():
            if is_stacked_expert(name):
                model.update(per_expert(name, tensor, c))
    out = {"layout": layout, "model": model}
    if optimizer_state is not None:
        optim = {}
        for full_name, entry in optimizer_state["params"].items():
            c, name = _chunk_key(full_name)
            if is_stacked_expert(name):
                for key, value in entry.items():
                    for expert, tensor in per_expert(name, value, c).items():
                        optim.setdefault(expert, {})[key] = tensor
        out["optimizer"] = optim
    return out


def _read_expert_files(iteration_dir: str) -> List[Tuple[int, Dict]]:
    """(ETP rank, state) of every expert file."""
    out = []
    for name in sorted(os.listdir(iteration_dir)):
        match = _EXPERT_DIR.fullmatch(name)
        if match:
            out.append((int(match.group(1)),
                        safe_load(os.path.join(iteration_dir, name, EXPERT_FILE))))
    return out


def _whole(files, pick) -> Dict[str, torch.Tensor]:
    shards: Dict[str, Dict[int, torch.Tensor]] = {}
    for etp_rank, state in files:
        for name, tensor in pick(state).items():
            shards.setdefault(name, {})[etp_rank] = tensor
    return merge_expert_tensor_parallel(shards)


def load_experts(iteration_dir: str, model_chunks, layer_ranges, models: List[Dict],
                 optimizer: Optional[Dict]) -> None:
    """Add this rank's stacked experts to ``models`` (per chunk, chunk-local names) and, if
    given, to the named ``optimizer`` state, from the expert files of any layout."""
    files = _read_expert_files(iteration_dir)
    if not files:
        return  # _check_architecture names what is missing
    shard = expert_shard()
    stacked = [(c, n, t.shape[0]) for c, chunk in enumerate(model_chunks)
               for n, t in unwrap_model(chunk).state_dict().items() if is_stacked_expert(n)]

    def global_of(c, name):
        return next(iter(renumber_layers({name: None}, layer_ranges[c][0])))

    weights = _whole(files, lambda s: s["model"])
    for c, name, num_local in stacked:
        models[c][name] = stack_for_rank(weights, global_of(c, name), num_local, shard)
    if optimizer is None:
        return
    if any("optimizer" not in state for _, state in files):
        raise KeyError("optimizer state of the experts")
    keys = sorted({k for _, s in files for e in s["optimizer"].values() for k in e})
    for key in keys:
        whole = _whole(files, lambda s: {n: e[key] for n, e in s["optimizer"].items()
                                         if key in e})
        for c, name, num_local in stacked:
            optimizer["params"].setdefault(f"{c}/{name}", {})[key] = stack_for_rank(
                whole, global_of(c, name), num_local, shard)
