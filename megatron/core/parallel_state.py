"""Process groups for tensor, context, pipeline and data parallelism, and the rank queries.

Rank order is Megatron's: tensor-parallel ranks are adjacent, then context-parallel, then
data-parallel, then pipeline-parallel, i.e.
``global_rank = tp_rank + cp_rank * TP + dp_rank * TP * CP + pp_rank * TP * CP * DP``.
Adjacent ranks share a node, so the chattiest groups (TP, then CP's ring) stay on the fastest
links. CP ranks hold different parts of the same sequences and the same weights, so gradients
and the distributed optimizer work over the DP x CP group
(``get_data_parallel_group(with_context_parallel=True)``); data loading and the reported
losses over DP alone.
"""
import contextlib
import datetime
from typing import Dict, List, Optional

import torch.distributed as dist

from megatron.core import (
    device,
    expert_parallel_state,
    optimizer_instances,
    pipeline_placement,
)
# The process groups this rank belongs to, and the global ranks of each: shared with
# expert_parallel_state, so changed in place only, never rebound.
from megatron.core.group_registry import GROUP_RANKS as _GROUP_RANKS, GROUPS as _GROUPS
from megatron.core.rank_layout import (  # noqa: F401 - rank_layout: callers ask here too
    CONTEXT as _CONTEXT,
    DATA as _DATA,
    DATA_CONTEXT as _DATA_CONTEXT,
    DATA_CONTEXT_GLOO as _DATA_CONTEXT_GLOO,
    DATA_GLOO as _DATA_GLOO,
    EMBEDDING as _EMBEDDING,
    MODEL as _MODEL,
    PIPELINE as _PIPELINE,
    POSITION_EMBEDDING as _POSITION_EMBEDDING,
    TENSOR as _TENSOR,
    TENSOR_AND_CONTEXT as _TENSOR_AND_CONTEXT,
    TENSOR_AND_DATA as _TENSOR_AND_DATA,
    TENSOR_AND_DATA_CONTEXT as _TENSOR_AND_DATA_CONTEXT,
    rank_layout,
)
_OWNED_GROUPS: List[dist.ProcessGroup] = []

_VIRTUAL_PIPELINE_RANK: Optional[int] = None
_VIRTUAL_PIPELINE_WORLD_SIZE: Optional[int] = None
# Where the chunks' virtual stages lie (pipeline_placement.LOOP or V): set by the model builder.
_PIPELINE_PLACEMENT: str = pipeline_placement.LOOP
# Every group's collectives wait at most this long (Megatron's --distributed-timeout-minutes).
_TIMEOUT: Optional[datetime.timedelta] = None
# Every group of the layout by kind, for making the DP groups' gloo copies on first use.
_LAYOUT: Dict[str, List[List[int]]] = {}

