"""Draw a pipeline schedule as a PNG timeline: one row per rank, forward and backward steps per
microbatch in two color families (darker = later microbatch), waits on communication as thin
grey bars, idle time as empty space; the title gives the measured and theoretical bubble.

A real run (the traces that training writes with --pipeline-trace-dir DIR):

    python3 tools/plot_pipeline.py DIR --out pipeline.png [--all-ranks]

A planned one (the simulated schedule, forward and backward costs in arbitrary units):

    python3 tools/plot_pipeline.py --planned --pipeline-size 4 --num-microbatches 8 \\
        [--virtual-size 2] [--forward-cost 1 --backward-cost 2] --out planned.png
    python3 tools/plot_pipeline.py --planned --schedule zbv --pipeline-size 4 \\
        --num-microbatches 8 --backward-cost 1 [--weight-cost 1] --out zbv.png

Zero-bubble schedules (--schedule zb-h1 | zbv) draw the deferred weight-gradient steps (W) in
their own colour; zbv's bars are labelled 'microbatch.chunk' like the interleaved ones.

Bars are labelled with their microbatch ('3'), and under the interleaved schedule with their
model chunk too ('3.1': microbatch 3 on chunk 1, also hatched by chunk).
"""
import argparse
import os
import sys

# Run from a clone without installing, as Megatron's tools allow.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir))

from megatron.core.pipeline_parallel.trace import BACKWARD, FORWARD, WAIT  # noqa: E402
from megatron.core.utils import write_atomically  # noqa: E402
from megatron.training.logging.pipeline_timeline import (  # noqa: E402
    WEIGHT,
    PipelineTimeline,
    TimelineError,
    load_timeline,
    planned_timeline,
)

HATCHES = ("", "//", "..", "xx", "\\\\", "++")  # by model chunk (interleaved)
WAIT_COLOR = "0.72"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("trace_dir", nargs="?", help="a training run's --pipeline-trace-dir")
    p.add_argument("--out", required=True, help="the PNG to write")
    p.add_argument("--all-ranks", action="store_true",
                   help="one row per global rank (default: one per pipeline rank, the traces "
                        "of data-parallel rank 0 and tensor rank 0)")
    p.add_argument("--planned", action="store_true",
                   help="draw the simulated schedule instead of a run's traces")
    p.add_argument("--pipeline-size", type=int, help="--planned: pipeline stages (PP)")
    p.add_argument("--num-microbatches", type=int, help="--planned: microbatches per batch")
    p.add_argument("--virtual-size", type=int, default=None,
                   help="--planned: model chunks per rank (interleaved; default none)")
    p.add_argument("--schedule", choices=("1f1b", "interleaved", "zb-h1", "zbv"), default=None,
                   help="--planned: the schedule (default: interleaved with --virtual-size, "
                        "else 1f1b)")
    p.add_argument("--weight-cost", type=float, default=None,
                   help="--planned, zero-bubble schedules: a W step's cost (default: the "
                        "forward's)")
    p.add_argument("--forward-cost", type=float, default=1.0, help="--planned (default 1)")
    p.add_argument("--backward-cost", type=float, default=2.0, help="--planned (default 2)")
    p.add_argument("--dpi", type=int, default=110)
    return p.parse_args(argv)


def build_timeline(args) -> PipelineTimeline:
    if args.planned:
        if args.trace_dir is not None or args.all_ranks:
            raise TimelineError("--planned draws the simulated schedule: drop the trace "
                                "directory and --all-ranks (or drop --planned).")
        if args.pipeline_size is None or args.num_microbatches is None:
            raise TimelineError("--planned needs --pipeline-size and --num-microbatches.")
        return planned_timeline(args.pipeline_size, args.num_microbatches, args.virtual_size,
                                args.forward_cost, args.backward_cost, args.schedule,
                                args.weight_cost)
    if args.trace_dir is None:
        raise TimelineError("give a trace directory (a training run's --pipeline-trace-dir), "
                            "or --planned with --pipeline-size and --num-microbatches.")
    if (args.pipeline_size, args.num_microbatches, args.virtual_size, args.schedule) \
            != (None, None, None, None):
        raise TimelineError("--pipeline-size, --num-microbatches and --virtual-size describe a "
                            "planned schedule (the traces hold the run's own): add --planned "
                            "or drop them.")
    return load_timeline(args.trace_dir, args.all_ranks)


