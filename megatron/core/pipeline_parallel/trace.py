"""An optional per-rank record of what a pipeline schedule did and when.

Events are forward, backward and (zero-bubble schedules) weight-gradient steps (with
microbatch and chunk) and waits on communication,
timed in seconds from the trace's start. On GPUs the device is synchronised at each event
boundary so that times mean something; that costs speed, so tracing is off unless asked for.

``perf_counter`` origins differ between processes, so the JSON also holds ``clock_origin``,
the wall-clock time (``time.time()``) of the trace's start: adding it lines up the ranks of one
machine exactly, and those of several machines as well as their clocks agree. ``info`` carries
what a reader needs to know about the run (sizes, ranks, iteration), written as it is given.
"""
import contextlib
import json
import time
from typing import Dict, List, Optional

from megatron.core import device
from megatron.core.utils import write_atomically

FORWARD, BACKWARD, WEIGHT, WAIT = "forward", "backward", "weight", "wait"


class PipelineTrace:
    def __init__(self, rank: int = 0, pipeline_rank: int = 0, info: Optional[Dict] = None):
        self.rank, self.pipeline_rank = rank, pipeline_rank
        self.info = dict(info or {})
        self.events: List[Dict] = []
        self.clock_origin = time.time()
        self._origin = time.perf_counter()

    def _now(self) -> float:
        device.synchronize()
        return time.perf_counter() - self._origin

    @contextlib.contextmanager
    def span(self, kind: str, microbatch: Optional[int] = None, chunk: Optional[int] = None):
        start = self._now()
        try:
            yield
        finally:
            event = {"kind": kind, "start": start, "end": self._now()}
            if microbatch is not None:
                event.update(microbatch=microbatch, chunk=chunk)
            self.events.append(event)

    def busy_time(self) -> float:
        return sum(e["end"] - e["start"] for e in self.events if e["kind"] != WAIT)

    def bubble_fraction(self) -> float:
        """Share of this rank's schedule time (first event's start to last event's end) not
        spent computing: waits on neighbours and idle gaps."""
        if not self.events:
            return 0.0
        span = self.events[-1]["end"] - self.events[0]["start"]
        return 1.0 - self.busy_time() / span if span > 0 else 0.0

    def to_dict(self) -> Dict:
        return {**self.info, "rank": self.rank, "pipeline_rank": self.pipeline_rank,
                "clock_origin": self.clock_origin, "events": self.events}

    def write(self, path: str) -> None:
        """Write the trace as JSON, atomically (a reader never sees half a file)."""
        write_atomically(path, lambda f: json.dump(self.to_dict(), f))


def load_trace(path: str) -> Dict:
    with open(path) as f:
        return json.load(f)
