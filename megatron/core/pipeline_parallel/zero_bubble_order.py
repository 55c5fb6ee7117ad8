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
  last rank hands chunk 0's output to its own chunk 1. The order is the paper's handcrafted
  ZB-V pattern (``zbv_order``): at most 2p chunk-forwards wait for their W, 1F1B's p
  microbatches of two half-size chunks.
"""
from typing import List, Tuple

from megatron.core import pipeline_placement
from megatron.core.pipeline_parallel.steps import BACKWARD, FORWARD, WEIGHT, Step
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


def zbv_order(pipeline_size: int, rank: int, num_microbatches: int) -> List[Step]:
    """Rank ``rank``'s ZB-V order: the handcrafted pattern of Qi et al. (ICLR 2024, section 6),
    in three phases. c0/c1 are the rank's chunks (virtual stages r and 2p-1-r).

    - warmup: 2(p-r)-1 chunk-0 forwards (they fill the V's descending arm), r pairs
      (F c1, F c0), then p-r triples (F c1, B c1, W c1) as the first gradients come back;
    - steady state: (F c0 while any remain), B c0, W c0, F c1, B c1, W c1; W runs right after
      its B because there is no bubble left to fill;
    - cooldown: r pairs (B c0, B c1) with their W's deferred into the drain's bubbles, then
      p-r pairs (B c0, oldest deferred W c0), then the deferred W's, chunk 1's first.

    At most 2p chunk-forwards wait for their W (1F1B's p microbatches of two half-size
    chunks); with equal F, B, W every rank idles (p-1) F, for every p (see the tests). Under
    unequal costs (W < F < B, as measured) it keeps the steady state dense, where a greedy
    list scheduler defers W's and lets the ranks drift apart."""
    p, r, m = pipeline_size, rank, num_microbatches
    order: List[Step] = []
    done = {(FORWARD, 0): 0, (FORWARD, 1): 0, (BACKWARD, 0): 0, (BACKWARD, 1): 0,
            (WEIGHT, 0): 0, (WEIGHT, 1): 0}

    def run(kind, chunk):
        order.append(Step(kind, done[(kind, chunk)], chunk))
        done[(kind, chunk)] += 1

    for _ in range(2 * (p - r) - 1):
        run(FORWARD, 0)
    for _ in range(r):
        run(FORWARD, 1)
        run(FORWARD, 0)
    for _ in range(p - r):
        for kind in (FORWARD, BACKWARD, WEIGHT):
            run(kind, 1)
    while done[(FORWARD, 0)] < m or done[(FORWARD, 1)] < done[(FORWARD, 0)]:
        if done[(FORWARD, 0)] < m:
            run(FORWARD, 0)
        run(BACKWARD, 0)
        run(WEIGHT, 0)
        for kind in (FORWARD, BACKWARD, WEIGHT):
            run(kind, 1)
    for _ in range(r):
        run(BACKWARD, 0)
        run(BACKWARD, 1)
    for _ in range(p - r):
        run(BACKWARD, 0)
        run(WEIGHT, 0)
    for chunk in (1, 0):
        while done[(WEIGHT, chunk)] < m:
            run(WEIGHT, chunk)
    return order


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
    return zbv_order(pipeline_size, rank, num_microbatches)


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
