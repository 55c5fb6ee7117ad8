"""Pipeline timelines as data, for ``tools/plot_pipeline.py`` to draw: one row of bars per
rank (forward, backward and communication waits, with microbatch and model chunk) and the
bubble numbers, from the per-rank traces of a real run (``--pipeline-trace-dir``) or from the
simulated schedule of a planned one (``simulate``).

The measured bubble is the idle share of the drawn rows over the schedule's span:
1 - busy time / (rows x (latest end - earliest start)), waits counting as idle. The
theoretical one is (p - 1) / (v m + p - 1) for p stages, v virtual stages per rank and m
microbatches, with backward taking twice the forward's time.
"""
import glob
import json
import os
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

from megatron.core.pipeline_parallel.schedule_order import BACKWARD as PLANNED_BACKWARD
from megatron.core.pipeline_parallel.schedule_order import FORWARD as PLANNED_FORWARD
from megatron.core.pipeline_parallel.schedule_order import WEIGHT as PLANNED_WEIGHT
from megatron.core.pipeline_parallel.schedule_order import ZERO_BUBBLE
from megatron.core.pipeline_parallel.simulate import (
    simulate,
    theoretical_bubble,
    theoretical_bubble_zero,
)
from megatron.core.pipeline_parallel.trace import BACKWARD, FORWARD, WAIT

WEIGHT = "weight"  # a deferred weight-gradient step (zero-bubble schedules)
PLANNED_KINDS = {PLANNED_FORWARD: FORWARD, PLANNED_BACKWARD: BACKWARD, PLANNED_WEIGHT: WEIGHT}

TRACE_GLOB = "trace_rank*.json"  # the names pipeline_tracing.trace_file_name gives
# What a trace file holds besides its events (written by pipeline_tracing.start_trace).
TRACE_KEYS = ("rank", "pipeline_rank", "tensor_rank", "data_rank", "world_size",
              "pipeline_size", "virtual_size", "num_microbatches", "iteration", "run_id",
              "clock_origin", "events")
# Traces drawn together must agree on these (else they come from different runs or steps).
RUN_KEYS = ("run_id", "iteration", "world_size", "pipeline_size", "virtual_size",
            "num_microbatches")
RERUN = ("empty the directory (or pick a new one) and run training again with "
         "--pipeline-trace-dir")


class TimelineError(ValueError):
    """Input that cannot be drawn; the message names the problem and the fix."""


@dataclass(frozen=True)
class Bar:
    kind: str  # FORWARD, BACKWARD, WEIGHT or WAIT
    start: float
    end: float
    microbatch: Optional[int] = None
    chunk: Optional[int] = None

    def label(self, interleaved: bool) -> str:
        """'3' for microbatch 3; '3.1' for microbatch 3 on model chunk 1 (interleaved)."""
        return f"{self.microbatch}.{self.chunk}" if interleaved else f"{self.microbatch}"


@dataclass
class PipelineTimeline:
    title: str
    row_names: List[str]
    rows: List[List[Bar]]  # each in time order, times from the earliest start
    pipeline_size: int
    virtual_size: Optional[int]
    num_microbatches: int
    time_label: str  # the x axis: "time (ms)" or the planned cost unit
    bubble_name: str  # "measured" (a real run) or "simulated" (a planned one)
    schedule: Optional[str] = None  # a zero-bubble schedule's name, else None

    @property
    def interleaved(self) -> bool:
        return self.virtual_size is not None or self.schedule == "zbv"

    def steps(self, row: int) -> List[Bar]:
        """The row's forward and backward bars (no waits), in execution order."""
        return [bar for bar in self.rows[row] if bar.kind != WAIT]

    def measured_bubble(self) -> float:
        bars = [bar for row in self.rows for bar in row]
        span = max(b.end for b in bars) - min(b.start for b in bars)
        busy = sum(b.end - b.start for b in bars if b.kind != WAIT)
        return 1.0 - busy / (len(self.rows) * span) if span > 0 else 0.0

    def theoretical_bubble(self) -> float:
        if self.schedule in ZERO_BUBBLE:
            return theoretical_bubble_zero(self.pipeline_size, self.num_microbatches,
                                           self.schedule)
        return theoretical_bubble(self.pipeline_size, self.num_microbatches, self.virtual_size)

    def theoretical_formula(self) -> str:
        p, v, m = self.pipeline_size, self.virtual_size or 1, self.num_microbatches
        if self.schedule == "zb-h1":
            return f"(p-1)/(3m+p-1), F=B=W, = ({p}-1)/(3*{m}+{p}-1)"
        if self.schedule == "zbv":
            return f"(p-1)/(6m+p-1), F=B=W per chunk, = ({p}-1)/(6*{m}+{p}-1)"
        return f"(p-1)/(v*m+p-1) = ({p}-1)/({v}*{m}+{p}-1)"