def initialize_model_parallel(tensor_model_parallel_size: int = 1,
                              pipeline_model_parallel_size: int = 1,
                              virtual_pipeline_model_parallel_size: Optional[int] = None,
                              distributed_timeout_minutes: float = 10.0,
                              context_parallel_size: int = 1,
                              expert_model_parallel_size: Optional[int] = None,
                              expert_tensor_parallel_size: Optional[int] = None,
                              num_distributed_optimizer_instances: int = 1) -> None:
    """Create all process groups. Every rank must call this with the same arguments.
    ``distributed_timeout_minutes`` bounds how long any collective on them waits. With an
    expert size given, the expert groups are made too (initialize_expert_parallel). More than
    one optimizer instance (HSDP) adds the instances' groups (optimizer_instances.py)."""
    if not dist.is_initialized():
        raise RuntimeError(
            "initialize_model_parallel() needs torch.distributed: call "
            "torch.distributed.init_process_group(...) first (torchrun sets the environment)."
        )
    if model_parallel_is_initialized():
        raise RuntimeError("model parallel groups are already initialized; call "
                           "destroy_model_parallel() before initializing them again.")
    world_size = dist.get_world_size()
    tp, pp, cp = tensor_model_parallel_size, pipeline_model_parallel_size, context_parallel_size
    if tp < 1 or pp < 1 or cp < 1:
        raise ValueError(f"tensor ({tp}), pipeline ({pp}) and context ({cp}) parallel sizes "
                         f"must be >= 1.")
    check_world_size(world_size, tp, pp, cp)
    optimizer_instances.check_divides(world_size // (tp * pp),
                                      num_distributed_optimizer_instances,
                                      "the data-parallel x context-parallel ranks")
    with_experts = expert_model_parallel_size is not None or \
        expert_tensor_parallel_size is not None
    if with_experts:  # before any group exists, so a bad size costs no communication
        expert_parallel_state.check_expert_world_size(
            world_size, pp, expert_model_parallel_size or 1, expert_tensor_parallel_size or tp)
    if virtual_pipeline_model_parallel_size is not None:
        if pp < 2:
            raise RuntimeError(
                "virtual pipeline parallelism (interleaved schedule) needs "
                f"pipeline-model-parallel-size > 1, got {pp}; drop "
                "--num-layers-per-virtual-pipeline-stage or raise the pipeline size."
            )
        if virtual_pipeline_model_parallel_size < 1:
            raise ValueError("virtual pipeline model parallel size must be >= 1.")

    global _TIMEOUT
    _TIMEOUT = datetime.timedelta(minutes=distributed_timeout_minutes)
    # Ranks on middle pipeline stages belong to no embedding group.
    _GROUPS[_EMBEDDING], _GROUP_RANKS[_EMBEDDING] = None, []
    create_groups(rank_layout(world_size, tp, pp, cp))
    if num_distributed_optimizer_instances > 1:
        create_groups(optimizer_instances.instance_layout(
            _LAYOUT[_DATA_CONTEXT], num_distributed_optimizer_instances,
            optimizer_instances.DENSE_SHARD, optimizer_instances.DENSE_REPLICA))
    optimizer_instances.record_count(num_distributed_optimizer_instances)
    # The DP groups' gloo copies (get_data_parallel_group(with_gloo=True)) are made on first use.

    global _VIRTUAL_PIPELINE_RANK, _VIRTUAL_PIPELINE_WORLD_SIZE
    if virtual_pipeline_model_parallel_size is not None:
        _VIRTUAL_PIPELINE_RANK = 0
        _VIRTUAL_PIPELINE_WORLD_SIZE = virtual_pipeline_model_parallel_size
    if with_experts:
        initialize_expert_parallel(expert_model_parallel_size or 1, expert_tensor_parallel_size)


def initialize_expert_parallel(expert_model_parallel_size: int = 1,
                               expert_tensor_parallel_size: Optional[int] = None) -> None:
    """Create the expert groups (after initialize_model_parallel; every rank, same arguments).
    ``expert_tensor_parallel_size`` defaults to the tensor-parallel size, as in Megatron.
    Their layout and queries: expert_parallel_state."""
    if not model_parallel_is_initialized():
        raise RuntimeError("initialize_expert_parallel() needs the model parallel groups; call "
                           "parallel_state.initialize_model_parallel(...) first.")
    if expert_parallel_state.expert_parallel_is_initialized():
        raise RuntimeError("expert parallel groups are already initialized; call "
                           "destroy_model_parallel() before initializing them again.")
    etp = expert_tensor_parallel_size or get_tensor_model_parallel_world_size()
    layout = expert_parallel_state.expert_rank_layout(
        dist.get_world_size(), get_pipeline_model_parallel_world_size(),
        expert_model_parallel_size, etp)
    create_groups(layout)
    instances = optimizer_instances.num_instances()
    if instances > 1:  # HSDP: the expert-DP groups cut into the same instances
        create_groups(optimizer_instances.instance_layout(
            layout[expert_parallel_state.EXPERT_DATA], instances,
            optimizer_instances.EXPERT_SHARD, optimizer_instances.EXPERT_REPLICA))


def create_groups(layout: Dict[str, List[List[int]]]) -> None:
    """Make every group of ``layout`` (kind -> lists of global ranks; every rank, same layout:
    new_group's rule) and remember this rank's group of each kind."""
    _LAYOUT.update(layout)
    me = dist.get_rank()
    for kind, groups in layout.items():
        for ranks in groups:
            group = dist.new_group(ranks, timeout=_TIMEOUT)
            if me in ranks:
                _GROUPS[kind], _GROUP_RANKS[kind] = group, ranks
                _OWNED_GROUPS.append(group)


def check_world_size(world_size: int, tp: int, pp: int, cp: int = 1) -> None:
    """World size = TP x CP x DP x PP for a whole DP: a clear error otherwise."""
    if world_size % (tp * cp * pp) != 0:
        raise RuntimeError(
            f"world size {world_size} is not divisible by tensor-model-parallel-size {tp} x "
            f"context-parallel-size {cp} x pipeline-model-parallel-size {pp} = {tp * cp * pp}; "
            f"choose sizes whose product divides the number of processes.")


def model_parallel_is_initialized() -> bool:
    return _TENSOR in _GROUPS


