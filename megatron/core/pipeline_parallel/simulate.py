"""Run every rank's schedule on paper: which messages each step sends and receives, whether
the ranks can ever deadlock, and when each step would start and end.

The executor in ``schedules.py`` posts, before each step, one batch holding the sends left over
from the previous step and the receive the step needs, and waits for the whole batch. This
module replays that on all ranks at once under the strictest transport (a send completes only
once its receive is posted), so a schedule that passes here cannot hang on gloo or nccl. It also
checks that every message lands in the receive meant for it, and yields a timeline (forward and
backward costs in arbitrary units) for drawing planned schedules.
"""
import functools
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

from megatron.core.pipeline_parallel.schedule_order import (
    BACKWARD,
    FORWARD,
    WEIGHT,
    ZERO_BUBBLE,
    Step,
    num_warmup_steps,
    schedule_order,
    virtual_stage,
)
from megatron.core.pipeline_parallel.zero_bubble_order import unit_cost_times

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
                  virtual_size: Optional[int] = None, schedule: Optional[str] = None
                  ) -> Tuple[Optional[Op], Optional[Op]]:
    """(what the step must receive before it runs, what it sends after), None where nothing:
    W steps, and under zbv the last rank's local hand-overs between its two chunks."""
    if step.kind == WEIGHT:
        return None, None
    if schedule == "zbv":
        return _v_messages(step, pipeline_size, rank)
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


def _v_messages(step: Step, pipeline_size: int, rank: int) -> Tuple[Optional[Op], Optional[Op]]:
    """zbv: chunk 0 passes activations to rank + 1, chunk 1 to rank - 1 (gradients the other
    way); the last rank hands chunk 0's output to its own chunk 1 (and chunk 1's input gradient
    to its own chunk 0), which is no message."""
    v = virtual_stage(step, pipeline_size, rank, "zbv")
    last = 2 * pipeline_size - 1

    def rank_of(stage):
        return stage if stage < pipeline_size else last - stage

    def op(send, stage, kind):
        peer = rank_of(stage if send else (stage - 1 if kind == ACTIVATION else stage + 1))
        return None if peer == rank else Op(send, peer, Message(kind, step.microbatch, stage))

    if step.kind == FORWARD:
        recv = op(False, v, ACTIVATION) if v > 0 else None
        send = op(True, v + 1, ACTIVATION) if v < last else None
    else:
        recv = op(False, v, GRADIENT) if v < last else None
        send = op(True, v - 1, GRADIENT) if v > 0 else None
    return recv, send


def is_first_stage(step: Step, pipeline_size: int, rank: int,
                   schedule: Optional[str] = None) -> bool:
    """Whether the step runs the embedding (virtual stage 0)."""
    return virtual_stage(step, pipeline_size, rank, schedule) == 0


def is_last_stage(step: Step, pipeline_size: int, rank: int, virtual_size: Optional[int] = None,
                  schedule: Optional[str] = None) -> bool:
    """Whether the step runs the output layer and the loss (the last virtual stage)."""
    chunks = 2 if schedule == "zbv" else (virtual_size or 1)
    return virtual_stage(step, pipeline_size, rank, schedule) == pipeline_size * chunks - 1


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
                       virtual_size: Optional[int] = None, forward_only: bool = False,
                       schedule: Optional[str] = None) -> List[Tuple[List[Op], List[Step]]]:
    """(round, unit) pairs: each round is posted and waited for before its unit runs, and
    holds the sends of the previous unit and the receives of this one. The last entry's unit
    is empty: it flushes the final sends. Activations go first within a round, so both sides
    of a pair of ranks post their ops in the same order."""
    order = schedule_order(pipeline_size, rank, num_microbatches, virtual_size, forward_only,
                           schedule)
    if schedule in ZERO_BUBBLE:
        return _zero_bubble_plan(pipeline_size, num_microbatches, forward_only, schedule)[rank]
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


