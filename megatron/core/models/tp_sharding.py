"""Split a full (unsharded) model state dict over TP ranks and merge it back, and select a
pipeline stage's layers. Pure tensor code, so offline conversion tools can use it.

Parameter names are this project's (Megatron-core's): ``embedding.word_embeddings.weight``,
``decoder.layers.{i}.self_attention.linear_qkv.weight``, ``output_layer.weight``...
"""
import re
from typing import Dict, List, Optional, Tuple

import torch

# name suffix -> dimension split over TP ranks; everything else is replicated.
_PARTITION_DIMS = {
    "word_embeddings.weight": 0,
    "output_layer.weight": 0,
    "linear_qkv.weight": 0,
    "linear_qkv.bias": 0,
    "linear_fc1.weight": 0,
    "linear_fc1.bias": 0,
    "linear_proj.weight": 1,
    "linear_fc2.weight": 1,
}
_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.*)$")


def partition_of(name: str, gated_mlp: bool) -> Optional[Tuple[int, int]]:
    """(dim, stride) along which ``name`` is split over TP ranks, or None if replicated.
    SwiGLU's fc1 ([gate; up]) is split with stride 2 so each rank gets its gate and up rows."""
    for suffix, dim in _PARTITION_DIMS.items():
        if name.endswith(suffix):
            stride = 2 if gated_mlp and "linear_fc1" in suffix else 1
            return dim, stride
    return None


def shard_tensor(full: torch.Tensor, dim: int, stride: int, tp_size: int,
                 tp_rank: int) -> torch.Tensor:
    blocks = full.chunk(stride * tp_size, dim=dim)
    if full.shape[dim] % (stride * tp_size) != 0:
        raise ValueError(f"dimension {dim} of size {full.shape[dim]} does not split into "
                         f"{stride} x {tp_size} equal blocks.")
    return torch.cat(blocks[tp_rank::tp_size], dim=dim).clone()


def merge_tensor(shards: List[torch.Tensor], dim: int, stride: int) -> torch.Tensor:
    per_rank = [s.chunk(stride, dim=dim) for s in shards]
    return torch.cat([blocks[j] for j in range(stride) for blocks in per_rank], dim=dim)


def shard_state_dict(full: Dict[str, torch.Tensor], tp_size: int, tp_rank: int,
                     gated_mlp: bool) -> Dict[str, torch.Tensor]:
    out = {}
    for name, tensor in full.items():
        part = partition_of(name, gated_mlp)
        out[name] = tensor.clone() if part is None else shard_tensor(tensor, *part, tp_size,
                                                                      tp_rank)
    return out


def merge_state_dicts(shards: List[Dict[str, torch.Tensor]],
                      gated_mlp: bool) -> Dict[str, torch.Tensor]:
    out = {}
    for name in shards[0]:
        part = partition_of(name, gated_mlp)
        tensors = [s[name] for s in shards]
        out[name] = tensors[0].clone() if part is None else merge_tensor(tensors, *part)
    return out


def select_layers(full: Dict[str, torch.Tensor], layer_range: Tuple[int, int],
                  pre_process: bool, post_process: bool,
                  tied_output: bool) -> Dict[str, torch.Tensor]:
    """A pipeline chunk's entries: its layers renumbered from 0, the embedding on the first
    stage, the final norm and output layer on the last (a tied output layer on a stage
    without the embedding gets the embedding's weight)."""
    start, end = layer_range
    out = {}
    for name, tensor in full.items():
        match = _LAYER.match(name)
        if match:
            index = int(match.group(1))
            if start <= index < end:
                out[f"decoder.layers.{index - start}.{match.group(2)}"] = tensor
        elif name.startswith("embedding."):
            if pre_process:
                out[name] = tensor
        elif post_process:
            out[name] = tensor
    if post_process and tied_output and not pre_process and \
            "embedding.word_embeddings.weight" in full:
        out["output_layer.weight"] = full["embedding.word_embeddings.weight"]
    return out
