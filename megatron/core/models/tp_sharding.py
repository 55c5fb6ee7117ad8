"""Split a full (unsharded) model state dict over TP ranks and merge it back, and select a
pipeline stage's layers. Pure tensor code, so offline conversion tools can use it.

Parameter names are this project's (Megatron-core's): ``embedding.word_embeddings.weight``,
``decoder.layers.{i}.self_attention.linear_qkv.weight``, ``output_layer.weight``...

The stacked MoE experts (``mlp.experts.weight1`` [E, 2f, h], ``weight2`` [E, h, f]) are split
over expert-parallel ranks on dim 0 (contiguous: EP rank r holds experts r*E/EP ...), then
over expert-TP ranks like linear_fc1 (dim 1, stride 2) and linear_fc2 (dim 2); their biases
(``bias1`` [E, 2f], ``bias2`` [E, h]) by EP the same way (bias1 over expert TP like fc1).
"""
import re
from typing import Dict, List, Optional, Sequence, Tuple

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
    "self_attention.sinks": 0,  # one logit per head, split with the heads
    # Multi-latent attention: the projections to heads split by their rows (whole heads);
    # linear_q_down_proj, linear_kv_down_proj and the latents' norms are replicated.
    "linear_q_proj.weight": 0,
    "linear_q_up_proj.weight": 0,
    "linear_kv_up_proj.weight": 0,
}
_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.*)$")
# Multi-token prediction's copy of the embedding on a later pipeline stage than it (untied
# embeddings; tied ones look up in the output layer): checkpoints hold the embedding only.
MTP_EMBEDDING_COPY = "mtp.word_embeddings.weight"
# stacked expert tensor suffix -> (dim, stride) split over expert-TP ranks; dim 0 goes by EP.
# The biases (gpt-oss): bias1 [E, 2f] like weight1's rows; bias2 [E, h] is not split (biased
# experts run at expert TP 1).
_EXPERT_ETP_DIMS = {"mlp.experts.weight1": (1, 2), "mlp.experts.weight2": (2, 1),
                    "mlp.experts.bias1": (1, 2), "mlp.experts.bias2": None}


def is_stacked_expert_tensor(name: str) -> bool:
    """``name`` is a stacked expert weight or bias ([E, ...], split over EP on dim 0)."""
    return any(name.endswith(suffix) for suffix in _EXPERT_ETP_DIMS)


def expert_partition_of(name: str) -> Optional[Tuple[int, int]]:
    """(dim, stride) along which a stacked expert tensor is split over expert-TP ranks (its
    dim 0, the experts, goes by EP), or None if it is not split over them (bias2) or
    ``name`` is no stacked expert tensor (see is_stacked_expert_tensor)."""
    for suffix, part in _EXPERT_ETP_DIMS.items():
        if name.endswith(suffix):
            return part
    return None


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
                     gated_mlp: bool, ep_size: int = 1, ep_rank: int = 0,
                     etp_size: Optional[int] = None,
                     etp_rank: Optional[int] = None) -> Dict[str, torch.Tensor]:
    """One rank's share: dense entries by (tp_size, tp_rank), stacked experts by (ep_size,
    ep_rank) and (etp_size, etp_rank), which default to the TP ones (Megatron's default
    expert_tensor_parallel_size = TP)."""
    etp_size, etp_rank = (tp_size, tp_rank) if etp_size is None else (etp_size, etp_rank)
    out = {}
    for name, tensor in full.items():
        if is_stacked_expert_tensor(name):
            mine = shard_tensor(tensor, 0, 1, ep_size, ep_rank)
            expert = expert_partition_of(name)
            out[name] = mine if expert is None else shard_tensor(mine, *expert, etp_size,
                                                                 etp_rank)
            continue
        part = partition_of(name, gated_mlp)
        out[name] = tensor.clone() if part is None else shard_tensor(tensor, *part, tp_size,
                                                                      tp_rank)
    return out


def merge_state_dicts(shards: List[Dict[str, torch.Tensor]], gated_mlp: bool,
                      ranks: Optional[Sequence[Tuple[int, int, int]]] = None
                      ) -> Dict[str, torch.Tensor]:
    """Full tensors from the shards of several ranks. ``ranks[i]`` = (tp_rank, ep_rank,
    etp_rank) of ``shards[i]`` (default: shard i is TP rank i, no EP, expert TP = TP); dense
    entries come from one shard per TP rank, experts from one per (EP, expert-TP) rank."""
    ranks = [(t, 0, t) for t in range(len(shards))] if ranks is None else list(ranks)
    if len(ranks) != len(shards):
        raise ValueError(f"{len(shards)} shards but {len(ranks)} rank tuples.")
    by_tp = _one_per(shards, [r[0] for r in ranks], "tensor-parallel")
    by_expert = _one_per(shards, [r[1:] for r in ranks], "(expert-parallel, expert-TP)")
    ep_size = 1 + max(r[1] for r in ranks)
    etp_size = 1 + max(r[2] for r in ranks)
    out = {}
    for name in shards[0]:
        if is_stacked_expert_tensor(name):
            expert = expert_partition_of(name)
            per_ep = [by_expert[(e, 0)][name] if expert is None else
                      merge_tensor([by_expert[(e, x)][name] for x in range(etp_size)], *expert)
                      for e in range(ep_size)]
            out[name] = torch.cat(per_ep)
            continue
        part = partition_of(name, gated_mlp)
        tensors = [s[name] for s in by_tp]
        out[name] = tensors[0].clone() if part is None else merge_tensor(tensors, *part)
    return out


def _one_per(shards, keys, what: str):
    """The first shard of each key, checked to cover a full grid: a list for int keys, a
    dict for tuples."""
    found = {}
    for key, shard in zip(keys, shards):
        found.setdefault(key, shard)
    if isinstance(keys[0], int):
        missing = set(range(1 + max(keys))) - set(found)
        if missing:
            raise ValueError(f"no shard of {what} rank(s) {sorted(missing)}.")
        return [found[k] for k in range(len(found))]
    grid = {(e, x) for e in range(1 + max(k[0] for k in keys))
            for x in range(1 + max(k[1] for k in keys))}
    if grid - set(found):
        raise ValueError(f"no shard of {what} rank(s) {sorted(grid - set(found))}.")
    return found


def select_layers(full: Dict[str, torch.Tensor], layer_range: Tuple[int, int],
                  pre_process: bool, post_process: bool,
                  tied_output: bool) -> Dict[str, torch.Tensor]:
    """A pipeline chunk's entries: its layers renumbered from 0, the embedding on the first
    stage, the final norm and output layer on the last (a tied output layer, or with untied
    ones multi-token prediction's copy, on a stage without the embedding gets the
    embedding's weight)."""
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
    if post_process and not pre_process and "embedding.word_embeddings.weight" in full:
        if tied_output:
            out["output_layer.weight"] = full["embedding.word_embeddings.weight"]
        elif any(name.startswith("mtp.") for name in full):
            out[MTP_EMBEDDING_COPY] = full["embedding.word_embeddings.weight"]
    return out
