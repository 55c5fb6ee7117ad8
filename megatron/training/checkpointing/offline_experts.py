"""Routed experts in checkpoints written or read without a job (offline.py).

The tools hold a model's experts stacked, as the model and the HF conversion do
(``decoder.layers.{i}.mlp.experts.weight1`` [E, 2f, h], ``weight2`` [E, h, f]); checkpoints
hold them per global expert (``...mlp.experts.{g}.linear_fc1.weight`` [2f, h], see
experts.py). Here: the one form to the other, and the torch format's expert files
(``mp_rank_{etp}_{pp}_{ep}/experts.pt``, see expert_files.py) cut for any EP x expert TP.
"""
import os
import re
from typing import Dict, List, Optional, Tuple

import torch

from megatron.training.checkpointing.expert_files import EXPERT_FILE, _read_expert_files, _whole
from megatron.training.checkpointing.experts import (
    expert_tensor_parallel_shard,
    is_expert_name,
    is_stacked_expert,
    split_stacked,
)
from megatron.training.checkpointing.safe_io import atomic_save

_PER_EXPERT = re.compile(
    r"^(?P<prefix>.*\.mlp\.experts)\.(?P<g>\d+)\.linear_fc(?P<w>[12])\.(?P<kind>weight|bias)$")
_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")


def has_stacked_experts(full: Dict[str, torch.Tensor]) -> bool:
    return any(is_stacked_expert(n) for n in full)


def num_experts(full: Dict[str, torch.Tensor]) -> Optional[int]:
    """Experts per MoE layer of stacked ``full`` (None: no experts)."""
    sizes = {t.shape[0] for n, t in full.items() if is_stacked_expert(n)}
    return min(sizes) if sizes else None


def split_experts(full: Dict[str, torch.Tensor]
                  ) -> Tuple[Dict[str, torch.Tensor], Dict[str, torch.Tensor]]:
    """(dense entries, experts by per-expert global name) of stacked ``full``."""
    dense, experts = {}, {}
    for name, tensor in full.items():
        if is_stacked_expert(name):
            experts.update(split_stacked(name, tensor, 0))
        else:
            dense[name] = tensor
    return dense, experts


def stack_experts(state: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """``state`` with its per-expert entries stacked back (every expert 0..E-1 present)."""
    groups: Dict[str, Dict[int, torch.Tensor]] = {}
    out = {}
    for name, tensor in state.items():
        match = _PER_EXPERT.match(name)
        if match is None:
            out[name] = tensor
        else:
            key = f"{match['prefix']}.{match['kind']}{match['w']}"
            groups.setdefault(key, {})[int(match["g"])] = tensor
    for key, by_expert in groups.items():
        if sorted(by_expert) != list(range(len(by_expert))):
            missing = sorted(set(range(max(by_expert) + 1)) - set(by_expert))
            raise KeyError(f"{key}: expert(s) {missing} missing")
        out[key] = torch.stack([by_expert[g] for g in range(len(by_expert))])
    return out


def _layer_of(name: str) -> int:
    return int(_LAYER.match(name).group(1))


def expert_file_names(pp: int, ep: int, etp: int) -> List[str]:
    return [f"mp_rank_{x:02d}_{p:03d}_{e:03d}" for p in range(pp) for e in range(ep)
            for x in range(etp)]


def write_expert_files(staging: str, experts: Dict[str, torch.Tensor], layout: Dict,
                       ranges: List[List[List[int]]], num_experts_per_layer: int) -> None:
    """Every (expert TP, PP, EP) position's ``experts.pt``, as training's expert-DP rank 0
    writes it: its layers' experts of its EP rank, cut to its expert-TP shard, by
    layout-free name."""
    ep, etp = layout["expert_model_parallel_size"], layout["expert_tensor_parallel_size"]
    per_rank = num_experts_per_layer // ep
    for pp_rank, chunk_ranges in enumerate(ranges):
        for ep_rank in range(ep):
            mine = range(ep_rank * per_rank, (ep_rank + 1) * per_rank)
            names = [n for n in sorted(experts)
                     if any(s <= _layer_of(n) < e for s, e in chunk_ranges)
                     and int(_PER_EXPERT.match(n)["g"]) in mine]
            for etp_rank in range(etp):
                model = {n: expert_tensor_parallel_shard(experts[n], n, etp, etp_rank)
                         for n in names}
                path = os.path.join(staging, f"mp_rank_{etp_rank:02d}_{pp_rank:03d}_"
                                    f"{ep_rank:03d}", EXPERT_FILE)
                os.makedirs(os.path.dirname(path), exist_ok=True)
                atomic_save({"layout": {**layout, "layer_ranges": chunk_ranges},
                             "model": model}, path)


def read_expert_files(iteration_dir: str) -> Dict[str, torch.Tensor]:
    """Whole experts (per-expert global names) of a torch-format checkpoint ({}: none)."""
    files = _read_expert_files(iteration_dir)
    if not files:
        return {}
    experts = _whole(files, lambda s: s["model"])
    if not all(is_expert_name(n) for n in experts):
        raise KeyError("an expert file holds entries that are not per-expert weights")
    return experts
