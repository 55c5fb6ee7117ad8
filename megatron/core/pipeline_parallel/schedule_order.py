"""The order of forward and backward steps on one pipeline rank, as a pure function.

The schedules in ``schedules.py`` execute exactly this order, so it can be tested, simulated
and drawn without processes. A step runs microbatch ``microbatch`` through the rank's model
chunk ``chunk`` (always 0 without virtual stages). Chunk ``c`` of rank ``r`` is virtual stage
``c * PP + r`` (under "zbv": r for chunk 0, 2 PP - 1 - r for chunk 1, a V): activations flow
from virtual stage v to v + 1, gradients from v to v - 1.

Schedules: "1f1b" and "interleaved" (F and B, B being the whole backward) and the zero-bubble
"zb-h1" and "zbv" (``zero_bubble_order.py``), whose B is the input gradient only and whose W
step runs the deferred weight gradient of one (chunk, microbatch). ``schedule=None`` is
Megatron's choice: interleaved with virtual stages, else 1F1B.
"""
from typing import List, Optional

from megatron.core.pipeline_parallel import zero_bubble_order
from megatron.core.pipeline_parallel.steps import BACKWARD, FORWARD, WEIGHT, Step

SCHEDULES = ("1f1b", "interleaved", "zb-h1", "zbv")
ZERO_BUBBLE = ("zb-h1", "zbv")


def check_schedule_settings(pipeline_size: int, num_microbatches: int,
                            virtual_size: Optional[int] = None,
                            schedule: Optional[str] = None) -> None:
    """Raise ValueError for a combination no schedule can run (before any communication)."""
    if pipeline_size < 1:
        raise ValueError(f"pipeline-model-parallel size must be >= 1, got {pipeline_size}.")
    if num_microbatches < 1:
        raise ValueError(f"the number of microbatches must be >= 1, got {num_microbatches}; "
                         f"make the global batch at least micro batch x data-parallel size.")
    if schedule is not None:
        _check_named_schedule(pipeline_size, num_microbatches, virtual_size, schedule)
        if schedule in ZERO_BUBBLE:
            return
    if virtual_size is None:
        return
    if virtual_size < 1:
        raise ValueError(f"virtual pipeline size must be >= 1, got {virtual_size}.")
    if pipeline_size < 2:
        raise ValueError("the interleaved schedule (virtual pipeline stages) needs "
                         "pipeline-model-parallel size >= 2; drop "
                         "--num-layers-per-virtual-pipeline-stage or raise the pipeline size.")
    if num_microbatches % pipeline_size != 0:
        raise ValueError(
            f"the interleaved schedule needs the number of microbatches ({num_microbatches}) "
            f"to be a multiple of the pipeline-model-parallel size ({pipeline_size}); "
            f"change the global batch size or micro batch size.")


def _check_named_schedule(pipeline_size: int, num_microbatches: int,
                          virtual_size: Optional[int], schedule: str) -> None:
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown pipeline schedule {schedule!r}; pick one of "
                         f"{', '.join(SCHEDULES)}.")
    if schedule in ("1f1b", "zb-h1") and virtual_size is not None:
        raise ValueError(f"the {schedule} schedule runs one model chunk per rank; drop "
                         f"--num-layers-per-virtual-pipeline-stage (virtual size "
                         f"{virtual_size}) or pick --pipeline-schedule interleaved or zbv.")
    if schedule == "interleaved" and virtual_size is None:
        raise ValueError("the interleaved schedule needs virtual pipeline stages; add "
                         "--num-layers-per-virtual-pipeline-stage or pick --pipeline-schedule "
                         "1f1b.")
    if schedule != "zbv":
        return
    if virtual_size not in (None, 2):
        raise ValueError(f"the zbv schedule places exactly 2 model chunks per rank in a V, "
                         f"not {virtual_size}; drop --num-layers-per-virtual-pipeline-stage "
                         f"(zbv sets the virtual size to 2) or pick --pipeline-schedule "
                         f"interleaved.")
    if pipeline_size < 2:
        raise ValueError("the zbv schedule needs pipeline-model-parallel size >= 2; raise "
                         "the pipeline size or pick --pipeline-schedule 1f1b.")
    needed = 2 * pipeline_size
    if num_microbatches < needed:
        raise ValueError(f"the zbv schedule needs at least 2 x pipeline size = {needed} "
                         f"microbatches, got {num_microbatches}; raise the global batch size "
                         f"(or lower the micro batch size), or pick --pipeline-schedule zb-h1.")


