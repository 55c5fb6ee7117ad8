"""Run every rank's schedule on paper: which messages each step sends and receives, whether
the ranks can ever deadlock, and when each step would start and end.

The executor in ``schedules.py`` posts, before each step, one batch holding the sends left over
from the previous step and the receive the step needs, and waits for the whole batch. This
module replays that on all ranks at once under the strictest transport (a send completes only
once its receive is posted), so a schedule that passes here cannot hang on gloo or nccl. It also
checks that every message lands in the receive meant for it, and yields a timeline (forward and
backward costs in arbitrary units) for drawing planned schedules.
"""
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

from megatron.core.pipeline_parallel.schedule_order import (
    FORWARD,
    Step,
    num_warmup_steps,
    schedule_order,
    virtual_stage,
)

ACTIVATION, GRADIENT = "activation", "gradient"


@dataclass(frozen=True)
class Message:
    """One tensor between neighbouring ranks, named by what it is for."""
    kind: str  # ACTIVATION (to the next stage) or GRADIENT (to the previous stage)
    microbatch: int
    to_virtual_stage: int


@dataclass(frozen=True)
class Op:
    send: bool
    peer: int  # pipeline rank
    message: Message


def step_messages(step: Step, pipeline_size: int, rank: int,
                  virtual_size: Optional[int] = None) -> Tuple[Optional[Op], Optional[Op]]:
    """(what the step must receive before it runs, what it sends after), None where nothing."""
    v = virtual_stage(step, pipeline_size, rank)
    last = pipeline_size * (virtual_size or 1) - 1
    nxt, prev = (rank + 1) % pipeline_size, (rank - 1) % pipeline_size
    if step.kind == FORWARD:
        recv = Op(False, prev, Message(ACTIVATION, step.microbatch, v)) if v > 0 else None
        send = Op(True, nxt, Message(ACTIVATION, step.microbatch, v + 1)) if v < last else None
    else:
        recv = Op(False, nxt, Message(GRADIENT, step.microbatch, v)) if v < last else None
        send = Op(True, prev, Message(GRADIENT, step.microbatch, v - 1)) if v > 0 else None
    return recv, send


def step_units(order: List[Step], warmup: int, paired: bool) -> List[List[Step]]:
    """Groups of steps that run between two communication rounds. Unpaired, every step is
    its own unit (1F1B). Paired, each steady-state forward runs together with the backward
    after it, so one round serves both (Megatron's interleaved schedule; with one round per
    step the interleaved order would deadlock)."""
    num_backward = sum(step.kind != FORWARD for step in order)
    steady_end = warmup + 2 * (len(order) - warmup - num_backward)
    units = [[step] for step in order[:warmup]]
    if paired:
        units += [order[i:i + 2] for i in range(warmup, steady_end, 2)]
    else:
        units += [[step] for step in order[warmup:steady_end]]
    return units + [[step] for step in order[steady_end:]]


def communication_plan(pipeline_size: int, rank: int, num_microbatches: int,
                       virtual_size: Optional[int] = None, forward_only: bool = False
                       ) -> List[Tuple[List[Op], List[Step]]]:
    """(round, unit) pairs: each round is posted and waited for before its unit runs, and
    holds the sends of the previous unit and the receives of this one. The last entry's unit
    is empty: it flushes the final sends. Activations go first within a round, so both sides
    of a pair of ranks post their ops in the same order."""
    order = schedule_order(pipeline_size, rank, num_microbatches, virtual_size, forward_only)
    warmup = num_warmup_steps(pipeline_size, rank, num_microbatches, virtual_size, forward_only)
    plan, pending = [], []
    for unit in step_units(order, warmup, paired=virtual_size is not None):
        recvs, sends = [], []
        for step in unit:
            recv, send = step_messages(step, pipeline_size, rank, virtual_size)
            recvs += [recv] if recv else []
            sends += [send] if send else []
        plan.append((_canonical(pending + recvs), unit))
        pending = sends
    plan.append((_canonical(pending), []))
    return plan


def _canonical(ops: List[Op]) -> List[Op]:
    return sorted(ops, key=lambda op: op.message.kind != ACTIVATION)


