"""The planner with context parallelism: for a long sequence its best row splits the sequence
(and prints --context-parallel-size with --cp-comm-type p2p, flags that parse back to the
planned config and memory); for a short one it does not, unless nothing fits without CP; the
step time's CP terms by hand. Pure Python: no model is built."""
import shlex

import pytest

from megatron.training.memory.activations import ActivationSetup, cp_kv_in_flight_bytes
from megatron.training.memory.estimate import estimate_from_configs
from megatron.training.planner import Cluster, Layout, estimate_step_time, plan, workload_from_flags
from megatron.training.planner.layouts import CP_MIN_SEQ_LENGTH
from megatron.training.planner.plan import layout_config, layout_memory
from megatron.training.planner.report import format_table, row_dict
from tests.unit.test_plan_parallelism import LLAMA2_7B, TINY_LLAMA, configs_of, table_rows


def with_seq_length(flags, seq_length):
    flags = list(flags)
    for name in ("--seq-length", "--max-position-embeddings"):
        flags[flags.index(name) + 1] = str(seq_length)
    return flags


@pytest.fixture(scope="module")
def llama_64k():
    """LLaMA-2 7B at 64K tokens a sequence on one node of 8 A100-80GB."""
    workload = workload_from_flags(with_seq_length(LLAMA2_7B, 65536), global_batch_size=16)
    cluster = Cluster(num_gpus=8)
    return workload, cluster, plan(workload, cluster)


def test_long_sequence_top_row_splits_the_sequence(llama_64k):
    workload, cluster, result = llama_64k
    top = result.rows[0]
    cp = top.layout.context_parallel
    assert cp > 1 and 65536 % (2 * cp) == 0
    assert shlex.join(["--context-parallel-size", str(cp), "--cp-comm-type", "p2p"]) in \
        shlex.join(top.flags)
    # The flags build the planned config, and its estimate (optimizer sharded over DP x CP).
    configs = configs_of(workload.flags + top.flags, 8, 32000)
    assert configs.transformer == top.config
    assert (top.config.context_parallel_size, top.config.cp_comm_type) == (cp, "p2p")
    assert configs.training.data_parallel_size == top.layout.data_parallel
    assert estimate_from_configs(configs, 65536).max_total == top.memory.max_total
    # The ring's K/V block in flight is in the memory column.
    setup = ActivationSetup(65536, top.layout.micro_batch_size, 2, top.padded_vocab_size)
    in_flight = cp_kv_in_flight_bytes(top.config, setup)
    assert in_flight > 0
    assert all(s.activations.cp_kv_in_flight_bytes == in_flight for s in top.memory.stages)
    # The table prints the CP column and the flag.
    text = format_table(result, cluster, workload)
    assert table_rows(text)[0][2] == str(cp)
    assert f"#1: {shlex.join(top.flags)}" in text and "--context-parallel-size" in text
    assert row_dict(top, workload)["context_parallel"] == cp
    # Without CP the best this model can do here is slower (more recomputation or TP).
    no_cp = [r for r in result.rows if r.layout.context_parallel == 1]
    assert not no_cp or no_cp[0].step.mfu < top.step.mfu


def test_short_sequences_are_planned_without_context_parallelism():
    """Below CP_MIN_SEQ_LENGTH CP is not tried where layouts fit without it."""
    workload = workload_from_flags(TINY_LLAMA, global_batch_size=16)
    assert workload.seq_length < CP_MIN_SEQ_LENGTH
    result = plan(workload, Cluster(num_gpus=8), top=None)
    assert result.rows and {r.layout.context_parallel for r in result.rows} == {1}
    assert not any("--context-parallel-size" in r.flags for r in result.rows)


def test_context_parallelism_is_tried_when_nothing_fits_without_it():
    """At 4096 tokens (< CP_MIN_SEQ_LENGTH) TINY_LLAMA needs 0.0203 GiB a GPU at best without
    CP (TP <= 4: its 4 query groups; the compiled path's bf16 logits), 0.0184 GiB with CP 2:
    a 0.019 GiB budget fits only CP."""
    workload = workload_from_flags(with_seq_length(TINY_LLAMA, 4096), global_batch_size=16)
    roomy = plan(workload, Cluster(num_gpus=8), top=None)
    assert {r.layout.context_parallel for r in roomy.rows} == {1}
    tight = plan(workload, Cluster(num_gpus=8, gpu_memory_gib=1.0, memory_reserve_gib=0.981),
                 top=None)
    assert tight.rows and all(r.layout.context_parallel > 1 for r in tight.rows)
    assert "--context-parallel-size" in tight.rows[0].flags


