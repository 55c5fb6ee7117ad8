"""What bench/pipeline.py prints and writes: tokens/s and ratios, the gradient check, the
measured bubbles next to the theoretical ones, the targets, trace files and timeline PNGs.

Measured bubble of one traced step on one rank: 1 - busy / (first event's start .. last event's
end), busy = the forward, backward and weight steps (waits count as idle); per rank the median
over the traced steps, then the mean of the ranks. Theoretical: 1F1B (p-1)/(m+p-1) (backward
= 2 forward; the same at any costs); ZB-H1 and ZB-V simulate.theoretical_bubble_zero (F = B = W,
the issue's formulas), and next to it the same formulas (simulate.zero_bubble_idle) at the
mean F, B and W measured in our traces. Torch's zero-bubble schedules get no theoretical value
here (their orders are torch's own).
"""
import os
import statistics

import torch

from megatron.core.pipeline_parallel.simulate import (
    theoretical_bubble,
    theoretical_bubble_zero,
    zero_bubble_idle,
)
from megatron.core.pipeline_parallel.trace import BACKWARD, FORWARD, WAIT, WEIGHT

PP = 2
LABELS = {"1f1b": "ours 1F1B", "zb-h1": "ours ZB-H1", "zbv": "ours ZB-V",
          "torch-1f1b": "torch Schedule1F1B", "torch-zb": "torch InterleavedZeroBubble",
          "torch-zbv": "torch ZBVZeroBubble", "torch-dualpipev": "torch DualPipeV"}
OURS_ZB = ("zb-h1", "zbv")
TORCH_ZB = ("torch-zb", "torch-zbv", "torch-dualpipev")
PNG_NAMES = {"1f1b": "pipeline_bench_1f1b.png", "zb-h1": "pipeline_zb_h1.png",
             "zbv": "pipeline_zbv.png"}
TARGET_OVER_1F1B, TARGET_OVER_TORCH, TARGET_BUBBLE = 1.1, 1.0, 1.5


def trace_bubble(trace):
    events = trace["events"]
    if not events:
        return 0.0
    span = events[-1]["end"] - events[0]["start"]
    busy = sum(e["end"] - e["start"] for e in events if e["kind"] != WAIT)
    return 1.0 - busy / span if span > 0 else 0.0


def measured_bubble(per_rank, name):
    """(per-rank medians over the traced steps, their mean)."""
    ranks = [statistics.median(trace_bubble(t) for t in r["traces"][name]) for r in per_rank]
    return ranks, statistics.mean(ranks)


def mean_costs(per_rank, name):
    """Mean seconds of a forward, B and W step in our traces of ``name``, all ranks."""
    costs = {}
    for kind in (FORWARD, BACKWARD, WEIGHT):
        spans = [e["end"] - e["start"] for r in per_rank for t in r["traces"][name]
                 for e in t["events"] if e["kind"] == kind]
        costs[kind] = statistics.mean(spans) if spans else 0.0
    return costs


def theory(name, m, per_rank):
    """(theoretical bubble, the same formula at the measured costs), None where none."""
    if name in ("1f1b", "torch-1f1b"):
        value = theoretical_bubble(PP, m)
        return value, value
    if name not in OURS_ZB:
        return None, None
    c = mean_costs(per_rank, name)
    chunks = 2 if name == "zbv" else 1
    idle = zero_bubble_idle(PP, name, c[FORWARD], c[BACKWARD], c[WEIGHT])
    at_costs = idle / (chunks * m * (c[FORWARD] + c[BACKWARD] + c[WEIGHT]) + idle)
    return theoretical_bubble_zero(PP, m, name), at_costs


def report(args, per_rank, check):
    names = list(per_rank[0]["times"])
    steps = {n: [max(r["times"][n][i] for r in per_rank) for i in range(args.steps)]
             for n in names}
    tokens = args.microbatches * args.micro_batch_size * args.seq
    median = {n: statistics.median(v) for n, v in steps.items()}
    rate = {n: tokens / v for n, v in median.items()}
    torch_zb = [n for n in TORCH_ZB if n in rate]
    best_torch = max(torch_zb, key=rate.get) if torch_zb else None
    print("=" * 96)
    print(f"pipeline bench: PP={PP}, gloo, 1 thread/rank, torch {torch.__version__}")
    print(f"model: LLaMA layers={args.layers} hidden={args.hidden} heads={args.heads} "
          f"groups={args.groups} ffn={args.ffn} vocab={args.vocab} seq={args.seq} fp32; loop: "
          f"{args.layers // PP} layers per stage, V: {args.layers // (2 * PP)} per virtual stage")
    print(f"batch: {args.microbatches} microbatches x {args.micro_batch_size} = {tokens} "
          f"tokens/step; {args.steps} timed steps each (after {args.warmup} warmup), alternating")
    print("torch's schedules run the same modules and weights with plain-autograd linear layers "
          "(its split backward cannot split our custom autograd linear)")
    _print_check(check)
    print("speed (a step lasts until the slower rank is done; median):")
    for n in names:
        ts = sorted(steps[n])
        vs_torch = f"{rate[n] / rate[best_torch]:6.3f}" if best_torch else "   n/a"
        print(f"  speed {n:>16}: {LABELS[n]:<28} median {median[n] * 1e3:9.2f} ms (min "
              f"{ts[0] * 1e3:.1f}, max {ts[-1] * 1e3:.1f}) {rate[n]:9.1f} tokens/s  x1f1b "
              f"{rate[n] / rate['1f1b']:6.3f}  x-torch-best-zb {vs_torch}")
    print("first (untimed warmup) step, slower rank: " + ", ".join(
        f"{n} {max(r['first'][n] for r in per_rank) * 1e3:.0f} ms" for n in names))
    bubbles = _print_bubbles(args, per_rank, names)
    _print_targets(rate, bubbles, best_torch)
    print("=" * 96)
    if args.trace_dir:
        write_traces(args.trace_dir, per_rank, names)
    if args.png_dir:
        draw_ours(args.png_dir, per_rank, names)


