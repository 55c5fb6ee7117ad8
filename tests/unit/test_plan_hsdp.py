"""The planner and HSDP (--num-distributed-optimizer-instances): on several nodes it also tries
one optimizer instance per node, costs its collectives as a reduce-scatter on the node's links
plus an all-reduce of 1 / (node's DP ranks) of the gradients across nodes, and its memory as
the optimizer sharded over one node; on one node it never proposes it. A planned HSDP row's
flags parse back to the estimate the planner costed."""
import dataclasses
import shlex

import pytest

from megatron.training.memory.estimate import estimate_from_configs
from megatron.training.planner import Cluster, Layout, estimate_step_time, plan, workload_from_flags
from megatron.training.planner.plan import layout_config, layout_memory
from tests.unit.test_plan_parallelism import LLAMA2_7B, TINY_LLAMA, configs_of

TWO_NODES = Cluster(num_gpus=16, gpus_per_node=8, inter_node_bandwidth_gbs=25)


def _cost(workload, layout, cluster):
    config = layout_config(workload, layout)
    memory = layout_memory(workload, layout, config)
    return memory, estimate_step_time(config, layout, cluster, memory, workload.seq_length,
                                      32000)


def test_hsdp_trades_optimizer_memory_for_cross_node_traffic():
    """TP 1 x DP 16 over two nodes: the flat ring moves (15/16) of the gradients at the
    inter-node bandwidth; HSDP moves 7/8 on the node's links and 1/8 across, and holds the
    optimizer sharded over 8 ranks instead of 16."""
    workload = workload_from_flags(LLAMA2_7B, global_batch_size=64)
    flat = Layout(1, 1, None, 16, 1, 64, "full", True)
    hsdp = dataclasses.replace(flat, instances=2)
    (flat_memory, flat_time), (hsdp_memory, hsdp_time) = (_cost(workload, lay, TWO_NODES)
                                                          for lay in (flat, hsdp))
    gradient_bytes = flat_memory.stages[0].state.grads
    intra, inter = (TWO_NODES.intra_node_bandwidth_gbs * 1e9,
                    TWO_NODES.inter_node_bandwidth_gbs * 1e9)  # bytes/s
    assert flat_time.data_parallel_s == pytest.approx(
        15 / 16 * gradient_bytes / inter + 15 / 16 * flat_memory.stages[0].state.params / inter)
    assert hsdp_time.data_parallel_s == pytest.approx(
        7 / 8 * gradient_bytes / intra + 2 * 1 / 2 * gradient_bytes / 8 / inter
        + 7 / 8 * hsdp_memory.stages[0].state.params / intra)
    assert hsdp_time.step_s < flat_time.step_s
    optimizer = [m.stages[0].state.optimizer_states for m in (flat_memory, hsdp_memory)]
    assert optimizer[1] == 2 * optimizer[0]


def test_planner_proposes_hsdp_on_two_nodes_and_never_on_one():
    workload = workload_from_flags(LLAMA2_7B, global_batch_size=64)
    two = plan(workload, TWO_NODES, top=None)
    assert two.rows[0].layout.instances == 2
    assert "--num-distributed-optimizer-instances" in two.rows[0].flags
    one = plan(workload, Cluster(num_gpus=8, gpus_per_node=8), top=None)
    assert one.rows and all(row.layout.instances == 1 for row in one.rows)


def test_a_command_lines_own_hsdp_flags_give_way_to_the_planned_layout():
    workload = workload_from_flags(TINY_LLAMA + [
        "--num-distributed-optimizer-instances", "4", "--use-torch-fsdp2",
        "--fsdp2-reduce-gradients-once"], global_batch_size=16)
    assert workload.flags == workload_from_flags(TINY_LLAMA, global_batch_size=16).flags


def test_hsdp_row_flags_parse_back_to_the_planned_estimate():
    workload = workload_from_flags(TINY_LLAMA + shlex.split(
        "--lr 1e-4 --train-iters 1 --mock-data --tokenizer-type NullTokenizer"),
        global_batch_size=16)
    for layout in (Layout(2, 1, None, 8, 1, 16, None, True, instances=2),
                   Layout(1, 2, None, 8, 1, 16, None, False, memory_mode="fsdp2",
                          instances=2)):
        memory = layout_memory(workload, layout, layout_config(workload, layout))
        flags = layout.flags(workload.args.num_layers)
        estimate = estimate_from_configs(configs_of(workload.flags + flags, 16, 1000), 512)
        assert estimate.max_total == memory.max_total > 0
        flat = dataclasses.replace(layout, instances=1)
        assert memory.max_total > layout_memory(workload, flat,
                                                layout_config(workload, flat)).max_total
