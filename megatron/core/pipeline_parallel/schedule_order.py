"""The order of forward and backward steps on one pipeline rank, as a pure function.

The schedules in ``schedules.py`` execute exactly this order, so it can be tested, simulated
and drawn without processes. A step runs microbatch ``microbatch`` through the rank's model
chunk ``chunk`` (always 0 without virtual stages). Chunk ``c`` of rank ``r`` is virtual stage
``c * PP + r``: activations flow from virtual stage v to v + 1, gradients from v to v - 1.
"""
from dataclasses import dataclass
from typing import List, Optional

FORWARD, BACKWARD = "F", "B"


@dataclass(frozen=True)
class Step:
    kind: str  # FORWARD or BACKWARD
    microbatch: int
    chunk: int = 0


def check_schedule_settings(pipeline_size: int, num_microbatches: int,
                            virtual_size: Optional[int] = None) -> None:
    """Raise ValueError for a combination no schedule can run (before any communication)."""
    if pipeline_size < 1:
        raise ValueError(f"pipeline-model-parallel size must be >= 1, got {pipeline_size}.")
    if num_microbatches < 1:
        raise ValueError(f"the number of microbatches must be >= 1, got {num_microbatches}; "
                         f"make the global batch at least micro batch x data-parallel size.")
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
                   virtual_size: Optional[int] = None, forward_only: bool = False) -> List[Step]:
    """Every step rank ``rank`` runs, in order: warmup forwards, then one forward and one
    backward alternating (1F1B), then the remaining backwards."""
    check_schedule_settings(pipeline_size, num_microbatches, virtual_size)
    if not 0 <= rank < pipeline_size:
        raise ValueError(f"pipeline rank {rank} out of range [0, {pipeline_size}).")
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


def virtual_stage(step: Step, pipeline_size: int, rank: int) -> int:
    return step.chunk * pipeline_size + rank


def max_in_flight(order: List[Step]) -> int:
    """Most forwards whose backward has not yet run, at any point (activation memory)."""
    live = peak = 0
    for step in order:
        live += 1 if step.kind == FORWARD else -1
        peak = max(peak, live)
    return peak