def destroy_model_parallel() -> None:
    """Forget and destroy every group created by initialize_model_parallel()."""
    global _VIRTUAL_PIPELINE_RANK, _VIRTUAL_PIPELINE_WORLD_SIZE, _TIMEOUT, _PIPELINE_PLACEMENT
    if dist.is_initialized():
        for group in _OWNED_GROUPS:
            dist.destroy_process_group(group)
    _OWNED_GROUPS.clear()
    _LAYOUT.clear()
    _GROUPS.clear()
    _GROUP_RANKS.clear()
    _VIRTUAL_PIPELINE_RANK = None
    _VIRTUAL_PIPELINE_WORLD_SIZE = None
    _PIPELINE_PLACEMENT = pipeline_placement.LOOP
    _TIMEOUT = None


def get_distributed_timeout() -> datetime.timedelta:
    """How long a collective on the model-parallel groups may wait before it fails."""
    _group(_TENSOR)
    return _TIMEOUT


def _group(kind: str) -> dist.ProcessGroup:
    try:
        return _GROUPS[kind]
    except KeyError:
        raise RuntimeError(
            "model parallel groups are not initialized; call "
            "parallel_state.initialize_model_parallel(...) first."
        ) from None


def _ranks(kind: str) -> List[int]:
    _group(kind)
    return _GROUP_RANKS[kind]


def _rank_in(kind: str) -> int:
    return _ranks(kind).index(dist.get_rank())


# --- groups -------------------------------------------------------------------------------

def get_tensor_model_parallel_group() -> dist.ProcessGroup:
    return _group(_TENSOR)


def get_pipeline_model_parallel_group() -> dist.ProcessGroup:
    return _group(_PIPELINE)


def get_data_parallel_group(with_gloo: bool = False,
                            with_context_parallel: bool = False) -> dist.ProcessGroup:
    """The DP group (DP x CP with ``with_context_parallel``: the ranks that hold the same
    weights, over which gradients and the distributed optimizer work); ``with_gloo`` gives a
    gloo copy for CPU-side traffic (e.g. checkpoints).

    On nccl the gloo copies are made on first use (each holds sockets and threads on every
    member, a waste when nothing asks for them); making them is collective over the whole
    world, so every rank must ask the first time. On gloo the copy is the group itself."""
    kind = _DATA_CONTEXT if with_context_parallel else _DATA
    group = _group(kind)
    if not with_gloo:
        return group
    gloo_kind = _DATA_CONTEXT_GLOO if with_context_parallel else _DATA_GLOO
    if gloo_kind not in _GROUPS:
        _GROUPS[gloo_kind] = group
        if device.dist_backend() != "gloo":
            # Every rank creates every group's copy, in the same order (new_group's rule).
            for ranks in _LAYOUT[kind]:
                copy = dist.new_group(ranks, backend="gloo", timeout=_TIMEOUT)
                if dist.get_rank() in ranks:
                    _GROUPS[gloo_kind] = copy
                    _OWNED_GROUPS.append(copy)
        _GROUP_RANKS[gloo_kind] = _GROUP_RANKS[kind]
    return _GROUPS[gloo_kind]


def get_context_parallel_group() -> dist.ProcessGroup:
    """The CP ranks that share this rank's sequences (each holds 2 of their 2 x CP chunks)."""
    return _group(_CONTEXT)


def get_model_parallel_group() -> dist.ProcessGroup:
    """All TP x PP ranks that hold one replica of the model."""
    return _group(_MODEL)


def get_embedding_group() -> Optional[dist.ProcessGroup]:
    """First and last pipeline stage: they hold the two copies of a tied embedding.
    None on ranks of the middle stages."""
    return _group(_EMBEDDING)


def get_position_embedding_group() -> dist.ProcessGroup:
    return _group(_POSITION_EMBEDDING)


def get_tensor_and_data_parallel_group(with_context_parallel: bool = False
                                       ) -> dist.ProcessGroup:
    """TP x DP ranks of a pipeline stage (x CP with ``with_context_parallel``: every rank
    of the stage)."""
    return _group(_TENSOR_AND_DATA_CONTEXT if with_context_parallel else _TENSOR_AND_DATA)


def get_tensor_and_context_parallel_group() -> dist.ProcessGroup:
    """TP x CP ranks: together they hold one micro batch's whole sequences."""
    return _group(_TENSOR_AND_CONTEXT)


# --- global ranks of groups -------------------------------------------------------------------

def get_tensor_model_parallel_ranks() -> List[int]:
    return list(_ranks(_TENSOR))