@functools.lru_cache(maxsize=64)
def _zero_bubble_plan(pipeline_size: int, num_microbatches: int, forward_only: bool,
                      schedule: str):
    """One step per unit. A send sent in the round right after its step would, under a
    strict transport, hold the sender until the receiver posts its receive, which in these
    schedules is often several steps later (the receiver runs W's and other chunks first).
    So each send goes in the sender's first round that, timed with unit costs
    (``unit_cost_times``), completes no earlier than its receiver posts the receive: the
    sender waits no longer there than it would anyway, and the receiver finds the send
    posted. The replay checks the result."""
    p = pipeline_size
    orders = [schedule_order(p, r, num_microbatches, None, forward_only, schedule)
              for r in range(p)]
    last = 2 * p - 1 if schedule == "zbv" else p - 1
    starts = unit_cost_times(orders, lambda r, s: virtual_stage(s, p, r, schedule), last)
    recv_posted, messages = {}, []
    for r in range(p):
        for i, step in enumerate(orders[r]):
            recv, send = step_messages(step, p, r, None, schedule)
            messages.append((r, i, recv, send))
            if recv:  # round i is posted when step i-1 ends
                recv_posted[recv.message] = starts[r][i - 1] + 1 if i else 0
    rounds = [[[] for _ in range(len(orders[r]) + 1)] for r in range(p)]
    for r, i, recv, send in messages:
        if recv:
            rounds[r][i].append(recv)
        if send:
            wanted = recv_posted[send.message]
            j = next((j for j in range(i + 1, len(orders[r])) if starts[r][j] >= wanted),
                     len(orders[r]))
            rounds[r][j].append(send)
    return [[(_canonical(rounds[r][i]), [step]) for i, step in enumerate(orders[r])]
            + [(_canonical(rounds[r][-1]), [])] for r in range(p)]


def _canonical(ops: List[Op]) -> List[Op]:
    return sorted(ops, key=lambda op: op.message.kind != ACTIVATION)


def theoretical_bubble(pipeline_size: int, num_microbatches: int,
                       virtual_size: Optional[int] = None) -> float:
    """(p-1)/(v m + p-1): the idle share of the schedules with backward = 2 x forward (what
    ``simulate`` gives with those costs)."""
    p, v = pipeline_size, virtual_size or 1
    return (p - 1) / (v * num_microbatches + p - 1)


def zero_bubble_idle(pipeline_size: int, schedule: str, forward_cost: float = 1.0,
                     backward_cost: float = 1.0, weight_cost: float = 1.0) -> float:
    """Idle time of every rank (the last rank's end minus the rank's busy time) under a
    zero-bubble schedule, for F, B, W costs equal (what the tests check exactly).
    zb-h1: (p-1)(F+B-W) (Qi et al.), a third of 1F1B's (p-1)(F+B+W). zbv (costs of a half-size
    chunk): (p-1) F, the bound set by the last rank's first forward arriving only after
    p-1 chunk-forwards; the ZB-V order meets it exactly (checked for p up to 6)."""
    p = pipeline_size
    if schedule == "zb-h1":
        return (p - 1) * (forward_cost + backward_cost - weight_cost)
    if schedule == "zbv":
        return (p - 1) * forward_cost
    raise ValueError(f"no zero-bubble formula for schedule {schedule!r}.")


def theoretical_bubble_zero(pipeline_size: int, num_microbatches: int, schedule: str) -> float:
    """Idle share with F = B = W = 1: idle / (busy + idle) per rank."""
    chunks = 2 if schedule == "zbv" else 1
    idle = zero_bubble_idle(pipeline_size, schedule)
    return idle / (3 * chunks * num_microbatches + idle)


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
             backward_cost: float = 2.0, channels_by_kind: bool = True,
             weight_cost: float = 0.0, schedule: Optional[str] = None) -> Timeline:
    """Replay all ranks. ``channels_by_kind``: activations and gradients travel on separate
    channels (as the executor arranges); False models one ordered channel per pair of ranks.
    ``backward_cost`` is a B step's (the whole backward, or the input-gradient part under a
    zero-bubble schedule), ``weight_cost`` a W step's. Raises ScheduleDeadlock if the ranks
    would hang or a message would land in the wrong receive."""
    plans = [communication_plan(pipeline_size, r, num_microbatches, virtual_size, forward_only,
                                schedule) for r in range(pipeline_size)]
    costs = {FORWARD: forward_cost, BACKWARD: backward_cost, WEIGHT: weight_cost}
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
                    cost = costs[step.kind]
                    timeline.steps[rank].append((step, clock[rank], clock[rank] + cost))
                    clock[rank] += cost
        if not progressed:
            stuck = {r: position[r] for r in range(pipeline_size)
                     if position[r] < len(rounds[r])}
            raise ScheduleDeadlock(f"ranks stuck at rounds {stuck} (PP={pipeline_size}, "
                                   f"VPP={virtual_size}, microbatches={num_microbatches}, "
                                   f"schedule={schedule})")
    timeline.end_time = max(clock)
    return timeline
