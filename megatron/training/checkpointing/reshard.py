"""Moving saved tensors between parallel layouts.

Every saved per-parameter tensor (weights, and optimizer state in the format of
``megatron/core/optimizer/named_state.py``) has its model parameter's shape, so one path
serves all of them: rename each chunk's layers to global numbers, merge the tensor-parallel
shards, drop the vocabulary padding; then, for this rank, select its chunk's layers, pad the
vocabulary as this run pads it, and cut its tensor-parallel shard.
"""
import re
from typing import Dict, List, Sequence, Tuple

import torch
import torch.nn.functional as F

from megatron.core.models.tp_sharding import merge_tensor, partition_of, select_layers, shard_tensor

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.*)$")
_VOCAB_SUFFIXES = ("word_embeddings.weight", "output_layer.weight")


def renumber_layers(state: Dict[str, torch.Tensor], offset: int) -> Dict[str, torch.Tensor]:
    """Chunk-local layer numbers -> global ones (``offset`` = the chunk's first layer)."""
    out = {}
    for name, tensor in state.items():
        match = _LAYER.match(name)
        out[f"decoder.layers.{int(match.group(1)) + offset}.{match.group(2)}"
            if match else name] = tensor
    return out


def _is_vocab(name: str) -> bool:
    return name.endswith(_VOCAB_SUFFIXES)


def merge_tensor_parallel(shards: Sequence[Dict[str, torch.Tensor]], gated_mlp: bool,
                          vocab_size: int) -> Dict[str, torch.Tensor]:
    """One chunk's TP shards (same names on every rank) -> full tensors, vocab unpadded."""
    out = {}
    for name in shards[0]:
        part = partition_of(name, gated_mlp)
        tensors = [s[name] for s in shards]
        full = tensors[0] if part is None else merge_tensor(tensors, *part)
        out[name] = full[:vocab_size] if _is_vocab(name) else full
    return out


def shard_for_rank(full: Dict[str, torch.Tensor], layer_range: Tuple[int, int],
                   pre_process: bool, post_process: bool, tied_output: bool, gated_mlp: bool,
                   padded_vocab_size: int, tp_size: int, tp_rank: int
                   ) -> Dict[str, torch.Tensor]:
    """This rank's chunk (chunk-local names) from full tensors with global layer numbers."""
    chunk = select_layers(full, layer_range, pre_process, post_process, tied_output)
    out = {}
    for name, tensor in chunk.items():
        if _is_vocab(name) and tensor.shape[0] < padded_vocab_size:
            pad = [0, 0] * (tensor.dim() - 1) + [0, padded_vocab_size - tensor.shape[0]]
            tensor = F.pad(tensor, pad)
        part = partition_of(name, gated_mlp)
        out[name] = tensor.clone() if part is None else shard_tensor(tensor, *part, tp_size,
                                                                      tp_rank)
    return out


def split_optimizer_params(params: Dict[str, Dict[str, torch.Tensor]], chunk: int
                           ) -> Dict[str, Dict[str, torch.Tensor]]:
    """{"c/name": {key: tensor}} -> {key: {name: tensor}} for chunk ``c``."""
    out: Dict[str, Dict[str, torch.Tensor]] = {}
    prefix = f"{chunk}/"
    for full_name, entry in params.items():
        if full_name.startswith(prefix):
            for key, tensor in entry.items():
                out.setdefault(key, {})[full_name[len(prefix):]] = tensor
    return out


def join_optimizer_params(per_key: Dict[str, Dict[str, torch.Tensor]], chunk: int
                          ) -> Dict[str, Dict[str, torch.Tensor]]:
    out: Dict[str, Dict[str, torch.Tensor]] = {}
    for key, tensors in per_key.items():
        for name, tensor in tensors.items():
            out.setdefault(f"{chunk}/{name}", {})[key] = tensor
    return out


def merged_keys(per_key_lists: List[Dict[str, Dict]]) -> List[str]:
    keys = set()
    for per_key in per_key_lists:
        keys.update(per_key)
    return sorted(keys)