def resolve_schedule(virtual_size: Optional[int], schedule: Optional[str]) -> str:
    """The schedule that runs: ``schedule``, or Megatron's choice by the virtual size."""
    if schedule is not None:
        return schedule
    return "1f1b" if virtual_size is None else "interleaved"


def num_warmup_steps(pipeline_size: int, rank: int, num_microbatches: int,
                     virtual_size: Optional[int] = None, forward_only: bool = False) -> int:
    """Forward steps a rank runs before its first backward (Megatron's warmup counts)."""
    total = num_microbatches * (virtual_size or 1)
    if forward_only:
        return total
    if virtual_size is None:
        return min(pipeline_size - rank - 1, num_microbatches)
    if num_microbatches == pipeline_size:
        return total  # Megatron runs all forwards first in this case
    return min((pipeline_size - rank - 1) * 2 + (virtual_size - 1) * pipeline_size, total)


def _virtual_step(k: int, pipeline_size: int, virtual_size: int, forward: bool) -> Step:
    """The k-th forward (or backward) of an interleaved rank: groups of PP microbatches walk
    through the chunks (forward 0..V-1, backward V-1..0)."""
    in_group = k % (pipeline_size * virtual_size)
    chunk = in_group // pipeline_size
    if not forward:
        chunk = virtual_size - 1 - chunk
    microbatch = (k // (pipeline_size * virtual_size)) * pipeline_size + k % pipeline_size
    return Step(FORWARD if forward else BACKWARD, microbatch, chunk)


def schedule_order(pipeline_size: int, rank: int, num_microbatches: int,
                   virtual_size: Optional[int] = None, forward_only: bool = False,
                   schedule: Optional[str] = None) -> List[Step]:
    """Every step rank ``rank`` runs, in order. 1F1B and interleaved: warmup forwards, then
    one forward and one backward alternating, then the remaining backwards. The zero-bubble
    schedules: see ``zero_bubble_order``."""
    check_schedule_settings(pipeline_size, num_microbatches, virtual_size, schedule)
    if not 0 <= rank < pipeline_size:
        raise ValueError(f"pipeline rank {rank} out of range [0, {pipeline_size}).")
    if schedule in ZERO_BUBBLE:
        return zero_bubble_order.order(schedule, pipeline_size, rank, num_microbatches,
                                       forward_only)
    vsize = virtual_size or 1
    total = num_microbatches * vsize
    warmup = num_warmup_steps(pipeline_size, rank, num_microbatches, virtual_size, forward_only)

    def forward(k):
        return _virtual_step(k, pipeline_size, vsize, True)

    def backward(k):
        return _virtual_step(k, pipeline_size, vsize, False)

    order = [forward(k) for k in range(warmup)]
    if forward_only:
        return order
    for k in range(total - warmup):
        order += [forward(warmup + k), backward(k)]
    order += [backward(k) for k in range(total - warmup, total)]
    return order


def virtual_stage(step: Step, pipeline_size: int, rank: int,
                  schedule: Optional[str] = None) -> int:
    """The stage of the whole model ``step`` runs on (0 = the embedding)."""
    if schedule == "zbv":
        return rank if step.chunk == 0 else 2 * pipeline_size - 1 - rank
    return step.chunk * pipeline_size + rank


def max_in_flight(order: List[Step]) -> int:
    """Most forwards whose activations are alive at any point (activation memory): held until
    the backward, or until the W step in an order that has W steps."""
    release = WEIGHT if any(step.kind == WEIGHT for step in order) else BACKWARD
    live = peak = 0
    for step in order:
        live += (step.kind == FORWARD) - (step.kind == release)
        peak = max(peak, live)
    return peak