def get_pipeline_model_parallel_ranks() -> List[int]:
    return list(_ranks(_PIPELINE))


def get_data_parallel_ranks(with_context_parallel: bool = False) -> List[int]:
    return list(_ranks(_DATA_CONTEXT if with_context_parallel else _DATA))


def get_context_parallel_ranks() -> List[int]:
    return list(_ranks(_CONTEXT))


def get_model_parallel_ranks() -> List[int]:
    return list(_ranks(_MODEL))


def get_embedding_ranks() -> List[int]:
    return list(_ranks(_EMBEDDING))


def get_tensor_model_parallel_src_rank() -> int:
    """Global rank of TP rank 0 in this rank's TP group (the source of broadcasts)."""
    return _ranks(_TENSOR)[0]


def get_pipeline_model_parallel_first_rank() -> int:
    return _ranks(_PIPELINE)[0]


def get_pipeline_model_parallel_last_rank() -> int:
    return _ranks(_PIPELINE)[-1]


def get_loss_logging_rank() -> int:
    """The global rank that prints the loss (Megatron's "last rank"): the highest global rank
    among those holding the last stage. Pipeline is the outermost dimension of the rank
    layout, so pipeline slice ``i`` is global ranks ``[i * W/PP, (i + 1) * W/PP)``; the last
    stage is on pipeline rank PP - 1, or 0 under the V placement."""
    pipeline = get_pipeline_model_parallel_world_size()
    stages = pipeline * (_VIRTUAL_PIPELINE_WORLD_SIZE or 1)
    holder, _ = pipeline_placement.stage_holder(stages - 1, pipeline,
                                                _VIRTUAL_PIPELINE_WORLD_SIZE,
                                                _PIPELINE_PLACEMENT)
    return (holder + 1) * (dist.get_world_size() // pipeline) - 1


def get_last_stage_rank() -> int:
    """Global rank, in this rank's pipeline group, of the stage holding the output layer: the
    last pipeline rank, or the first under the V placement."""
    pipeline = get_pipeline_model_parallel_world_size()
    stages = pipeline * (_VIRTUAL_PIPELINE_WORLD_SIZE or 1)
    holder, _ = pipeline_placement.stage_holder(stages - 1, pipeline,
                                                _VIRTUAL_PIPELINE_WORLD_SIZE,
                                                _PIPELINE_PLACEMENT)
    return _ranks(_PIPELINE)[holder]


def get_pipeline_model_parallel_next_rank() -> int:
    """Global rank of the next pipeline stage (wrapping around, as interleaving needs)."""
    ranks = _ranks(_PIPELINE)
    return ranks[(_rank_in(_PIPELINE) + 1) % len(ranks)]


def get_pipeline_model_parallel_prev_rank() -> int:
    ranks = _ranks(_PIPELINE)
    return ranks[(_rank_in(_PIPELINE) - 1) % len(ranks)]


# --- sizes and ranks --------------------------------------------------------------------------

def get_tensor_model_parallel_world_size() -> int:
    return len(_ranks(_TENSOR))


def get_tensor_model_parallel_rank() -> int:
    return _rank_in(_TENSOR)


def get_pipeline_model_parallel_world_size() -> int:
    return len(_ranks(_PIPELINE))


def get_pipeline_model_parallel_rank() -> int:
    return _rank_in(_PIPELINE)


def get_data_parallel_world_size(with_context_parallel: bool = False) -> int:
    return len(_ranks(_DATA_CONTEXT if with_context_parallel else _DATA))


def get_data_parallel_rank(with_context_parallel: bool = False) -> int:
    return _rank_in(_DATA_CONTEXT if with_context_parallel else _DATA)


def get_context_parallel_world_size() -> int:
    return len(_ranks(_CONTEXT))


def get_context_parallel_rank() -> int:
    return _rank_in(_CONTEXT)


def get_model_parallel_world_size() -> int:
    return len(_ranks(_MODEL))


def get_model_parallel_rank() -> int:
    return _rank_in(_MODEL)


# --- virtual pipeline stages ------------------------------------------------------------------

def get_virtual_pipeline_model_parallel_world_size() -> Optional[int]:
    return _VIRTUAL_PIPELINE_WORLD_SIZE


def get_virtual_pipeline_model_parallel_rank() -> Optional[int]:
    return _VIRTUAL_PIPELINE_RANK


def set_virtual_pipeline_model_parallel_rank(rank: int) -> None:
    """The schedule sets which model chunk runs next; stage queries below depend on it."""
    global _VIRTUAL_PIPELINE_RANK
    if _VIRTUAL_PIPELINE_WORLD_SIZE is None:
        raise RuntimeError("virtual pipeline parallelism is not enabled; pass "
                           "virtual_pipeline_model_parallel_size to initialize_model_parallel().")
    if not 0 <= rank < _VIRTUAL_PIPELINE_WORLD_SIZE:
        raise ValueError(f"virtual pipeline rank {rank} out of range "
                         f"[0, {_VIRTUAL_PIPELINE_WORLD_SIZE}).")
    _VIRTUAL_PIPELINE_RANK = rank


@contextlib.contextmanager
def in_model_chunk(chunk: int):
    """Stage queries answer for model chunk ``chunk`` inside the block (chunk 0 after it);
    without virtual stages only chunk 0 exists and nothing changes."""
    if _VIRTUAL_PIPELINE_WORLD_SIZE is None:
        if chunk != 0:
            raise ValueError(f"model chunk {chunk} without virtual pipeline stages.")
        yield
        return
    set_virtual_pipeline_model_parallel_rank(chunk)
    try:
        yield
    finally:
        set_virtual_pipeline_model_parallel_rank(0)


def set_pipeline_placement(placement: str) -> None:
    """Where the chunks' virtual stages lie (``pipeline_placement.LOOP`` or ``V``); the stage
    queries below answer for it. ``build_model_chunks`` sets it from the config's schedule."""
    global _PIPELINE_PLACEMENT
    chunks = _VIRTUAL_PIPELINE_WORLD_SIZE or 1
    # Validates the pair: the V needs exactly 2 chunks per rank.
    pipeline_placement.virtual_stage_of(0, 0, get_pipeline_model_parallel_world_size(), chunks,
                                        placement)
    _PIPELINE_PLACEMENT = placement


def get_pipeline_placement() -> str:
    return _PIPELINE_PLACEMENT


def get_virtual_pipeline_stage(chunk: Optional[int] = None) -> int:
    """The model slice (0 = embedding side) that model chunk ``chunk`` of this rank holds (the
    current chunk, see in_model_chunk, when None)."""
    if chunk is None:
        chunk = _VIRTUAL_PIPELINE_RANK or 0
    return pipeline_placement.virtual_stage_of(
        get_pipeline_model_parallel_rank(), chunk, get_pipeline_model_parallel_world_size(),
        _VIRTUAL_PIPELINE_WORLD_SIZE, _PIPELINE_PLACEMENT)


def _holds_stage(stage: int, ignore_virtual: bool) -> bool:
    """Whether this rank's current chunk (any of its chunks, with ``ignore_virtual``) holds
    virtual stage ``stage``."""
    if ignore_virtual:
        pipeline = get_pipeline_model_parallel_world_size()
        rank, _ = pipeline_placement.stage_holder(stage, pipeline, _VIRTUAL_PIPELINE_WORLD_SIZE,
                                                  _PIPELINE_PLACEMENT)
        return rank == get_pipeline_model_parallel_rank()
    return get_virtual_pipeline_stage() == stage


def is_pipeline_first_stage(ignore_virtual: bool = False) -> bool:
    """True on the stage that holds the input embedding (virtual stage 0: chunk 0 of PP rank
    0); with ``ignore_virtual``, on the rank that holds it in one of its chunks."""
    return _holds_stage(0, ignore_virtual)


def is_pipeline_last_stage(ignore_virtual: bool = False) -> bool:
    """True on the stage that holds the output layer (the last virtual stage: the last chunk
    of the last PP rank, or under the V chunk 1 of PP rank 0); with ``ignore_virtual``, on the
    rank that holds it in one of its chunks."""
    stages = get_pipeline_model_parallel_world_size() * (_VIRTUAL_PIPELINE_WORLD_SIZE or 1)
    return _holds_stage(stages - 1, ignore_virtual)


def is_rank_in_embedding_group(ignore_virtual: bool = False) -> bool:
    """True where this rank (and, unless ignored, its current virtual chunk) holds an embedding
    copy that takes part in the tied-embedding gradient sum."""
    if not _ranks(_EMBEDDING):
        return False
    return is_pipeline_first_stage(ignore_virtual) or is_pipeline_last_stage(ignore_virtual)


# --- expert parallelism: Megatron's callers ask this module for the expert groups too; the
# queries live in expert_parallel_state (reading group_registry, never this module) and are
# forwarded here (PEP 562).

def __getattr__(name: str):
    if name.startswith(("get_expert_", "expert_", "check_expert_")):
        if hasattr(expert_parallel_state, name):
            return getattr(expert_parallel_state, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
