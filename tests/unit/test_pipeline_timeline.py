"""Pipeline timelines (megatron/training/logging/pipeline_timeline.py) and their drawing
(tools/plot_pipeline.py): the bars of each row are the steps the rank's trace recorded, in the
schedule's order, aligned across ranks by their clocks; the bubble numbers; a PNG; and one
clear message, a non-zero exit and no file for each kind of bad input."""
import json
import os

import pytest

from megatron.core.pipeline_parallel.schedule_order import schedule_order
from megatron.core.pipeline_parallel.simulate import simulate, theoretical_bubble
from megatron.core.pipeline_parallel.trace import BACKWARD, FORWARD, WAIT
from megatron.training.logging.pipeline_timeline import (
    Bar,
    TimelineError,
    planned_timeline,
    timeline_from_traces,
)
from tests.e2e.runner import load_tool



plot_pipeline = load_tool("plot_pipeline")


def _traces(pp, m, vpp=None, dp=1, iteration=2, run_id="7.0"):
    """{file name: trace} as training writes them for a TP=1 run, timed by the simulated
    schedule (forward 1 ms, backward 2 ms, waits filling the gaps). Each rank's clock origin
    is 0.25 s later than the previous one's, and its times are shifted to match."""
    simulated = simulate(pp, m, vpp, forward_cost=1e-3, backward_cost=2e-3)
    traces = {}
    for pipeline_rank in range(pp):
        shift = 0.25 * pipeline_rank
        events, now = [], 0.0
        for step, start, end in simulated.steps[pipeline_rank]:
            if start > now:
                events.append({"kind": WAIT, "start": now - shift, "end": start - shift})
            events.append({"kind": FORWARD if step.kind == "F" else BACKWARD,
                           "start": start - shift, "end": end - shift,
                           "microbatch": step.microbatch, "chunk": step.chunk})
            now = end
        for data_rank in range(dp):
            rank = data_rank + pipeline_rank * dp  # Megatron's order with TP=1
            traces[f"trace_rank{rank:05d}.json"] = {
                "run_id": run_id, "iteration": iteration, "world_size": pp * dp,
                "tensor_rank": 0, "data_rank": data_rank, "pipeline_size": pp,
                "virtual_size": vpp, "num_microbatches": m, "rank": rank,
                "pipeline_rank": pipeline_rank, "clock_origin": 1000.0 + shift,
                "events": events}
    return traces


def _steps(timeline, row):
    return [(b.kind[0].upper(), b.microbatch, b.chunk) for b in timeline.steps(row)]


def _order(pp, rank, m, vpp):
    return [(s.kind, s.microbatch, s.chunk) for s in schedule_order(pp, rank, m, vpp)]


@pytest.mark.parametrize("pp,m,vpp", [(4, 8, None), (4, 8, 2), (2, 3, None)])
def test_bars_are_each_ranks_steps_in_schedule_order_aligned_by_clock(pp, m, vpp):
    traces = _traces(pp, m, vpp, dp=2)
    timeline = timeline_from_traces(sorted(traces.items()))
    assert timeline.row_names == [f"PP rank {r}" for r in range(pp)]  # DP rank 0's traces
    simulated = simulate(pp, m, vpp, forward_cost=1e-3, backward_cost=2e-3)
    for r in range(pp):
        assert _steps(timeline, r) == _order(pp, r, m, vpp)
        # The clock offsets undo the per-rank origins: times are the simulated ones, in ms.
        assert [t for b in timeline.steps(r) for t in (b.start, b.end)] == pytest.approx(
            [1e3 * t for _, start, end in simulated.steps[r] for t in (start, end)])
    labels = [b.label(timeline.interleaved) for b in timeline.steps(0)]
    assert labels == [f"{mb}.{chunk}" if vpp else f"{mb}" for _, mb, chunk in _order(
        pp, 0, m, vpp)]
    assert timeline.measured_bubble() == pytest.approx(simulated.bubble_fraction())
    assert timeline.theoretical_bubble() == pytest.approx((pp - 1) / ((vpp or 1) * m + pp - 1))
    assert timeline.time_label == "time (ms)" and "iteration 2" in timeline.title