def schedule_name(pipeline_size: int, virtual_size: Optional[int],
                  schedule: Optional[str] = None) -> str:
    if schedule in ZERO_BUBBLE:
        return {"zb-h1": "ZB-H1", "zbv": "ZB-V (2 chunks per rank in a V)"}[schedule]
    if pipeline_size == 1:
        return "no pipelining"
    return f"interleaved 1F1B, VPP {virtual_size}" if virtual_size else "1F1B"


# --- a real run -----------------------------------------------------------------------------

def load_trace_dir(directory: str) -> List[Tuple[str, Dict]]:
    """(file name, trace) for every trace file in ``directory``, checked to be drawable."""
    if not os.path.isdir(directory):
        raise TimelineError(f"trace directory {directory} does not exist; pass the "
                            f"--pipeline-trace-dir of a training run.")
    paths = sorted(glob.glob(os.path.join(directory, TRACE_GLOB)))
    if not paths:
        raise TimelineError(
            f"no {TRACE_GLOB} files in {directory}; run training with --pipeline-trace-dir "
            f"{directory} for at least --pipeline-trace-iteration iterations (default 2).")
    traces = []
    for path in paths:
        name = os.path.basename(path)
        try:
            with open(path) as f:
                trace = json.load(f)
            _check_trace(trace)
        except (OSError, ValueError, TypeError, KeyError) as exc:
            raise TimelineError(f"{path} is not a readable pipeline trace ({exc}); delete it "
                                f"or {RERUN}.") from None
        traces.append((name, trace))
    return traces


def _check_trace(trace) -> None:
    if not isinstance(trace, dict):
        raise ValueError("not a JSON object")
    missing = [key for key in TRACE_KEYS if key not in trace]
    if missing:
        raise ValueError(f"no {', '.join(missing)}")
    for event in trace["events"]:
        if event["kind"] not in (FORWARD, BACKWARD, WEIGHT, WAIT):
            raise ValueError(f"unknown event kind {event['kind']!r}")
        if not float(event["start"]) <= float(event["end"]):
            raise ValueError(f"an event ends before it starts: {event}")
        if event["kind"] != WAIT and not isinstance(event["microbatch"], int):
            raise ValueError(f"a step without its microbatch: {event}")


