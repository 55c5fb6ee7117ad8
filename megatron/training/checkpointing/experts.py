"""Routed experts in checkpoints: saved by global expert index, independent of EP and ETP.

A rank's stacked ``decoder.layers.{i}.mlp.experts.weight1`` [E/EP, 2f/ETP, h] (and
``weight2`` [E/EP, h, f/ETP]) is saved as one tensor per global expert g:
``decoder.layers.{i}.mlp.experts.{g}.linear_fc1.weight`` [2f, h] (``linear_fc2`` [h, f]).
Their names end like a dense MLP's, so the linear_fc1 (dim 0, stride 2) and linear_fc2
(dim 1) split rules apply, with expert TP in place of TP; a new EP is a new choice of g.
Expert biases (gpt-oss) go the same way: ``bias1`` [E/EP, 2f] and ``bias2`` [E/EP, h] as
``...experts.{g}.linear_fc1.bias`` ([gate; up], split like fc1's rows) and ``linear_fc2.bias``
(not split).
Optimizer state (flat ranges of the stacked tensor) is cut the same way, per expert.
"""
import re
from typing import Dict, List, Tuple

import torch

from megatron.core import parallel_state
from megatron.core.models.tp_sharding import merge_tensor, partition_of, shard_tensor
from megatron.core.transformer.moe.experts import ExpertShard

_STACKED = re.compile(r"^(?P<prefix>.*\.mlp\.experts)\.(?P<kind>weight|bias)(?P<which>[12])$")
_PER_EXPERT = re.compile(r"^.*\.mlp\.experts\.\d+\.linear_fc[12]\.(weight|bias)$")
_LINEAR = {"1": "linear_fc1", "2": "linear_fc2"}


def is_stacked_expert(name: str) -> bool:
    """``name`` (chunk-local, or "{chunk}/name") is a stacked routed-expert weight or bias."""
    return _STACKED.match(name) is not None


def is_expert_name(name: str) -> bool:
    """``name`` is a per-expert (layout-free) routed-expert weight or bias."""
    return _PER_EXPERT.match(name) is not None


def expert_shard() -> ExpertShard:
    return ExpertShard.from_parallel_state()


def expert_names(stacked: str, num_local: int, ep_rank: int) -> List[str]:
    """The per-expert names of a stacked weight's ``num_local`` experts held by ``ep_rank``."""
    match = _STACKED.match(stacked)
    first = ep_rank * num_local
    return [f"{match['prefix']}.{first + l}.{_LINEAR[match['which']]}.{match['kind']}"
            for l in range(num_local)]


def split_stacked(name: str, tensor: torch.Tensor, ep_rank: int
                  ) -> List[Tuple[str, torch.Tensor]]:
    """A stacked local weight as (per-expert name, that expert's local slice)."""
    return list(zip(expert_names(name, tensor.shape[0], ep_rank), tensor.unbind(0)))


def split_state(state: Dict[str, torch.Tensor], ep_rank: int
                ) -> Tuple[Dict[str, torch.Tensor], Dict[str, torch.Tensor]]:
    """(dense entries, per-expert entries) of a chunk's state (names stay chunk-local)."""
    dense, experts = {}, {}
    for name, tensor in state.items():
        if is_stacked_expert(name):
            experts.update(split_stacked(name, tensor, ep_rank))
        else:
            dense[name] = tensor
    return dense, experts


def merge_expert_tensor_parallel(shards: Dict[str, Dict[int, torch.Tensor]]
                                 ) -> Dict[str, torch.Tensor]:
    """{per-expert name: {ETP rank: shard}} -> whole per-expert tensors."""
    out = {}
    for name, by_rank in shards.items():
        ordered = [by_rank[r] for r in range(len(by_rank))]
        part = partition_of(name, True)  # None: fc2's bias, the same on every ETP rank
        out[name] = ordered[0] if len(ordered) == 1 or part is None else merge_tensor(
            ordered, *part)
    return out


def expert_tensor_parallel_shard(full: torch.Tensor, name: str, etp_size: int,
                                 etp_rank: int) -> torch.Tensor:
    """ETP rank ``etp_rank``'s piece of a whole per-expert tensor (fc2's bias: all of it)."""
    part = partition_of(name, True)
    return full.clone() if part is None else shard_tensor(full, *part, etp_size, etp_rank)


def stack_for_rank(full: Dict[str, torch.Tensor], stacked: str, num_local: int,
                   shard: ExpertShard) -> torch.Tensor:
    """The stacked local weight ``stacked`` (global layer number) of ``shard``'s rank from
    whole per-expert tensors."""
    pieces = []
    for expert in expert_names(stacked, num_local, shard.ep_rank):
        if expert not in full:
            raise KeyError(expert)
        pieces.append(expert_tensor_parallel_shard(full[expert], expert, shard.etp_size,
                                                   shard.etp_rank))
    return torch.stack(pieces)


def expert_layout() -> Dict:
    """The expert cut of this run (EP = ETP = 1 without expert groups)."""
    if not parallel_state.expert_parallel_is_initialized():
        return {"expert_model_parallel_size": 1, "expert_tensor_parallel_size": 1}
    return {"expert_model_parallel_size":
            parallel_state.get_expert_model_parallel_world_size(),
            "expert_tensor_parallel_size":
            parallel_state.get_expert_tensor_parallel_world_size()}


def expert_data_parallel() -> Tuple[int, int]:
    """(rank, size) in the expert-DP group (the ranks holding the same expert shards)."""
    if not parallel_state.expert_parallel_is_initialized():
        return (parallel_state.get_data_parallel_rank(with_context_parallel=True),
                parallel_state.get_data_parallel_world_size(with_context_parallel=True))
    return (parallel_state.get_expert_data_parallel_rank(),
            parallel_state.get_expert_data_parallel_world_size())


def tensor_parts(local: str, shape, layer_offset: int, layout: Dict, tp_rank: int,
                 shard: ExpertShard) -> List[Tuple[str, object, int, bool]]:
    """The saved tensors a chunk's tensor ``local`` of ``shape`` is made of, for the sharded
    format: [(layout-free name, placement, its first local flat element, is an expert)]; one
    per local expert for a stacked expert weight, else the tensor itself."""
    from megatron.training.checkpointing.boxes import placement_of
    from megatron.training.checkpointing.sharded_index import global_name

    tied, vocab = layout["tied_output"], layout["vocab_size"]
    if not is_stacked_expert(local):
        return [(global_name(local, layer_offset, tied), placement_of(
            local, shape, layout["gated_mlp"], layout["tensor_model_parallel_size"], tp_rank,
            vocab), 0, False)]
    per = 1
    for size in shape[1:]:
        per *= int(size)
    return [(global_name(name, layer_offset, tied),
             placement_of(name, shape[1:], True, shard.etp_size, shard.etp_rank, vocab),
             local_index * per, True)
            for local_index, name in enumerate(expert_names(local, shape[0], shard.ep_rank))]