def test_all_ranks_gives_one_row_per_global_rank():
    timeline = timeline_from_traces(sorted(_traces(2, 4, dp=2).items()), all_ranks=True)
    assert timeline.row_names == ["rank 0 (PP 0, DP 0, TP 0)", "rank 1 (PP 0, DP 1, TP 0)",
                                  "rank 2 (PP 1, DP 0, TP 0)", "rank 3 (PP 1, DP 1, TP 0)"]
    assert _steps(timeline, 1) == _steps(timeline, 0) == _order(2, 0, 4, None)


def test_measured_bubble_by_hand():
    # PP=2, one microbatch; rank 1's clock starts 0.5 s after rank 0's.
    rank0 = [{"kind": FORWARD, "start": 0.0, "end": 1.0, "microbatch": 0, "chunk": 0},
             {"kind": WAIT, "start": 1.0, "end": 4.5},
             {"kind": BACKWARD, "start": 4.5, "end": 6.0, "microbatch": 0, "chunk": 0}]
    rank1 = [{"kind": WAIT, "start": 0.0, "end": 0.5},
             {"kind": FORWARD, "start": 0.5, "end": 2.0, "microbatch": 0, "chunk": 0},
             {"kind": BACKWARD, "start": 2.0, "end": 3.5, "microbatch": 0, "chunk": 0}]
    common = {"run_id": "1", "iteration": 5, "world_size": 2, "tensor_rank": 0,
              "data_rank": 0, "pipeline_size": 2, "virtual_size": None, "num_microbatches": 1}
    timeline = timeline_from_traces([
        ("a", {**common, "rank": 0, "pipeline_rank": 0, "clock_origin": 100.0, "events": rank0}),
        ("b", {**common, "rank": 1, "pipeline_rank": 1, "clock_origin": 100.5, "events": rank1})])
    # busy 1 + 1.5 + 1.5 + 1.5 = 5.5 s of 2 rows x 6 s (0 to rank 0's end at 6.0)
    assert timeline.measured_bubble() == pytest.approx(1 - 5.5 / 12)
    assert timeline.theoretical_bubble() == pytest.approx(0.5)
    assert timeline.rows[1][1].label(interleaved=False) == "0"
    assert Bar(FORWARD, 0.0, 1.0, microbatch=3, chunk=1).label(interleaved=True) == "3.1"
    assert [(b.kind, b.start, b.end) for b in timeline.rows[1]] == [
        (WAIT, 500.0, 1000.0), (FORWARD, 1000.0, 2500.0), (BACKWARD, 2500.0, 4000.0)]


@pytest.mark.parametrize("pp,m,vpp", [(4, 8, None), (4, 8, 2), (2, 2, 2), (3, 5, None)])
def test_planned_timeline_is_the_schedule_and_its_bubble_the_formula(pp, m, vpp):
    timeline = planned_timeline(pp, m, vpp)
    for r in range(pp):
        assert _steps(timeline, r) == _order(pp, r, m, vpp)
    assert timeline.measured_bubble() == pytest.approx(theoretical_bubble(pp, m, vpp))
    assert timeline.theoretical_bubble() == pytest.approx(theoretical_bubble(pp, m, vpp))
    assert timeline.bubble_name == "simulated" and "planned" in timeline.title


def _write(directory, traces):
    os.makedirs(directory, exist_ok=True)
    for name, trace in traces.items():
        with open(os.path.join(directory, name), "w") as f:
            f.write(trace if isinstance(trace, str) else json.dumps(trace))
    return str(directory)


