"""pretrain_llama.py / pretrain_gpt.py end to end on CPU: one process, and torchrun with
TP=2 x PP=2 x DP=2 on 8 processes, give the same per-iteration losses (fp32; the layouts
differ only in the order of sums, <= 1e-5 as in the models issue; the log prints 7 digits).
The pipelined runs also trace iteration 2 (--pipeline-trace-dir): every rank's trace holds
the schedule's pure order, and tools/plot_pipeline.py draws the directory."""
import json
import os
import re

import pytest

from megatron.core.pipeline_parallel.schedule_order import schedule_order
from megatron.training.logging.pipeline_timeline import load_timeline
from tests.e2e.bad_inputs.harness import run as run_forked
from tests.e2e.conftest import load_tool
from tests.e2e.runner import LLAMA, TINY, parse_losses, run_script

TOL = 1e-5
NUM_MICROBATCHES = 2  # TINY's global batch 8 / (micro batch 2 x DP 2)


def _trace_flags(directory):
    return ["--pipeline-trace-dir", str(directory), "--pipeline-trace-iteration", "2"]


def _check_traces(directory, world_size, pp, vpp):
    """Every rank wrote its trace of iteration 2, all of one run, and ran the pure order."""
    names = sorted(os.listdir(directory))
    assert names == [f"trace_rank{r:05d}.json" for r in range(world_size)], names
    traces = [json.load(open(os.path.join(directory, name))) for name in names]
    assert len({t["run_id"] for t in traces}) == 1
    for rank, trace in enumerate(traces):
        assert (trace["rank"], trace["iteration"], trace["world_size"]) == (rank, 2, world_size)
        assert (trace["pipeline_size"], trace["virtual_size"], trace["num_microbatches"]) == (
            pp, vpp, NUM_MICROBATCHES)
        done = [(e["kind"][0].upper(), e["microbatch"], e["chunk"]) for e in trace["events"]
                if e["kind"] != "wait"]
        assert done == [(s.kind, s.microbatch, s.chunk) for s in schedule_order(
            pp, trace["pipeline_rank"], NUM_MICROBATCHES, vpp)], rank
    timeline = load_timeline(str(directory))
    assert len(timeline.rows) == pp and 0.0 < timeline.measured_bubble() < 1.0


@pytest.mark.parametrize("script,flags", [
    pytest.param("pretrain_llama.py", TINY + LLAMA, marks=pytest.mark.quick),
    ("pretrain_gpt.py", TINY)])
def test_tp_pp_dp_on_8_processes_equals_one_process(script, flags, tmp_path):
    single, single_valid = parse_losses(run_script(script, flags))
    parallel, parallel_valid = parse_losses(run_script(script, flags + [
        "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"]
        + _trace_flags(tmp_path), nproc=8))  # tracing an iteration changes no number
    assert len(single) == 6 and len(single_valid) == 2
    for a, b in zip(single + single_valid, parallel + parallel_valid, strict=True):
        assert abs(a - b) <= TOL, (single, parallel)
    _check_traces(tmp_path, world_size=8, pp=2, vpp=None)


def test_bad_flags_fail_before_any_work_with_one_message():
    # forked from the bad-input catalogue's warm server: the same as a launch, no torch import
    proc = run_forked("pretrain_llama.py", TINY + LLAMA + ["--global-batch-size", "7"])
    assert proc.returncode == 2
    assert "global" in proc.stderr and "divisible" in proc.stderr, proc.stderr
    proc = run_forked("pretrain_llama.py", TINY + LLAMA + ["--num-layer", "4"])
    assert proc.returncode == 2 and "did you mean" in proc.stderr, proc.stderr


def test_interleaved_on_4_processes_equals_one_process(tmp_path):
    flags = TINY + LLAMA
    traces = tmp_path / "traces"
    single, single_valid = parse_losses(run_script("pretrain_llama.py", flags))
    proc = run_script("pretrain_llama.py", flags + [
        "--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1"]
        + _trace_flags(traces), nproc=4)
    parallel, parallel_valid = parse_losses(proc)
    for a, b in zip(single + single_valid, parallel + parallel_valid, strict=True):
        assert abs(a - b) <= TOL, (single, parallel)
    _check_traces(traces, world_size=4, pp=2, vpp=2)
    png = tmp_path / "pipeline.png"  # drawn in this process: a second torch import costs
    assert load_tool("plot_pipeline").main([str(traces), "--out", str(png)]) == 0
    with open(png, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    # rank 0 prints the theoretical memory of every pipeline rank once, before training
    assert proc.stdout.count("theoretical memory per rank") == 1, proc.stdout
    report = proc.stdout[proc.stdout.index("theoretical memory"):proc.stdout.index(" iteration")]
    assert "pipeline rank 0:" in report and "pipeline rank 1:" in report, report


def test_tensorboard_holds_the_logged_values(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    flags = TINY + LLAMA + ["--tensorboard-dir", str(tmp_path),
                            "--log-validation-ppl-to-tensorboard",
                            "--log-batch-size-to-tensorboard", "--log-params-norm"]
    proc = run_script("pretrain_llama.py", flags)
    losses, valid = parse_losses(proc)
    events = EventAccumulator(str(tmp_path))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"lm loss", "learning-rate", "batch-size", "loss-scale", "grad-norm", "params-norm",
            "lm loss validation", "lm loss validation ppl"} <= tags, tags
    # --log-params-norm: on every logged line (3 decimals) and in TensorBoard
    printed = [float(x) for x in re.findall(r"\| params norm: ([0-9.]+) \|", proc.stdout)]
    assert len(printed) == 6
    for event, value in zip(events.Scalars("params-norm"), printed, strict=True):
        assert abs(event.value - value) <= 5e-4
    logged = [e.value for e in events.Scalars("lm loss")]
    assert [e.step for e in events.Scalars("lm loss")] == list(range(1, 7))
    for got, printed in zip(logged, losses, strict=True):
        assert abs(got - printed) <= 1e-6 * abs(printed)  # printed with 7 digits
    assert [e.step for e in events.Scalars("lm loss validation")] == [3, 6]
    assert abs(events.Scalars("lm loss validation")[-1].value - valid[-1]) <= 1e-6 * valid[-1]


def test_tensorboard_leaves_out_what_the_no_log_flags_say(tmp_path):
    """--no-log-learning-rate/loss-scale-to-tensorboard reach the logger (they were dropped)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    flags = TINY + LLAMA + ["--tensorboard-dir", str(tmp_path), "--train-iters", "2",
                            "--no-log-learning-rate-to-tensorboard",
                            "--no-log-loss-scale-to-tensorboard"]
    parse_losses(run_script("pretrain_llama.py", flags))
    events = EventAccumulator(str(tmp_path))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert "lm loss" in tags and not tags & {"learning-rate", "loss-scale"}, tags
