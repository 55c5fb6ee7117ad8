"""The zero-bubble orders (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024, and
"Pipeline Parallelism with Controllable Memory", 2024) as pure functions.

Each backward is split into B (the input gradient, on the critical path: it is sent upstream
at once) and W (the weight gradient, which nothing downstream waits for, so it can be deferred
into what would otherwise be a bubble). A microbatch's activations stay alive from its F until
its W.

- ``zb-h1``: 1F1B's F/B order on one chunk per rank; rank r runs W(k) right after B(k + r)
  instead of after B(k), so the downstream ranks run their B's earlier and the upstream ranks'
  cooldown waits fill with W's. At most p forwards wait for their W on any rank (1F1B's peak).
- ``zbv``: two chunks per rank placed in a V: rank r holds virtual stage r (chunk 0) and
  2p-1-r (chunk 1), so the first and the last stage (the loss) are both on rank 0 and the
  last rank hands chunk 0's output to its own chunk 1. The order comes from a deterministic
  greedy list scheduler over unit costs (the ZB papers' heuristic): B first when ready, else F
  when ready and the memory allows (at most 2p chunk-forwards waiting for their W, 1F1B's p
  microbatches of two half-size chunks), else the oldest W.
"""
import functools
from typing import List, Tuple

from megatron.core import pipeline_placement
from megatron.core.pipeline_parallel.schedule_order import (
    BACKWARD,
    FORWARD,
    WEIGHT,
    Step,
)
from megatron.core.pipeline_placement import V_CHUNKS, V

ZB_H1, ZBV = "zb-h1", "zbv"


def zbv_stage(pipeline_size: int, rank: int, chunk: int) -> int:
    """Virtual stage of ``chunk`` on ``rank`` in the V: r for chunk 0, 2p-1-r for chunk 1."""
    return pipeline_placement.virtual_stage_of(rank, chunk, pipeline_size, V_CHUNKS, V)


def zbv_placement(pipeline_size: int, stage: int) -> Tuple[int, int]:
    """(rank, chunk) holding virtual ``stage`` in the V."""
    return pipeline_placement.stage_holder(stage, pipeline_size, V_CHUNKS, V)


def zbv_min_microbatches(pipeline_size: int) -> int:
    """Fewest microbatches zbv accepts: with fewer than 2p no rank's memory fills, so the
    schedule would be a plain V (the order would still be correct, its bubble not zero-ish)."""
    return 2 * pipeline_size


def zb_h1_order(pipeline_size: int, rank: int, num_microbatches: int) -> List[Step]:
    """1F1B's forwards and backwards (warmup p-1-r forwards, then F/B alternating), each
    B(k) followed by W(k - r); the W's left run after the last B."""
    p, m = pipeline_size, num_microbatches
    warmup = min(p - 1 - rank, m)
    order = [Step(FORWARD, k) for k in range(warmup)]
    next_weight = 0

    def backward(k):
        nonlocal next_weight
        steps = [Step(BACKWARD, k)]
        if k - rank >= 0:
            steps.append(Step(WEIGHT, k - rank))
            next_weight = k - rank + 1
        return steps

    for k in range(m - warmup):
        order += [Step(FORWARD, warmup + k)] + backward(k)
    for k in range(m - warmup, m):
        order += backward(k)
    return order + [Step(WEIGHT, k) for k in range(next_weight, m)]


@functools.lru_cache(maxsize=64)
def zbv_orders(pipeline_size: int, num_microbatches: int) -> Tuple[Tuple[Step, ...], ...]:
    """Every rank's zbv order, from a greedy list scheduler run over all ranks at once with
    unit costs (one time unit per F, B or W of a half-size chunk)."""
    return tuple(tuple(order) for order in _GreedyV(pipeline_size, num_microbatches).run())


