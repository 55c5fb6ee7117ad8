"""The planner on a mixture-of-experts model: it enumerates EP (divisors of the experts whose
EP x expert TP divides a stage's ranks), proposes EP > 1 where the experts do not fit one
rank, prints --expert-model-parallel-size, the printed flags parse back to the same configs
and memory estimate, and the step time carries the all-to-all term by its formula
(planner/moe_cost.py). Pure Python: no model is built."""
import dataclasses
import functools
import json
import shlex

from megatron.training.memory.estimate import GIB, estimate_from_configs
from megatron.training.memory.moe import is_moe_layer
from megatron.training.memory.params import chunk_span
from megatron.training.planner import Cluster, plan, workload_from_flags
from megatron.training.planner.layouts import expert_parallel_sizes
from megatron.training.planner.plan import layout_config, layout_memory
from megatron.training.planner.step_time import GB
from tests.unit.test_plan_parallelism import (
    TINY_LLAMA,
    configs_of,
    exact_memory,
    plan_parallelism,
)

EXPERTS, TOPK, HIDDEN = 64, 2, 512
MOE = shlex.split(
    f"--num-layers 4 --hidden-size {HIDDEN} --ffn-hidden-size 1024 --num-attention-heads 8 "
    "--seq-length 1024 --max-position-embeddings 1024 --position-embedding-type rope "
    "--normalization RMSNorm --swiglu --disable-bias-linear "
    "--untie-embeddings-and-output-weights --attention-dropout 0 --hidden-dropout 0 "
    f"--vocab-size 1000 --num-experts {EXPERTS} --moe-ffn-hidden-size 1024 "
    f"--moe-router-topk {TOPK} --lr 1e-4 --train-iters 1 --tokenizer-type NullTokenizer "
    "--mock-data")
# 8 single-GPU nodes (TP 1 only) with 1 GiB each: the experts (4 x 64 x 3 x 512 x 1024
# parameters) fit no EP=1 layout, PP included.
CLUSTER = Cluster(num_gpus=8, gpus_per_node=1, gpu_memory_gib=1.0, memory_reserve_gib=0.1)


@functools.lru_cache(maxsize=1)
def _plan():
    workload = workload_from_flags(MOE, global_batch_size=32)
    return workload, plan(workload, CLUSTER)


def test_too_big_for_one_rank_gets_expert_parallelism():
    workload, result = _plan()
    budget = (CLUSTER.gpu_memory_gib - CLUSTER.memory_reserve_gib) * GIB
    assert result.rows and all(row.layout.expert_parallel > 1 for row in result.rows)
    top = result.rows[0]
    i = top.flags.index("--expert-model-parallel-size")
    assert int(top.flags[i + 1]) == top.layout.expert_parallel
    # the same layout at EP=1 does not fit
    dense_experts = dataclasses.replace(top.layout, expert_parallel=1)
    memory = layout_memory(workload, dense_experts, layout_config(workload, dense_experts))
    assert memory.max_total > budget >= top.memory.max_total


def test_printed_flags_parse_back_to_the_same_estimate():
    workload, result = _plan()
    for row in result.rows[:3]:
        configs = configs_of(workload.flags + row.flags, CLUSTER.num_gpus, 1000)
        t = configs.transformer
        assert t.expert_model_parallel_size == row.layout.expert_parallel
        assert t.moe.num_moe_experts == EXPERTS
        parsed = estimate_from_configs(configs, workload.seq_length)
        assert parsed.max_total == exact_memory(workload, row).max_total


def test_alltoall_term_is_its_formula():
    workload, result = _plan()
    row = next(r for r in result.rows if r.layout.pipeline_parallel == 1)
    lay, config = row.layout, row.config
    ep, s = lay.expert_parallel, workload.seq_length
    tokens = lay.micro_batch_size * s  # TP 1, CP 1
    passes = 4 if lay.recompute == "full" else 3
    per_layer = passes * 2 * TOPK * tokens * HIDDEN * 2 * (ep - 1) / ep / (
        CLUSTER.inter_node_bandwidth_gbs * GB)  # EP ranks on different nodes
    span = chunk_span(config, 0)
    moe_layers = sum(is_moe_layer(config, i) for i in range(span.start, span.end))
    assert moe_layers == 4
    assert abs(row.step.expert_parallel_s - moe_layers * per_layer) <= 1e-12


