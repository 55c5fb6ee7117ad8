"""Expert-parallel process groups (mixture of experts) and their rank queries.

Megatron-Core's expert layout: over the same world, expert ranks are ordered expert-TP,
EP, expert-DP, PP, i.e. ``rank = etp_rank + ep_rank * ETP + edp_rank * ETP * EP
+ pp_rank * ETP * EP * EDP``. PP is outermost in both layouts, so a rank's pipeline stage is
the same for dense and expert layers; the TP x CP x DP ranks of a stage are re-cut into
ETP x EP x EDP. Expert-data-parallel ranks hold the same experts (their gradients are
reduced there); EP ranks hold different experts and exchange tokens.

The groups live in ``group_registry`` with the dense ones (so ``destroy_model_parallel`` forgets
them too); ``parallel_state.initialize_expert_parallel`` makes them, and ``parallel_state``
answers these queries under Megatron's names.
"""
import itertools
from typing import Dict, List

import torch.distributed as dist

from megatron.core.group_registry import GROUP_RANKS, GROUPS

_EXPERT_MODEL = "expert_model"
_EXPERT_TENSOR = "expert_tensor"
_EXPERT_DATA = EXPERT_DATA = "expert_data"  # optimizer_instances cuts these
_EXPERT_TENSOR_AND_MODEL = "expert_tensor_and_model"
_EXPERT_TENSOR_MODEL_PIPELINE = "expert_tensor_model_pipeline"

def expert_rank_layout(world_size: int, pipeline_model_parallel_size: int,
                       expert_model_parallel_size: int, expert_tensor_parallel_size: int
                       ) -> Dict[str, List[List[int]]]:
    """Every expert group of every kind as lists of global ranks (pure; no communication)."""
    pp, ep, etp = (pipeline_model_parallel_size, expert_model_parallel_size,
                   expert_tensor_parallel_size)
    check_expert_world_size(world_size, pp, ep, etp)
    edp = world_size // (etp * ep * pp)

    def rank(t, e, d, p):
        return t + e * etp + d * etp * ep + p * etp * ep * edp

    def every(*sizes):
        return itertools.product(*(range(n) for n in sizes))

    return {
        _EXPERT_TENSOR: sorted([rank(t, e, d, p) for t in range(etp)]
                               for e, d, p in every(ep, edp, pp)),
        _EXPERT_MODEL: sorted([rank(t, e, d, p) for e in range(ep)]
                              for t, d, p in every(etp, edp, pp)),
        _EXPERT_DATA: sorted([rank(t, e, d, p) for d in range(edp)]
                             for t, e, p in every(etp, ep, pp)),
        _EXPERT_TENSOR_AND_MODEL: sorted([rank(t, e, d, p) for e in range(ep) for t in range(etp)]
                                         for d, p in every(edp, pp)),
        _EXPERT_TENSOR_MODEL_PIPELINE: sorted(
            [rank(t, e, d, p) for p in range(pp) for e in range(ep) for t in range(etp)]
            for (d,) in every(edp)),
    }


def check_expert_world_size(world_size: int, pp: int, ep: int, etp: int) -> None:
    """ETP x EP must divide a pipeline stage's ranks (TP x CP x DP): a clear error otherwise."""
    if ep < 1 or etp < 1:
        raise ValueError(f"expert-model-parallel-size ({ep}) and expert-tensor-parallel-size "
                         f"({etp}) must be >= 1.")
    if world_size % pp != 0 or (world_size // pp) % (ep * etp) != 0:
        raise RuntimeError(
            f"expert-model-parallel-size {ep} x expert-tensor-parallel-size {etp} = {ep * etp} "
            f"does not divide the {world_size // max(pp, 1)} ranks of a pipeline stage "
            f"(tensor x context x data parallel = world size {world_size} / "
            f"pipeline-model-parallel-size {pp}); choose expert sizes whose product divides it.")


def expert_parallel_is_initialized() -> bool:
    return _EXPERT_MODEL in GROUPS


def _expert_ranks(kind: str) -> List[int]:
    if kind not in GROUPS:
        raise RuntimeError("expert parallel groups are not initialized; call "
                           "parallel_state.initialize_expert_parallel(...) (or pass "
                           "expert_model_parallel_size to initialize_model_parallel) first.")
    return GROUP_RANKS[kind]


def _expert_group(kind: str) -> dist.ProcessGroup:
    _expert_ranks(kind)
    return GROUPS[kind]


def get_expert_model_parallel_group() -> dist.ProcessGroup:
    """The EP ranks: each holds E / EP different experts; tokens are exchanged among them."""
    return _expert_group(_EXPERT_MODEL)


def get_expert_model_parallel_ranks() -> List[int]:
    return list(_expert_ranks(_EXPERT_MODEL))


def get_expert_model_parallel_world_size() -> int:
    return len(_expert_ranks(_EXPERT_MODEL))


def get_expert_model_parallel_rank() -> int:
    return _expert_ranks(_EXPERT_MODEL).index(dist.get_rank())


def get_expert_tensor_parallel_group() -> dist.ProcessGroup:
    """The ranks that split each expert's weights (the experts' own TP)."""
    return _expert_group(_EXPERT_TENSOR)


def get_expert_tensor_parallel_ranks() -> List[int]:
    return list(_expert_ranks(_EXPERT_TENSOR))


def get_expert_tensor_parallel_world_size() -> int:
    return len(_expert_ranks(_EXPERT_TENSOR))


def get_expert_tensor_parallel_rank() -> int:
    return _expert_ranks(_EXPERT_TENSOR).index(dist.get_rank())


def get_expert_data_parallel_group() -> dist.ProcessGroup:
    """The ranks holding the same expert shards: expert gradients are reduced over it."""
    return _expert_group(_EXPERT_DATA)


def get_expert_data_parallel_ranks() -> List[int]:
    return list(_expert_ranks(_EXPERT_DATA))


def get_expert_data_parallel_world_size() -> int:
    return len(_expert_ranks(_EXPERT_DATA))


def get_expert_data_parallel_rank() -> int:
    return _expert_ranks(_EXPERT_DATA).index(dist.get_rank())


def get_expert_tensor_and_model_parallel_group() -> dist.ProcessGroup:
    """ETP x EP ranks of one expert-data-parallel replica (all the experts of a layer once)."""
    return _expert_group(_EXPERT_TENSOR_AND_MODEL)


def get_expert_tensor_and_model_parallel_ranks() -> List[int]:
    return list(_expert_ranks(_EXPERT_TENSOR_AND_MODEL))


def get_expert_tensor_model_pipeline_parallel_group() -> dist.ProcessGroup:
    """ETP x EP x PP ranks of one expert-data-parallel replica: every expert weight of the
    model once (the expert part of the gradient norm is summed over it)."""
    return _expert_group(_EXPERT_TENSOR_MODEL_PIPELINE)


def get_expert_tensor_model_pipeline_parallel_ranks() -> List[int]:
    return list(_expert_ranks(_EXPERT_TENSOR_MODEL_PIPELINE))
