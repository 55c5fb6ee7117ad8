"""The planner and the zero-bubble schedules: it enumerates zb-h1 and zbv where they run,
prints --pipeline-schedule in their rows, costs their bubble with the schedules' formulas
from the stage's F, B and W, and its flags build exactly the configs it costed."""
import dataclasses
import shlex

import pytest

from megatron.core.pipeline_parallel.simulate import zero_bubble_idle
from megatron.training.memory.estimate import estimate_from_configs
from megatron.training.planner import Cluster, Layout, estimate_step_time, plan, workload_from_flags
from megatron.training.planner.layouts import _schedules
from megatron.training.planner.plan import layout_config, layout_memory
from megatron.training.planner.step_time import weight_gradient_seconds
from tests.unit.test_plan_parallelism import LLAMA2_7B, TINY_LLAMA, configs_of

NO_PIPELINE_COMM = dict(intra_node_bandwidth_gbs=1e12, inter_node_bandwidth_gbs=1e12)


def _workload(global_batch_size=16):
    return workload_from_flags(TINY_LLAMA + shlex.split(
        "--lr 1e-4 --train-iters 1 --mock-data --tokenizer-type NullTokenizer"),
        global_batch_size=global_batch_size)


def test_schedules_enumerated_where_they_run():
    assert _schedules(4, 1) == [(None, None)]
    assert _schedules(4, 2) == [(None, None), (2, None), (None, "zb-h1"), (None, "zbv")]
    assert (None, "zbv") not in _schedules(6, 2)  # 6 layers do not cut into 2 x 2 stages
    rows = plan(_workload(), Cluster(num_gpus=4), top=None).rows
    schedules = {(r.layout.pipeline_parallel, r.layout.schedule) for r in rows}
    assert {(2, "zb-h1"), (2, "zbv"), (4, "zb-h1")} <= schedules
    for row in rows:  # zbv: at least 2 PP microbatches
        if row.layout.schedule == "zbv":
            assert row.layout.num_microbatches >= 2 * row.layout.pipeline_parallel


@pytest.mark.parametrize("schedule", ["zb-h1", "zbv"])
def test_row_flags_build_the_costed_configs(schedule):
    workload = _workload()
    layout = Layout(1, 2, None, 2, 1, 16, None, True, schedule=schedule)
    config = layout_config(workload, layout)
    memory = layout_memory(workload, layout, config)
    flags = layout.flags(workload.args.num_layers)
    assert shlex.join(flags).count(f"--pipeline-schedule {schedule}") == 1
    configs = configs_of(workload.flags + flags, 4, 1000)
    assert configs.transformer == config
    assert config.pipeline_schedule == schedule
    assert config.virtual_pipeline_model_parallel_size == (2 if schedule == "zbv" else None)
    estimate = estimate_from_configs(configs, 512)
    assert estimate.max_total == memory.max_total
    if schedule == "zb-h1":  # its peak is in the steady state, with W inputs waiting
        assert any(stage.activations.deferred for stage in memory.stages)


@pytest.mark.parametrize("schedule", ["zb-h1", "zbv"])
def test_bubble_is_the_schedules_formula_with_the_stage_costs(schedule):
    """No communication cost: F is the forward, W the weight-gradient GEMMs, B the rest of the
    backward of the slowest stage (zbv: each half for a chunk). TP's collectives are free here
    (bandwidth 1e12 GB/s): rel 1e-6 covers them and the FLOP counts' integer divisions."""
    workload, cluster = _workload(), Cluster(num_gpus=4, **NO_PIPELINE_COMM)
    for lay in (Layout(1, 2, None, 2, 1, 16, None, True, schedule=schedule),
                Layout(2, 2, None, 1, 2, 16, None, False, schedule=schedule)):
        config = layout_config(workload, lay)
        step = estimate_step_time(config, lay, cluster, layout_memory(workload, lay, config),
                                  512, 1024)
        one_f1b = estimate_step_time(config, dataclasses.replace(lay, schedule=None),
                                     cluster, layout_memory(workload, lay, config), 512, 1024)
        flop_rate = lay.tensor_parallel * cluster.peak_tflops * 1e12 * cluster.compute_efficiency
        slowest_layers = config.num_layers // lay.pipeline_parallel
        weight_s = weight_gradient_seconds(config, lay, 512, slowest_layers, True, 1024,
                                           flop_rate)
        forward_s = step.compute_s / 3  # no recomputation: backward = 2 x forward
        f, b, w = forward_s, step.compute_s - forward_s - weight_s, weight_s
        chunks = 2 if schedule == "zbv" else 1
        want = zero_bubble_idle(lay.pipeline_parallel, schedule, f / chunks, b / chunks,
                                w / chunks)
        assert step.bubble_s == pytest.approx(want, rel=1e-6)
        assert step.bubble_s < one_f1b.bubble_s  # what the schedule is for
        assert 0 < weight_s < step.compute_s - forward_s


def test_zero_bubble_rows_rank_above_their_1f1b_twins():
    """LLaMA-2 7B on 8 GPUs: every pipelined one-chunk layout's zb-h1 twin is faster in the
    model (same memory budget: zb-h1 holds at most 1F1B's microbatches in flight)."""
    workload = workload_from_flags(LLAMA2_7B, global_batch_size=16)
    rows = plan(workload, Cluster(num_gpus=8), top=None).rows
    by_layout = {row.layout: row for row in rows}
    twins = 0
    for lay, row in by_layout.items():
        if lay.pipeline_parallel > 1 and lay.virtual_pipeline is None and lay.schedule is None:
            twin = by_layout.get(dataclasses.replace(lay, schedule="zb-h1"))
            if twin is not None:
                twins += 1
                assert twin.step.step_s < row.step.step_s
                assert twin.step.bubble_fraction < row.step.bubble_fraction
    assert twins > 0


def test_weight_gradient_time_ignores_sliding_windows():
    """W is the weight-gradient GEMMs: a layer's linear work, the same with or without a
    window on its attention (the window shrinks only the attention core it leaves out)."""
    lay = Layout(1, 2, None, 1, 1, 4, None, False, schedule="zb-h1")
    plain = layout_config(_workload(), lay)
    windowed = dataclasses.replace(plain, window_size=(15, 0))
    cluster = Cluster(num_gpus=2)
    rate = cluster.peak_tflops * 1e12 * cluster.compute_efficiency
    assert weight_gradient_seconds(windowed, lay, 512, 2, True, 1024, rate) == \
        weight_gradient_seconds(plain, lay, 512, 2, True, 1024, rate) > 0