def theoretical_bubble(pipeline_size: int, num_microbatches: int,
                       virtual_size: Optional[int] = None) -> float:
    """(p-1)/(v m + p-1): the idle share of the schedules with backward = 2 x forward (what
    ``simulate`` gives with those costs)."""
    p, v = pipeline_size, virtual_size or 1
    return (p - 1) / (v * num_microbatches + p - 1)


class ScheduleDeadlock(RuntimeError):
    pass


@dataclass
class Timeline:
    """Per rank: (step, start, end) in simulated time; ``end_time`` when the last rank ends."""
    steps: Dict[int, List[Tuple[Step, float, float]]] = field(default_factory=dict)
    end_time: float = 0.0

    def bubble_fraction(self) -> float:
        """Idle share of the ranks' time from the start to the last rank's end."""
        busy = sum(end - start for events in self.steps.values() for _, start, end in events)
        return 1.0 - busy / (self.end_time * len(self.steps))


def simulate(pipeline_size: int, num_microbatches: int, virtual_size: Optional[int] = None,
             forward_only: bool = False, forward_cost: float = 1.0,
             backward_cost: float = 2.0, channels_by_kind: bool = True) -> Timeline:
    """Replay all ranks. ``channels_by_kind``: activations and gradients travel on separate
    channels (as the executor arranges); False models one ordered channel per pair of ranks.
    Raises ScheduleDeadlock if the ranks would hang or a message would land in the wrong
    receive."""
    plans = [communication_plan(pipeline_size, r, num_microbatches, virtual_size, forward_only)
             for r in range(pipeline_size)]
    rounds = [[ops for ops, _ in plan] for plan in plans]
    # channel -> posted sends / receives as (post time, message), in posting order
    sends: Dict[tuple, list] = {}
    recvs: Dict[tuple, list] = {}
    posted_index: Dict[tuple, int] = {}  # (rank, round, op index) -> position in its channel
    clock = [0.0] * pipeline_size
    position = [0] * pipeline_size  # next round to complete
    timeline = Timeline(steps={r: [] for r in range(pipeline_size)})

    def channel(src, dst, message):
        return (src, dst, message.kind) if channels_by_kind else (src, dst)

    def post(rank, i):
        for j, op in enumerate(rounds[rank][i]):
            src, dst = (rank, op.peer) if op.send else (op.peer, rank)
            queue = (sends if op.send else recvs).setdefault(channel(src, dst, op.message), [])
            posted_index[(rank, i, j)] = len(queue)
            queue.append((clock[rank], op.message))

    def completion_time(rank, i):
        """When round i of ``rank`` completes, or None while a counterpart is not posted."""
        done = clock[rank]
        for j, op in enumerate(rounds[rank][i]):
            src, dst = (rank, op.peer) if op.send else (op.peer, rank)
            other = (recvs if op.send else sends).get(channel(src, dst, op.message), [])
            k = posted_index[(rank, i, j)]
            if k >= len(other):
                return None
            their_time, their_message = other[k]
            if their_message != op.message:
                raise ScheduleDeadlock(
                    f"rank {rank} round {i}: {op} would be matched with {their_message}")
            done = max(done, their_time)
        return done

    posted = [False] * pipeline_size
    while any(position[r] < len(rounds[r]) for r in range(pipeline_size)):
        progressed = False
        for rank in range(pipeline_size):
            while position[rank] < len(rounds[rank]):
                i = position[rank]
                if not posted[rank]:
                    post(rank, i)
                    posted[rank] = True
                done = completion_time(rank, i)
                if done is None:
                    break
                clock[rank] = done
                position[rank], posted[rank], progressed = i + 1, False, True
                for step in plans[rank][i][1]:
                    cost = forward_cost if step.kind == FORWARD else backward_cost
                    timeline.steps[rank].append((step, clock[rank], clock[rank] + cost))
                    clock[rank] += cost
        if not progressed:
            stuck = {r: position[r] for r in range(pipeline_size)
                     if position[r] < len(rounds[r])}
            raise ScheduleDeadlock(f"ranks stuck at rounds {stuck} (PP={pipeline_size}, "
                                   f"VPP={virtual_size}, microbatches={num_microbatches})")
    timeline.end_time = max(clock)
    return timeline