class _GreedyV:
    """Unit-time list scheduling of the V. A step that ends at time t may feed one that starts
    at t (messages take no time here; ``simulate`` replays the result under real rounds)."""

    def __init__(self, pipeline_size: int, num_microbatches: int):
        self.p, self.m = pipeline_size, num_microbatches
        self.limit = 2 * pipeline_size
        self.f_done = {}  # (stage, microbatch) -> end time of its F
        self.b_done = {}
        self.next_f = [[0, 0] for _ in range(self.p)]  # rank -> chunk -> next microbatch
        self.next_b = [[0, 0] for _ in range(self.p)]
        self.pending_w = [[] for _ in range(self.p)]  # rank -> [(chunk, microbatch)] FIFO
        self.live = [0] * self.p  # chunk-forwards whose W has not run
        self.orders = [[] for _ in range(self.p)]

    def run(self) -> List[List[Step]]:
        total = 6 * self.m  # F, B, W of two chunks per microbatch
        t = 0
        while any(len(order) < total for order in self.orders):
            started = [self._pick(rank, t) for rank in range(self.p)]
            for rank, step in enumerate(started):
                if step is not None:
                    self._start(rank, step, t)
            t += 1
            if t > 100 * total:
                raise AssertionError("zbv greedy scheduler made no progress")
        return self.orders

    def _ready_f(self, rank, chunk, t):
        k = self.next_f[rank][chunk]
        stage = zbv_stage(self.p, rank, chunk)
        if k >= self.m:
            return False
        return stage == 0 or self.f_done.get((stage - 1, k), t + 1) <= t

    def _ready_b(self, rank, chunk, t):
        k = self.next_b[rank][chunk]
        stage = zbv_stage(self.p, rank, chunk)
        if k >= self.m or self.f_done.get((stage, k), t + 1) > t:
            return False
        return stage == 2 * self.p - 1 or self.b_done.get((stage + 1, k), t + 1) <= t

    def _pick(self, rank, t):
        # B first (chunk 0 before chunk 1: it finishes a microbatch, and of the orders tried
        # this one meets the idle bound p-1 most often), then F (chunk 1 first: it is closer
        # to the loss; chunk 0 first can fill the memory with no B left to run), then the
        # oldest W.
        for chunk in (0, 1):
            if self._ready_b(rank, chunk, t):
                return Step(BACKWARD, self.next_b[rank][chunk], chunk)
        if self.live[rank] < self.limit:
            for chunk in (1, 0):
                if self._ready_f(rank, chunk, t):
                    return Step(FORWARD, self.next_f[rank][chunk], chunk)
        if self.pending_w[rank]:
            chunk, k = self.pending_w[rank][0]
            return Step(WEIGHT, k, chunk)
        return None

    def _start(self, rank, step, t):
        stage = zbv_stage(self.p, rank, step.chunk)
        self.orders[rank].append(step)
        if step.kind == FORWARD:
            self.f_done[(stage, step.microbatch)] = t + 1
            self.next_f[rank][step.chunk] += 1
            self.live[rank] += 1
        elif step.kind == BACKWARD:
            self.b_done[(stage, step.microbatch)] = t + 1
            self.next_b[rank][step.chunk] += 1
            self.pending_w[rank].append((step.chunk, step.microbatch))
        else:
            self.pending_w[rank].pop(0)
            self.live[rank] -= 1


def zbv_forward_only_order(num_microbatches: int) -> List[Step]:
    """Evaluation: every chunk-0 forward, then every chunk-1 forward (no memory to bound)."""
    return [Step(FORWARD, k, c) for c in (0, 1) for k in range(num_microbatches)]


def order(schedule: str, pipeline_size: int, rank: int, num_microbatches: int,
          forward_only: bool = False) -> List[Step]:
    """Rank ``rank``'s steps under ``schedule`` (settings already checked)."""
    if schedule == ZB_H1:
        if forward_only:
            return [Step(FORWARD, k) for k in range(num_microbatches)]
        return zb_h1_order(pipeline_size, rank, num_microbatches)
    if forward_only:
        return zbv_forward_only_order(num_microbatches)
    return list(zbv_orders(pipeline_size, num_microbatches)[rank])


def unit_cost_times(orders: List[List[Step]], stage_of, last_stage: int) -> List[List[int]]:
    """Start time of every step of every rank when each step takes one time unit and waits
    only for what it needs (the F before it in the model, the B after it, or for the last
    stage its own F); ``stage_of(rank, step)`` gives a step's virtual stage. The plan uses it
    to post each send when its receiver will be waiting for it."""
    ends, starts = {}, [[] for _ in orders]
    clock, position = [0] * len(orders), [0] * len(orders)
    progressed = True
    while progressed:
        progressed = False
        for rank, order in enumerate(orders):
            while position[rank] < len(order):
                step = order[position[rank]]
                stage = stage_of(rank, step)
                need = _dependency(step, stage, last_stage)
                if need is not None and need not in ends:
                    break
                start = max(clock[rank], ends[need] if need is not None else 0)
                starts[rank].append(start)
                clock[rank] = start + 1
                if step.kind != WEIGHT:
                    ends[(step.kind, stage, step.microbatch)] = start + 1
                position[rank] += 1
                progressed = True
    if any(p < len(order) for p, order in zip(position, orders)):
        raise AssertionError(f"orders cannot run: ranks stuck at steps {position}")
    return starts


def _dependency(step: Step, stage: int, last_stage: int):
    if step.kind == FORWARD:
        return (FORWARD, stage - 1, step.microbatch) if stage > 0 else None
    if step.kind == BACKWARD:
        if stage == last_stage:
            return FORWARD, stage, step.microbatch
        return BACKWARD, stage + 1, step.microbatch
    return BACKWARD, stage, step.microbatch
