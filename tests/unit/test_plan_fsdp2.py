"""The planner with FSDP2 where it composes now: pipeline parallelism (1F1B, interleaved and
the zero-bubble schedules), context parallelism and MoE; its step time counts FSDP2's
collectives once per microbatch (fsdp.py reduce-scatters every microbatch's gradients and
gathers the parameters again for each; under a zero-bubble schedule it reduces once, after
the last W), and a planned FSDP2 x PP row's flags parse back to the estimate the planner
costed."""
import shlex

import pytest

from megatron.training.memory.estimate import estimate_from_configs
from megatron.training.planner import Cluster, Layout, estimate_step_time, workload_from_flags
from megatron.training.planner.layouts import layout_families
from megatron.training.planner.plan import layout_config, layout_memory
from tests.unit.test_plan_parallelism import LLAMA2_7B, TINY_LLAMA, configs_of


def test_fsdp2_layouts_include_every_pipeline_schedule():
    workload = workload_from_flags(TINY_LLAMA, global_batch_size=16)
    layouts = [lay for family in layout_families(workload.args, 8, 8, 16, 2, with_cp=True,
                                                 memory_mode="fsdp2") for lay in family]
    assert {lay.pipeline_parallel for lay in layouts} >= {1, 2, 4}
    assert any(lay.virtual_pipeline for lay in layouts)  # interleaved
    assert any(lay.context_parallel > 1 for lay in layouts)
    assert {lay.schedule for lay in layouts} == {None, "zb-h1", "zbv"}
    assert all(lay.data_parallel * lay.context_parallel > 1 for lay in layouts)


def _data_parallel_seconds(workload, lay):
    config = layout_config(workload, lay)
    memory = layout_memory(workload, lay, config)
    cluster = Cluster(num_gpus=8, gpus_per_node=4, inter_node_bandwidth_gbs=10)
    return estimate_step_time(config, lay, cluster, memory, 4096, 32000).data_parallel_s


def test_fsdp2_collectives_are_counted_once_per_microbatch():
    """Twice the microbatches: FSDP2's gathers and reduce-scatters take twice as long; the
    distributed optimizer's reduce-scatter and gather stay once a step."""
    workload = workload_from_flags(LLAMA2_7B, global_batch_size=32)
    for mode, sharded, ratio in (("fsdp2", False, 2.0), ("fsdp2-zero2", False, 2.0),
                                 (None, True, 1.0)):
        seconds = [_data_parallel_seconds(workload, Layout(
            1, 2, None, 4, 1, batch, None, sharded, memory_mode=mode)) for batch in (8, 16)]
        assert seconds[0] > 0 and seconds[1] == ratio * seconds[0], mode
    # ZB-H1: the gathers per microbatch, the reduce-scatter once (the same bytes as above)
    (flat_8, flat_16), (zb_8, zb_16) = ([_data_parallel_seconds(workload, Layout(
        1, 2, None, 4, 1, batch, None, False, memory_mode="fsdp2", schedule=schedule))
        for batch in (8, 16)] for schedule in (None, "zb-h1"))
    per_microbatch = flat_8 / 2  # a reduce-scatter and the gathers (2 microbatches at 8)
    gathers = (zb_16 - zb_8) / 2  # 2 more microbatches at 16: only their gathers
    reduce_once = per_microbatch - gathers
    assert 0 < gathers and 0 < reduce_once and flat_16 == pytest.approx(2 * flat_8)
    assert zb_8 == pytest.approx(reduce_once + 2 * gathers)


def test_fsdp2_pipeline_row_flags_parse_back_to_the_planned_estimate():
    workload = workload_from_flags(TINY_LLAMA + shlex.split(
        "--lr 1e-4 --train-iters 1 --mock-data --tokenizer-type NullTokenizer"),
        global_batch_size=16)
    layout = Layout(2, 2, None, 2, 1, 16, None, False, memory_mode="fsdp2")
    memory = layout_memory(workload, layout, layout_config(workload, layout))
    flags = layout.flags(workload.args.num_layers)
    assert "--use-torch-fsdp2" in flags and "--pipeline-model-parallel-size" in flags
    estimate = estimate_from_configs(configs_of(workload.flags + flags, 8, 1000), 512)
    assert estimate.mode == memory.mode and estimate.max_total == memory.max_total
    # each stage its own parameters: the first holds the embedding, the last the output layer
    assert len(memory.stages) == 2 and memory.stages[0].state != memory.stages[1].state