def test_expert_parallel_sizes():
    workload = workload_from_flags(MOE, global_batch_size=32)
    args = workload.args
    assert expert_parallel_sizes(args, 8, 1) == [1, 2, 4, 8]
    assert expert_parallel_sizes(args, 8, 2) == [1, 2, 4]  # EP x ETP (= TP 2) divides 8
    assert expert_parallel_sizes(args, 6, 1) == [1, 2]  # divisors of 64 that divide 6
    dense = workload_from_flags(TINY_LLAMA, global_batch_size=8).args
    assert expert_parallel_sizes(dense, 8, 1) == [1]


def test_dense_models_get_no_expert_flag():
    workload = workload_from_flags(TINY_LLAMA, global_batch_size=8)
    result = plan(workload, Cluster(num_gpus=2, gpus_per_node=2), top=5)
    assert all("--expert-model-parallel-size" not in row.flags for row in result.rows)
    assert all(row.step.expert_parallel_s == 0 for row in result.rows)


def test_tool_prints_the_ep_column_and_flags():
    argv = ["--num-gpus", "8", "--gpus-per-node", "1", "--gpu-memory-gib", "1",
            "--memory-reserve-gib", "0.1", "--global-batch-size", "32", "--top", "2", "--"]
    out = plan_parallelism.run(argv + MOE)
    header = next(line for line in out.splitlines() if line.lstrip().startswith("#  TP"))
    assert header.split()[6] == "EP"
    data = json.loads(plan_parallelism.run(["--json"] + argv + MOE))
    for row in data["rows"]:
        assert f"--expert-model-parallel-size {row['expert_parallel']}" in row["flags"]


def test_tool_names_the_experts_says_why_and_prints_a_whole_command():
    """The summary names the experts and top-k; each MoE choice (EP, PP) is explained by the
    best layout on its other side, or that none fits there (here no EP 1 layout fits: the
    first test); the whole command of #1 parses back to #1's configs."""
    argv = ["--num-gpus", "8", "--gpus-per-node", "1", "--gpu-memory-gib", "1",
            "--memory-reserve-gib", "0.1", "--global-batch-size", "32", "--top", "2", "--"]
    out = plan_parallelism.run(argv + MOE).splitlines()
    assert f"{EXPERTS} experts (top-{TOPK}, expert FFN 1024)" in out[0]
    workload, result = _plan()
    best = result.rows[0]
    ep = next(line for line in out if line.startswith("why EP "))
    assert ep.startswith(f"why EP {best.layout.expert_parallel}: no layout with EP 1 fits")
    pp = next(line for line in out if line.startswith("why PP "))
    other = result.best_by_choice.get("PP > 1" if best.layout.pipeline_parallel == 1
                                      else "PP 1")
    assert (f"{other.step.mfu:.1%} MFU" in pp) if other else "fits" in pp
    command = shlex.split(next(line for line in out if line.startswith(
        "the whole command of #1: ")).split(": ", 1)[1])
    assert command[:4] == ["torchrun", "--nproc-per-node", "1", "--nnodes"]
    script = command.index("pretrain_llama.py")
    configs = configs_of(command[script + 1:], CLUSTER.num_gpus, 1000)
    assert configs.transformer == best.config


def test_moe_models_are_offered_context_parallelism():
    """MoE composes with CP (each CP rank routes its own chunks): long-sequence CP sizes are
    tried for MoE models as for dense ones."""
    from megatron.training.planner.layouts import context_parallel_sizes

    args = workload_from_flags(MOE, global_batch_size=32).args
    assert context_parallel_sizes(args, 8, 1, with_cp=True) == [1, 2, 4, 8]
    assert context_parallel_sizes(args, 8, 1, with_cp=False) == [1]
