"""The planner and --fp8-param-gather: an FP8 workload whose recipe the distributed optimizer
gathers in FP8 gets the flag on every row with that optimizer (the flags parse back to it),
and the row's data-parallel time is the bf16 gather's less the FP8 weights' second byte,
to the arithmetic of step_time.py's ring (the same weights, the same memory: nothing else
moves)."""
import pytest

from megatron.training.planner import Cluster, estimate_step_time, plan, workload_from_flags
from megatron.training.planner.step_time import sharded_collective_seconds
from tests.unit.test_plan_parallelism import LLAMA2_7B, configs_of


@pytest.mark.parametrize("recipe,gathered", [  # two of them in the full suite only
    ("tensorwise", True), pytest.param("delayed", True, marks=pytest.mark.slow),
    pytest.param("rowwise", False, marks=pytest.mark.slow)])
def test_fp8_rows_with_the_distributed_optimizer_gather_in_fp8(recipe, gathered):
    cluster = Cluster(num_gpus=16, gpus_per_node=8)
    workload = workload_from_flags(LLAMA2_7B + ["--fp8-format", "e4m3", "--fp8-recipe", recipe],
                                   global_batch_size=64)
    result = plan(workload, cluster, top=None)
    sharded = [r for r in result.rows if r.layout.distributed_optimizer]
    assert sharded and any(not r.layout.distributed_optimizer for r in result.rows)
    for row in result.rows:
        assert ("--fp8-param-gather" in row.flags) == (
            gathered and row.layout.distributed_optimizer)
    row = next(r for r in sharded if r.layout.pipeline_parallel == 1)
    ddp = configs_of(workload.flags + row.flags, 16, 32000).ddp
    assert ddp.fp8_param_gather == gathered
    if not gathered:
        return
    plain = estimate_step_time(row.config, row.layout, cluster, row.memory,
                               workload.seq_length, row.padded_vocab_size)
    (stage,) = row.memory.stages
    saved = sharded_collective_seconds(row.layout, cluster, 0, stage.state.fp8_weights // 2)[1]
    assert saved > 0
    assert row.step.data_parallel_s == pytest.approx(plain.data_parallel_s - saved, rel=1e-12)