def _print_check(check):
    print("gradient check against ours 1F1B (one step each from zero grads, every parameter "
          "by its layer in the whole model):")
    for n, (diff, relative, bitwise, loss) in check.items():
        ok = bitwise or relative <= 1e-5
        print(f"  check {n:>16}: max |diff| {diff:.3e}  relative to the tensor's max "
              f"{relative:.3e}  bitwise {bitwise}  mean loss {loss:.6f}  "
              f"{'PASSED' if ok else 'FAILED'}")


def _print_bubbles(args, per_rank, names):
    print(f"bubble (traced steps, separate and untimed; median of {args.trace_steps} per rank, "
          f"then the mean of the ranks) against theory (F=B=W; and at our measured costs):")
    bubbles = {}
    for n in names:
        ranks, mean = measured_bubble(per_rank, n)
        formula, at_costs = theory(n, args.microbatches, per_rank)
        bubbles[n] = (mean, formula)
        shown = "-" if formula is None else f"{formula:.3f}"
        costs = "-" if at_costs is None else f"{at_costs:.3f}"
        print(f"  bubble {n:>16}: " + " ".join(f"rank{i} {b:.4f}" for i, b in enumerate(ranks))
              + f"  mean {mean:.4f}  theory {shown}  at-measured-costs {costs}")
    return bubbles


def _print_targets(rate, bubbles, best_torch):
    ours_zb = [n for n in OURS_ZB if n in rate]
    if not ours_zb:
        return
    best = max(ours_zb, key=rate.get)
    over = rate[best] / rate["1f1b"]
    print(f"target: best ours ZB ({best}) >= {TARGET_OVER_1F1B}x ours 1F1B: {over:.3f} "
          f"{'MET' if over >= TARGET_OVER_1F1B else 'NOT MET'}")
    if best_torch:
        vs = rate[best] / rate[best_torch]
        print(f"target: best ours ZB ({best}) >= {TARGET_OVER_TORCH}x torch's best ZB "
              f"({best_torch}): {vs:.3f} {'MET' if vs >= TARGET_OVER_TORCH else 'NOT MET'}")
    for n in ours_zb:
        mean, formula = bubbles[n]
        times = mean / formula
        print(f"target: {n} measured bubble within {TARGET_BUBBLE}x of theory: {mean:.3f} / "
              f"{formula:.3f} = {times:.2f}x {'MET' if times <= TARGET_BUBBLE else 'NOT MET'}")


def write_traces(directory, per_rank, names):
    """DIR/<schedule>/step<k>/trace_rank0000r.json, as training's --pipeline-trace-dir."""
    import json

    from megatron.core.utils import write_atomically

    for n in names:
        for r in per_rank:
            for k, trace in enumerate(r["traces"][n]):
                path = os.path.join(directory, n, f"step{k}", f"trace_rank{r['rank']:05d}.json")
                os.makedirs(os.path.dirname(path), exist_ok=True)
                write_atomically(path, lambda f, t=trace: json.dump(t, f))
    print(f"traces written under {directory}/<schedule>/step<k>/")


def draw_ours(directory, per_rank, names):
    """The last traced step of each of our schedules, by tools/plot_pipeline.py's drawing."""
    from megatron.training.logging.pipeline_timeline import timeline_from_traces
    from tools.plot_pipeline import draw, write_png

    os.makedirs(directory, exist_ok=True)
    for n in (n for n in names if n in PNG_NAMES):
        named = [(f"rank{r['rank']}", r["traces"][n][-1]) for r in per_rank]
        timeline = timeline_from_traces(named, where=f"the traces of {n}")
        timeline.schedule = n if n in OURS_ZB else None
        timeline.title = (f"{LABELS[n]}, PP {PP}, {timeline.num_microbatches} microbatches: "
                          f"bench/pipeline.py, last traced step, 2 CPU processes")
        path = os.path.join(directory, PNG_NAMES[n])
        write_png(draw(timeline), path, 110)
        print(f"{path}: measured bubble {timeline.measured_bubble():.1%}, theoretical "
              f"{timeline.theoretical_bubble():.1%}")
