"""Where each virtual pipeline stage lives: the one mapping (pure, no torch) that layer
assignment, the first/last-stage queries and the schedules share.

Two placements of the ``PP x V`` virtual stages (model slices, in model order):

- ``"loop"`` (1F1B, interleaved 1F1B, ZB-H1): chunk ``c`` of rank ``r`` is stage ``c * PP + r``;
  activations go round the ranks ``V`` times.
- ``"v"`` (the V-shaped zero-bubble schedules, 2 chunks per rank): chunk 0 of rank ``r`` is
  stage ``r``, chunk 1 is stage ``2 * PP - 1 - r``; activations go down the ranks and back up,
  so rank 0 holds both the first stage (embedding) and the last (output layer and loss), and
  rank ``PP - 1`` hands its chunk 0's output to its own chunk 1.
"""
from typing import Optional, Tuple

LOOP = "loop"
V = "v"
PLACEMENTS = (LOOP, V)
# Schedules whose chunks sit in a V; every other schedule uses the loop.
V_SCHEDULES = ("zbv",)
V_CHUNKS = 2


def placement_for_schedule(schedule: Optional[str]) -> str:
    """The placement a pipeline schedule (``--pipeline-schedule``; None = 1F1B/interleaved)
    runs its chunks in."""
    return V if schedule in V_SCHEDULES else LOOP


def _check(placement: str, pipeline_size: int, chunks: int) -> None:
    if placement not in PLACEMENTS:
        raise ValueError(f"pipeline placement {placement!r} is not one of {PLACEMENTS}.")
    if placement == V and chunks != V_CHUNKS:
        raise ValueError(f"the V placement holds {V_CHUNKS} model chunks per pipeline rank, "
                         f"not {chunks}.")
    if pipeline_size < 1:
        raise ValueError(f"pipeline size must be >= 1, got {pipeline_size}.")


def virtual_stage_of(rank: int, chunk: int, pipeline_size: int,
                     chunks: Optional[int] = None, placement: str = LOOP) -> int:
    """The model slice (0 = embedding side) that chunk ``chunk`` of pipeline rank ``rank``
    holds, with ``chunks`` model chunks per rank (None: one)."""
    chunks = chunks or 1
    _check(placement, pipeline_size, chunks)
    if not (0 <= rank < pipeline_size and 0 <= chunk < chunks):
        raise ValueError(f"(rank {rank}, chunk {chunk}) is outside a pipeline of "
                         f"{pipeline_size} ranks x {chunks} chunks.")
    if placement == V and chunk == 1:
        return 2 * pipeline_size - 1 - rank
    return chunk * pipeline_size + rank


def stage_holder(stage: int, pipeline_size: int, chunks: Optional[int] = None,
                 placement: str = LOOP) -> Tuple[int, int]:
    """(rank, chunk) that holds virtual stage ``stage``: the inverse of virtual_stage_of."""
    chunks = chunks or 1
    _check(placement, pipeline_size, chunks)
    if not 0 <= stage < pipeline_size * chunks:
        raise ValueError(f"virtual stage {stage} outside [0, {pipeline_size * chunks}).")
    chunk, rank = divmod(stage, pipeline_size)
    if placement == V and chunk == 1:
        rank = pipeline_size - 1 - rank
    return rank, chunk