def _check_png(path):
    import matplotlib.image

    with open(path, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    height, width, _ = matplotlib.image.imread(path).shape
    assert width > height > 200


def test_cli_draws_a_png_from_traces_and_from_the_plan(tmp_path, capsys):
    traces = _write(tmp_path / "traces", _traces(4, 8, 2, dp=2))
    out = tmp_path / "out"
    assert plot_pipeline.main([traces, "--out", str(out / "real.png")]) == 0
    assert plot_pipeline.main([traces, "--all-ranks", "--out", str(out / "all.png")]) == 0
    assert plot_pipeline.main(["--planned", "--pipeline-size", "4", "--num-microbatches", "8",
                               "--out", str(out / "planned.png")]) == 0
    assert sorted(os.listdir(out)) == ["all.png", "planned.png", "real.png"]  # no temp files
    umask = os.umask(0)
    os.umask(umask)
    for name in os.listdir(out):
        _check_png(out / name)
        assert os.stat(out / name).st_mode & 0o777 == 0o666 & ~umask  # as open() makes
    printed = capsys.readouterr().out
    assert "measured bubble" in printed and "simulated bubble 27.3%, theoretical 27.3%" in printed


def _bad_inputs(tmp_path):
    good = _traces(2, 4)
    later = _traces(2, 4, iteration=3)
    old_format = {name: {"rank": t["rank"], "pipeline_rank": t["pipeline_rank"],
                         "events": t["events"]} for name, t in good.items()}
    planned = ["--planned", "--pipeline-size", "2"]
    return {
        "missing directory": ([str(tmp_path / "nowhere")], "does not exist"),
        "no trace files": ([_write(tmp_path / "empty", {})], "no trace_rank*.json files"),
        "invalid JSON": ([_write(tmp_path / "broken", {**good, "trace_rank00001.json": "{"})],
                         "trace_rank00001.json is not a readable pipeline trace"),
        "not a trace": ([_write(tmp_path / "old", old_format)], "(no tensor_rank, data_rank"),
        "two iterations": ([_write(tmp_path / "mixed", {
            "trace_rank00000.json": good["trace_rank00000.json"],
            "trace_rank00001.json": later["trace_rank00001.json"]})],
            "come from different runs or iterations"),
        "two runs": ([_write(tmp_path / "runs", {**good, "trace_rank00001.json": _traces(
            2, 4, run_id="8.0")["trace_rank00001.json"]})], "different runs or iterations"),
        "a rank missing": ([_write(tmp_path / "half", {
            "trace_rank00000.json": good["trace_rank00000.json"]})],
            "no trace of pipeline rank 1 (data-parallel rank 0, tensor rank 0)"),
        "schedule rejects": (planned + ["--num-microbatches", "3", "--virtual-size", "2"],
                             "the schedule rejects --pipeline-size 2 --num-microbatches 3 "
                             "--virtual-size 2: the interleaved schedule needs"),
        "no microbatches": (planned, "--planned needs --pipeline-size and --num-microbatches"),
        "bad cost": (planned + ["--num-microbatches", "2", "--backward-cost", "0"],
                     "must be > 0"),
        "both modes": (planned + ["--num-microbatches", "2", str(tmp_path)], "drop the trace"),
        "neither": ([], "give a trace directory"),
        "planned sizes for a run": ([_write(tmp_path / "sizes", good), "--pipeline-size", "2"],
                                    "add --planned or drop them"),
        "no steps": ([_write(tmp_path / "idle", {name: {**t, "events": []}
                                                 for name, t in good.items()})],
                     "hold no steps"),
    }


def test_bad_input_exits_non_zero_with_one_message_and_writes_nothing(tmp_path, capsys):
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    for case, (argv, message) in _bad_inputs(tmp_path).items():
        code = plot_pipeline.main(argv + ["--out", str(out_dir / "plot.png")])
        err = capsys.readouterr().err
        assert code == 2, case
        assert err.startswith("error: ") and message in err and err.count("\n") == 1, (case, err)
        assert os.listdir(out_dir) == [], case


def test_timeline_error_is_a_value_error():
    with pytest.raises(TimelineError):
        planned_timeline(0, 4)
    assert issubclass(TimelineError, ValueError)