def draw(timeline: PipelineTimeline, dpi: int = 110):
    """The figure (matplotlib's Agg backend: no display needed; no pyplot state, so nothing
    to close when called many times in one process)."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    colormaps = {FORWARD: matplotlib.colormaps["Blues"], BACKWARD: matplotlib.colormaps["Oranges"],
                 WEIGHT: matplotlib.colormaps["Greens"]}
    steps_per_row = max(len(timeline.steps(r)) for r in range(len(timeline.rows)))
    width = min(48.0, max(10.0, 0.42 * steps_per_row + 3))
    handles = _legend_handles(timeline, colormaps)
    # One legend line if it fits (about 0.07 inch per character at font size 8), else two.
    legend_inches = sum(0.45 + 0.07 * len(h.get_label()) for h in handles)
    ncol = len(handles) if legend_inches < 0.95 * width else (len(handles) + 1) // 2
    legend_height = 0.25 * (1 + (ncol < len(handles)))
    height = 1.5 + 0.62 * len(timeline.rows) + legend_height
    fig = Figure(figsize=(width, height), dpi=dpi)
    ax = fig.subplots()
    span = max((bar.end for row in timeline.rows for bar in row), default=1.0) or 1.0
    points_per_unit = 0.82 * width * 72 / span  # roughly: the axes take ~82% of the width
    for y, row in enumerate(timeline.rows):
        _draw_row(ax, y, row, timeline, colormaps, points_per_unit)
    ax.set_yticks(range(len(timeline.rows)), timeline.row_names)
    ax.set_ylim(len(timeline.rows) - 0.5, -0.5)  # rank 0 on top
    ax.set_xlim(0, span * 1.01)
    ax.set_xlabel(timeline.time_label)
    ax.grid(axis="x", color="0.92", linewidth=0.6)
    ax.set_axisbelow(True)
    fig.legend(handles=handles, loc="lower center", ncol=ncol, fontsize=8, frameon=False)
    ax.set_title(f"{timeline.title}\n{timeline.bubble_name} bubble "
                 f"{timeline.measured_bubble():.1%}    theoretical "
                 f"{timeline.theoretical_formula()} = {timeline.theoretical_bubble():.1%}",
                 fontsize=10)
    fig.tight_layout(rect=(0, (legend_height + 0.05) / height, 1, 1))  # the legend below
    return fig


def _draw_row(ax, y, row, timeline, colormaps, points_per_unit) -> None:
    last_microbatch = max(1, timeline.num_microbatches - 1)
    for bar in row:
        length = bar.end - bar.start
        if bar.kind == WAIT:
            ax.barh(y, length, left=bar.start, height=0.14, color=WAIT_COLOR, linewidth=0)
            continue
        shade = 0.3 + 0.6 * bar.microbatch / last_microbatch
        ax.barh(y, length, left=bar.start, height=0.72, linewidth=0.6, edgecolor="white",
                color=colormaps[bar.kind](shade),
                hatch=HATCHES[(bar.chunk or 0) % len(HATCHES)] if timeline.interleaved else None)
        label = bar.label(timeline.interleaved)
        points = length * points_per_unit
        fontsize, rotation = min(9.0, points / (0.62 * len(label) + 0.4)), 0
        if fontsize < 5.0:  # a narrow bar: write along it
            fontsize, rotation = min(7.0, points / 1.5), 90
        if fontsize >= 4.0:  # narrower still: unlabelled, the shade still tells
            ax.text(bar.start + length / 2, y, label, ha="center", va="center",
                    rotation=rotation, fontsize=fontsize,
                    color="white" if shade > 0.62 else "black")


def _legend_handles(timeline, colormaps):
    from matplotlib.patches import Patch

    handles = [Patch(color=colormaps[FORWARD](0.6), label="forward (darker: later microbatch)"),
               Patch(color=colormaps[BACKWARD](0.6), label="backward" + (
                   " (input gradient, B)" if timeline.schedule else ""))]
    if timeline.schedule or any(bar.kind == WEIGHT for row in timeline.rows for bar in row):
        handles.append(Patch(color=colormaps[WEIGHT](0.6), label="weight gradient (W)"))
    handles += [Patch(color=WAIT_COLOR, label="waiting on a neighbour"),
                Patch(facecolor="white", edgecolor="0.6", label="idle (empty)")]
    for c in range(timeline.virtual_size or (2 if timeline.schedule == "zbv" else 0)):
        handles.append(Patch(facecolor="0.85", edgecolor="white", hatch=HATCHES[c % len(HATCHES)],
                             label=f"model chunk {c}" + (" (bar labels: microbatch.chunk)"
                                                          if c == 0 else "")))
    return handles


def write_png(fig, path: str, dpi: int) -> None:
    """Never half a PNG: written to a temporary name, then renamed."""
    write_atomically(path, lambda f: fig.savefig(f, format="png", dpi=dpi), binary=True)


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        timeline = build_timeline(args)
    except TimelineError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    fig = draw(timeline, args.dpi)
    try:
        write_png(fig, args.out, args.dpi)
    except OSError as exc:
        print(f"error: cannot write {args.out}: {exc}; pick a writable --out.", file=sys.stderr)
        return 1
    print(f"{args.out}: {timeline.title}; {timeline.bubble_name} bubble "
          f"{timeline.measured_bubble():.1%}, theoretical {timeline.theoretical_bubble():.1%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
