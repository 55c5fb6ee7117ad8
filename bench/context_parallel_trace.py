"""Timelines of context-parallel attention for bench/context_parallel.py, recorded by wrapping
the library's functions from outside (the library is not changed).

Ring (p2p): every batched isend/irecv post, every block's compute (start, end), every wait
(start, return, and whether the transfer had already completed when the wait began), and the
spans of ring_forward / ring_backward (which phase an event belongs to). All-gather: the time
inside its all_gather_into_tensor / reduce_scatter_tensor calls (blocking, so never hidden).

Overlap of one exchange: its window is post .. wait return; the hidden part is the part of the
window during which a block was being computed on this rank. Exposed: time blocked in wait.
"""
import contextlib
import time
from dataclasses import dataclass, field
from typing import List, Optional, Tuple

from megatron.core.transformer.context_parallel import all_gather as cp_all_gather
from megatron.core.transformer.context_parallel import ring as cp_ring

KV_TAG, DKV_TAG = cp_ring._KV_TAG, cp_ring._DKV_TAG
TAG_NAMES = {KV_TAG: "kv", DKV_TAG: "dkv"}


@dataclass
class Exchange:
    """One batched isend+irecv: times in seconds from the trace's origin."""
    tag: int
    phase: str
    post: float
    wait_start: Optional[float] = None
    wait_end: Optional[float] = None
    # The received message's first and last elements were in place when the wait began (the
    # receive buffer is filled with NaN just before the post). gloo's work.is_completed() stays
    # False until wait() even for a message long delivered, so it cannot tell.
    arrived_before_wait: Optional[bool] = None


@dataclass
class RingTrace:
    origin: float = field(default_factory=time.perf_counter)
    phases: dict = field(default_factory=dict)  # "forward"/"backward" -> (start, end)
    computes: List[Tuple[str, float, float]] = field(default_factory=list)
    exchanges: List[Exchange] = field(default_factory=list)
    phase: str = "none"

    def now(self) -> float:
        return time.perf_counter() - self.origin


class _TimedWorks:
    """Stands for the list of works one post returned: ``_wait`` iterates and waits on it."""

    def __init__(self, works, received, exchange: Exchange, trace: RingTrace):
        self.works, self.received = works, received.view(-1)
        self.exchange, self.trace = exchange, trace

    def __iter__(self):
        yield self

    def wait(self):
        self.exchange.wait_start = self.trace.now()
        ends = self.received[[0, -1]]
        self.exchange.arrived_before_wait = not bool(ends.isnan().any())
        for work in self.works:
            work.wait()
        self.exchange.wait_end = self.trace.now()


@contextlib.contextmanager
def traced_ring(trace: RingTrace):
    """Record the ring's timeline into ``trace`` while inside the block."""
    names = ("batch_isend_irecv", "block_forward", "block_backward", "ring_forward",
             "ring_backward")
    originals = {name: getattr(cp_ring, name) for name in names}

    def post(ops):
        received = ops[1].tensor
        received.fill_(float("nan"))  # see Exchange.arrived_before_wait
        exchange = Exchange(ops[0].tag, trace.phase, trace.now())
        trace.exchanges.append(exchange)
        return _TimedWorks(originals["batch_isend_irecv"](ops), received, exchange, trace)

    def compute(kind):
        def run(*args):
            start = trace.now()
            result = originals[kind](*args)
            trace.computes.append((kind, start, trace.now()))
            return result
        return run

    def phase(kind, name):
        def run(*args):
            trace.phase, start = name, trace.now()
            try:
                return originals[kind](*args)
            finally:
                trace.phases[name] = (start, trace.now())
                trace.phase = "none"
        return run

    cp_ring.batch_isend_irecv = post
    cp_ring.block_forward = compute("block_forward")
    cp_ring.block_backward = compute("block_backward")
    cp_ring.ring_forward = phase("ring_forward", "forward")
    cp_ring.ring_backward = phase("ring_backward", "backward")
    try:
        yield trace
    finally:
        for name, fn in originals.items():
            setattr(cp_ring, name, fn)


def _overlap(a: Tuple[float, float], b: Tuple[float, float]) -> float:
    return max(0.0, min(a[1], b[1]) - max(a[0], b[0]))


def ring_overlap(trace: RingTrace, phase: str) -> dict:
    """Sums over this phase's exchanges (seconds): window (post .. wait return), hidden (the
    window's time under block compute; computes never overlap each other on one rank),
    exposed (blocked in wait; unhidden_exposed: of exchanges with no compute in their window),
    compute (the phase's block computes), and counts."""
    exchanges = [e for e in trace.exchanges if e.phase == phase]
    span = trace.phases.get(phase, (0.0, 0.0))
    computes = [(s, e) for _, s, e in trace.computes if span[0] <= s and e <= span[1]]
    window = hidden = exposed = bare_exposed = 0.0
    bare = 0
    for ex in exchanges:
        interval = (ex.post, ex.wait_end)
        under_compute = sum(_overlap(interval, c) for c in computes)
        window += interval[1] - interval[0]
        hidden += under_compute
        exposed += ex.wait_end - ex.wait_start
        if under_compute == 0.0:  # the ring's final dK/dV hop: no block left to compute
            bare += 1
            bare_exposed += ex.wait_end - ex.wait_start
    return {"exchanges": len(exchanges), "window": window, "hidden": hidden,
            "exposed": exposed, "compute": sum(e - s for s, e in computes),
            "span": span[1] - span[0],
            "arrived_before_wait": sum(bool(e.arrived_before_wait) for e in exchanges),
            "unhidden_exchanges": bare, "unhidden_exposed": bare_exposed}


def final_hop(trace: RingTrace) -> Tuple[float, float, float]:
    """Absolute perf_counter times (post, wait start, wait return) of the backward's last
    exchange, the final dK/dV hop. perf_counter is CLOCK_MONOTONIC, the same clock in every
    process of this machine, so the ranks' timelines can be compared."""
    last = [e for e in trace.exchanges if e.phase == "backward"][-1]
    return tuple(trace.origin + t for t in (last.post, last.wait_start, last.wait_end))


def peer_wait(mine: Tuple[float, float, float], peer: Tuple[float, float, float]):
    """(seconds of my wait spent before the peer had even posted its hop, seconds after)."""
    _, wait_start, wait_end = mine
    peer_post = peer[0]
    before = min(max(0.0, peer_post - wait_start), wait_end - wait_start)
    return before, wait_end - wait_start - before


class _TimedCollectives:
    """Stands in for megatron.core.collectives inside context_parallel.all_gather: times each
    call."""

    def __init__(self, module, spans: list):
        self.module, self.spans = module, spans

    def _timed(self, name):
        def run(*args, **kwargs):
            start = time.perf_counter()
            result = getattr(self.module, name)(*args, **kwargs)
            self.spans.append((name, time.perf_counter() - start))
            return result
        return run

    def __getattr__(self, name):
        return self._timed(name)


@contextlib.contextmanager
def timed_all_gather(spans: list):
    """Append (collective name, seconds) to ``spans`` for each collective all_gather runs."""
    original = cp_all_gather.collectives
    cp_all_gather.collectives = _TimedCollectives(original, spans)
    try:
        yield spans
    finally:
        cp_all_gather.collectives = original