def test_step_time_by_hand_with_context_parallelism():
    """LLaMA-2 7B at 16K tokens, TP 2 x CP 2 x DP 2 on 4 nodes of 2 GPUs (the CP group of 4
    ranks crosses nodes: 10 GB/s), micro batch 1, 8 microbatches, distributed optimizer."""
    s = 16384
    workload = workload_from_flags(with_seq_length(LLAMA2_7B, s), global_batch_size=16)
    cluster = Cluster(num_gpus=8, gpus_per_node=2, peak_tflops=312, compute_efficiency=0.6,
                      intra_node_bandwidth_gbs=300, inter_node_bandwidth_gbs=10)
    lay = Layout(2, 1, None, 2, 1, 16, None, True, context_parallel=2)
    config = layout_config(workload, lay)
    memory = layout_memory(workload, lay, config)
    step = estimate_step_time(config, lay, cluster, memory, s, 32000)

    macs_per_token = (4096 * 3 * 4096 + 2 * s * 4096 + 4096 * 4096 + 3 * 4096 * 11008)
    work = 32 * 6 * s * macs_per_token + 6 * s * 4096 * 32000  # layers and logits
    rate = 2 * 2 * 312e12 * 0.6  # the microbatch is spread over TP x CP = 4 GPUs
    forward, backward = work / 3 / rate, 2 * work / 3 / rate
    tp = 32 * 3 * 2 * (1 / 2) * (s // 2) * 4096 * 2 / 300e9  # on s/CP tokens
    # Ring (context_parallel/ring.py): one K/V block of s/2 tokens, 16 heads a TP rank, bf16,
    # from the other CP rank, forward and again backward; in backward each block's dK/dV in
    # fp32 goes 2 hops, the first hidden where it can be, the last (home) exposed.
    kv_hop = 2 * (s // 2) * 16 * 128 * 2 / 10e9
    dkv_hop = 2 * kv_hop
    attention = 4 * s * s * 32 * 128 / 4 / (312e12 * 0.6)
    assert kv_hop > attention  # across nodes the ring is partly exposed
    ring = 32 * (kv_hop + kv_hop + 2 * dkv_hop)
    ring_exposed = 32 * ((kv_hop - attention) + (kv_hop + dkv_hop - 2 * attention) + dkv_hop)
    assert step.context_parallel_s == pytest.approx(ring, rel=1e-12)
    assert step.context_parallel_exposed_s == pytest.approx(ring_exposed, rel=1e-12)
    assert step.compute_s == pytest.approx(forward + backward, rel=1e-12)
    assert step.tensor_parallel_s == pytest.approx(tp, rel=1e-12)
    microbatch = forward + backward + tp + ring_exposed
    assert step.microbatch_s == pytest.approx(microbatch, rel=1e-12)
    # Gradients reduce-scattered and params all-gathered over DP x CP = 4 ranks across nodes.
    stage = memory.stages[0]
    exposed = max(0, 0.75 * stage.state.grads / 10e9 - backward) + \
        max(0, 0.75 * stage.state.params / 10e9 - forward)
    assert step.data_parallel_exposed_s == pytest.approx(exposed, rel=1e-12)
    assert step.step_s == pytest.approx(8 * microbatch + exposed, rel=1e-12)
    assert step.model_flops == 16 * work  # Megatron's count: unchanged by CP
    assert step.mfu == pytest.approx(16 * work / (step.step_s * 8 * 312e12), rel=1e-12)


def test_context_parallelism_costs_its_last_gradient_hop_so_no_cp_wins_a_tie():
    """LLaMA-2 7B at 16K on one node of 8, TP 2: CP 2 x DP 2 against CP 1 x DP 4. The ring's
    forward and backward hops hide behind attention, but the last dK/dV hop of every layer
    cannot (ring.py waits for it after the last block), so CP 2 is slower by exactly 32 such
    hops a microbatch, 8 microbatches a step; before this costing the two tied, and the tie
    went to CP (less memory)."""
    s = 16384
    workload = workload_from_flags(with_seq_length(LLAMA2_7B, s), global_batch_size=16)
    cluster = Cluster(num_gpus=8)
    times = {}
    for cp, dp in ((1, 4), (2, 2)):
        lay = Layout(2, 1, None, dp, 1, 16, None, True, context_parallel=cp)
        config = layout_config(workload, lay)
        times[cp] = estimate_step_time(config, lay, cluster, layout_memory(workload, lay, config),
                                       s, 32000)
    dkv_hop = 2 * (s // 2) * 16 * 128 * 4 / 300e9  # fp32 dK/dV of s/2 tokens, in the node
    assert times[2].context_parallel_exposed_s == pytest.approx(32 * dkv_hop, rel=1e-12)
    assert times[1].data_parallel_exposed_s == times[2].data_parallel_exposed_s == 0
    assert (times[1].num_microbatches, times[2].num_microbatches) == (4, 8)
    # The rest is the same work: half a sequence per microbatch, twice the microbatches.
    assert times[2].step_s - times[1].step_s == pytest.approx(8 * 32 * dkv_hop, rel=1e-6)
    # The planner's order: each CP 2 row without a pipeline ranks below its CP 1 twin (with
    # one, CP's twice as many half-length microbatches halve the bubble: a real gain).
    result = plan(workload, cluster, top=None)

    def key(lay, cp, dp):
        return (lay.tensor_parallel, lay.pipeline_parallel, lay.virtual_pipeline, lay.schedule,
                lay.micro_batch_size, lay.recompute, lay.distributed_optimizer,
                lay.memory_mode, cp, dp)

    rank = {key(r.layout, r.layout.context_parallel, r.layout.data_parallel): i
            for i, r in enumerate(result.rows)}
    twins = [(i, rank[key(r.layout, 1, 2 * r.layout.data_parallel)])
             for i, r in enumerate(result.rows) if r.layout.context_parallel == 2
             and r.layout.pipeline_parallel == 1 and key(r.layout, 1, 2 * r.layout.data_parallel) in rank]
    assert twins and all(cp1 < cp2 for cp2, cp1 in twins), twins