def timeline_from_traces(named_traces: Sequence[Tuple[str, Dict]], all_ranks: bool = False,
                         where: str = "the trace directory") -> PipelineTimeline:
    """One row per pipeline rank (the traces of data-parallel and tensor rank 0), or with
    ``all_ranks`` one per global rank. Times are aligned by each trace's wall-clock origin."""
    runs = {}
    for name, trace in named_traces:
        runs.setdefault(tuple(trace[key] for key in RUN_KEYS), []).append(name)
    if len(runs) > 1:
        described = "; ".join(
            f"{names[0]}{' and others' if len(names) > 1 else ''}: "
            + ", ".join(f"{key} {value}" for key, value in zip(RUN_KEYS, run))
            for run, names in runs.items())
        raise TimelineError(f"the traces in {where} come from different runs or iterations "
                            f"({described}); {RERUN}.")
    first = named_traces[0][1]
    pp, world = first["pipeline_size"], first["world_size"]
    if all_ranks:
        by_row = {t["rank"]: t for _, t in named_traces}
        wanted, what = range(world), "global rank {}"
    else:
        by_row = {t["pipeline_rank"]: t for _, t in named_traces
                  if t["data_rank"] == 0 and t["tensor_rank"] == 0}
        wanted, what = range(pp), "pipeline rank {} (data-parallel rank 0, tensor rank 0)"
    missing = [r for r in wanted if r not in by_row]
    if missing:
        raise TimelineError(f"{where} has no trace of " + ", ".join(what.format(r) for r in
                            missing) + f"; that rank did not finish the traced iteration, or "
                            f"its file was removed: {RERUN}.")
    chosen = [by_row[r] for r in wanted]
    if not any(t["events"] for t in chosen):
        raise TimelineError(f"the traces in {where} hold no steps; {RERUN}.")
    origin = min(t["clock_origin"] for t in chosen)
    offsets = [t["clock_origin"] - origin for t in chosen]
    t0 = min(off + e["start"] for off, t in zip(offsets, chosen) for e in t["events"])
    rows = [[Bar(e["kind"], 1e3 * (off + e["start"] - t0), 1e3 * (off + e["end"] - t0),
                 e.get("microbatch"), e.get("chunk")) for e in t["events"]]
            for off, t in zip(offsets, chosen)]
    names = [f"rank {t['rank']} (PP {t['pipeline_rank']}, DP {t['data_rank']}, "
             f"TP {t['tensor_rank']})" if all_ranks else f"PP rank {t['pipeline_rank']}"
             for t in chosen]
    m, v = first["num_microbatches"], first["virtual_size"]
    title = (f"{schedule_name(pp, v)}, PP {pp}, {m} microbatches: iteration "
             f"{first['iteration']} of a run on {world} ranks")
    return PipelineTimeline(title, names, rows, pp, v, m, "time (ms)", "measured")


def load_timeline(directory: str, all_ranks: bool = False) -> PipelineTimeline:
    return timeline_from_traces(load_trace_dir(directory), all_ranks, where=directory)


# --- a planned run --------------------------------------------------------------------------

def planned_timeline(pipeline_size: int, num_microbatches: int,
                     virtual_size: Optional[int] = None, forward_cost: float = 1.0,
                     backward_cost: float = 2.0, schedule: Optional[str] = None,
                     weight_cost: Optional[float] = None) -> PipelineTimeline:
    """The simulated schedule: every rank's steps with the given costs, waiting only for its
    neighbours' messages. Under a zero-bubble ``schedule`` the backward cost is B's and
    ``weight_cost`` (default: the forward's) W's."""
    if weight_cost is None:
        weight_cost = forward_cost if schedule in ZERO_BUBBLE else 0.0
    if not (forward_cost > 0 and backward_cost > 0 and weight_cost >= 0):
        raise TimelineError(f"--forward-cost ({forward_cost}) and --backward-cost "
                            f"({backward_cost}) must be > 0, --weight-cost ({weight_cost}) "
                            f">= 0.")
    try:
        simulated = simulate(pipeline_size, num_microbatches, virtual_size,
                             forward_cost=forward_cost, backward_cost=backward_cost,
                             weight_cost=weight_cost, schedule=schedule)
    except ValueError as exc:
        settings = f"--pipeline-size {pipeline_size} --num-microbatches {num_microbatches}" \
            + (f" --virtual-size {virtual_size}" if virtual_size is not None else "") \
            + (f" --schedule {schedule}" if schedule is not None else "")
        raise TimelineError(f"the schedule rejects {settings}: {exc}") from None
    rows = [[Bar(PLANNED_KINDS[step.kind], start, end, step.microbatch, step.chunk)
             for step, start, end in simulated.steps[r]] for r in range(pipeline_size)]
    costs = f"forward {forward_cost:g}, backward {backward_cost:g}" + (
        f", weight {weight_cost:g}" if schedule in ZERO_BUBBLE else "")
    title = (f"planned {schedule_name(pipeline_size, virtual_size, schedule)}, PP "
             f"{pipeline_size}, {num_microbatches} microbatches ({costs})")
    return PipelineTimeline(title, [f"PP rank {r}" for r in range(pipeline_size)], rows,
                            pipeline_size, virtual_size, num_microbatches,
                            f"time (one forward step = {forward_cost:g})", "simulated",
                            schedule if schedule in ZERO_BUBBLE else None)
