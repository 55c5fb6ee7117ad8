"""HSDP: the data-parallel ranks cut into optimizer instances that each shard the whole
optimizer, replicated across instances (Megatron's ``--num-distributed-optimizer-instances``).

    initialize_model_parallel(..., num_distributed_optimizer_instances=2)

The DP x CP group (experts: the expert-DP group) of D ranks is split into N instances of
D / N consecutive ranks. Inside an instance the distributed optimizer (or FSDP2) shards as it
does over the whole group: reduce-scatter and all-gather run over the instance's ranks, which
in Megatron's rank order share a node when D / N x TP x CP divides the GPUs per node. Across
instances the reduced shards are all-reduced: rank j of every instance holds the same shard,
so the inter-instance group is the j-th rank of each. A multi-node job thus reduce-scatters
on the fast links and sends only 1 / (D / N) of the gradients across nodes, for N copies of
the optimizer state instead of one.

A rank's instance is the same for dense and expert groups: both cut a pipeline stage's ranks
into N contiguous blocks (dense rank in stage = tp + (cp + dp x CP) x TP; expert rank in stage
= etp + (ep + edp x EP) x ETP), so "instance 0" names one set of ranks for checkpoints and
norms. With one instance nothing is created: the shard group is the whole DP (expert-DP)
group and there is no replica group.
"""
from typing import Dict, List, Optional

import torch.distributed as dist

from megatron.core.group_registry import GROUP_RANKS, GROUPS

DENSE_SHARD = "data_with_context_intra_instance"
DENSE_REPLICA = "data_with_context_inter_instance"
EXPERT_SHARD = "expert_data_intra_instance"
EXPERT_REPLICA = "expert_data_inter_instance"
_WHOLE = {False: "data_with_context", True: "expert_data"}  # rank_layout / expert layout kinds
_COUNT = "num_distributed_optimizer_instances"  # GROUP_RANKS holds [N] under this key


def instance_layout(data_groups: List[List[int]], instances: int, shard_kind: str,
                    replica_kind: str) -> Dict[str, List[List[int]]]:
    """Each data-parallel group's instances (consecutive blocks) and replica groups (the j-th
    rank of every block); pure, no communication."""
    layout = {shard_kind: [], replica_kind: []}
    for ranks in data_groups:
        check_divides(len(ranks), instances, "the data-parallel x context-parallel ranks"
                      if shard_kind == DENSE_SHARD else "the expert-data-parallel ranks")
        size = len(ranks) // instances
        layout[shard_kind] += [ranks[i * size:(i + 1) * size] for i in range(instances)]
        layout[replica_kind] += [ranks[j::size] for j in range(size)]
    return layout


def check_divides(ranks: int, instances: int, what: str) -> None:
    if instances < 1 or ranks % instances != 0:
        raise ValueError(f"--num-distributed-optimizer-instances {instances} does not divide "
                         f"{what} ({ranks}); choose a divisor of it.")


def record_count(instances: int) -> None:
    GROUP_RANKS[_COUNT] = [instances]


def num_instances() -> int:
    return GROUP_RANKS.get(_COUNT, [1])[0]


def shard_group(expert: bool = False) -> dist.ProcessGroup:
    """The ranks sharding the optimizer together: this rank's instance."""
    if num_instances() == 1:
        return GROUPS[_WHOLE[expert]]
    return GROUPS[EXPERT_SHARD if expert else DENSE_SHARD]


def shard_ranks(expert: bool = False) -> List[int]:
    if num_instances() == 1:
        return list(GROUP_RANKS[_WHOLE[expert]])
    return list(GROUP_RANKS[EXPERT_SHARD if expert else DENSE_SHARD])


def shard_rank(expert: bool = False) -> int:
    """This rank's place among its instance's ranks (its shard)."""
    return shard_ranks(expert).index(dist.get_rank())


def replica_group(expert: bool = False) -> Optional[dist.ProcessGroup]:
    """The ranks holding the same shard in the other instances (None with one instance)."""
    if num_instances() == 1:
        return None
    return GROUPS[EXPERT_REPLICA if expert else DENSE_REPLICA]


def replica_ranks(expert: bool = False) -> List[int]:
    if num_instances() == 1:
        return [dist.get_rank()]
    return list(GROUP_RANKS[EXPERT_REPLICA if expert else DENSE_REPLICA])


def instance_rank() -> int:
    """Which instance this rank belongs to (0 with one instance): instance 0 alone counts
    the shards in the gradient norm and writes them to checkpoints."""
    if num_instances() == 1:
        return 0
    return GROUP_RANKS[DENSE_REPLICA].index(dist.get_rank())
