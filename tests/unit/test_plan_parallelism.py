"""tools/plan_parallelism.py and megatron/training/planner: every row's memory is
estimate_memory's for its flags, its flags parse back to the same configs, the bubble is the
schedule's, the step time is the documented model term by term, rows are ranked by MFU (ties:
memory), --json has the table's rows, Hugging Face configs and config files give the model their
flags give, and each bad input exits 1 with one message. Pure Python: no model is built."""
import json
import os
import shlex
import sys
import types

import pytest

from megatron.core.pipeline_parallel.simulate import simulate
from megatron.training.arguments import build_configs, parse_args
from megatron.training.memory.estimate import GIB, estimate_from_configs, estimate_memory
from megatron.training.planner import Cluster, Layout, estimate_step_time, plan, workload_from_flags
from megatron.training.planner.layouts import optimizer_setup
from megatron.training.planner.plan import layout_config, layout_memory
from megatron.training.planner.workload import without_layout_flags

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "tools"))
import plan_parallelism  # noqa: E402

LLAMA2_7B = shlex.split(
    "--num-layers 32 --hidden-size 4096 --ffn-hidden-size 11008 --num-attention-heads 32 "
    "--seq-length 4096 --max-position-embeddings 4096 --normalization RMSNorm "
    "--norm-epsilon 1e-5 --swiglu --position-embedding-type rope --disable-bias-linear "
    "--untie-embeddings-and-output-weights --attention-dropout 0 --hidden-dropout 0 "
    "--tokenizer-type NullTokenizer --vocab-size 32000 --lr 3e-4 --train-iters 10 --mock-data")
TINY_LLAMA = shlex.split(
    "--num-layers 4 --hidden-size 256 --ffn-hidden-size 688 --num-attention-heads 8 "
    "--group-query-attention --num-query-groups 4 --seq-length 512 "
    "--max-position-embeddings 512 --position-embedding-type rope --normalization RMSNorm "
    "--norm-epsilon 1e-5 --swiglu --disable-bias-linear --untie-embeddings-and-output-weights "
    "--attention-dropout 0 --hidden-dropout 0 --vocab-size 1000")
TINY_GPT2 = shlex.split(
    "--num-layers 4 --hidden-size 256 --num-attention-heads 8 --seq-length 512 "
    "--max-position-embeddings 512 --openai-gelu --vocab-size 1000")


def exact_memory(workload, row):
    """estimate_memory of a row's layout, called directly with all its microbatches."""
    lay = row.layout
    return estimate_memory(
        row.config, padded_vocab_size=row.padded_vocab_size, seq_length=workload.seq_length,
        micro_batch_size=lay.micro_batch_size, num_microbatches=lay.num_microbatches,
        setup=optimizer_setup(workload.args, lay),
        share_embeddings_and_output_weights=not workload.args.untie_embeddings_and_output_weights)


def configs_of(flags, world_size, vocab_size):
    """build_configs of a command line, with a tokenizer of ``vocab_size`` tokens."""
    return build_configs(parse_args(flags), world_size,
                         tokenizer=types.SimpleNamespace(vocab_size=vocab_size, eod=0))


@pytest.fixture(scope="module")
def llama_8x80():
    workload = workload_from_flags(LLAMA2_7B, global_batch_size=1024)
    return workload, plan(workload, Cluster(num_gpus=8))


def test_rows_hold_estimate_memory_and_misfits_are_absent(llama_8x80):
    workload, result = llama_8x80
    assert result.fitting == len(result.rows) > 100
    for row in result.rows[:8] + result.rows[8::50]:  # the top and a spread of the rest
        exact = exact_memory(workload, row)
        assert [s.total for s in exact.stages] == [s.total for s in row.memory.stages]
        assert row.memory.max_total <= (80 - 6) * GIB
    # TP 1, PP 1 holds all of LLaMA-2 7B's state: ~51 GB with the distributed optimizer
    # (6 + 12/8 bytes a parameter), ~121 GB without (18 bytes): only the former fits 80 GB.
    whole = {(r.layout.distributed_optimizer, r.layout.recompute) for r in result.rows
             if (r.layout.tensor_parallel, r.layout.pipeline_parallel) == (1, 1)}
    assert (True, None) in whole and all(sharded for sharded, _ in whole)
    unsharded = Layout(1, 1, None, 8, 1, 1024, "full", False)
    assert layout_memory(workload, unsharded, layout_config(workload, unsharded)).max_total \
        > 100e9
    # On 40 GB GPUs TP 1, PP 1 does not fit at all.
    small = plan(workload, Cluster(num_gpus=8, gpu_memory_gib=40), top=None)
    assert not [r for r in small.rows
                if (r.layout.tensor_parallel, r.layout.pipeline_parallel) == (1, 1)]
    assert all(r.memory.max_total <= 34 * GIB for r in small.rows) and small.rows
    sharded = Layout(1, 1, None, 8, 1, 1024, "full", True)
    assert layout_memory(workload, sharded, layout_config(workload, sharded)).max_total \
        > 34 * GIB


def test_fewer_microbatches_give_the_same_peak():
    """plan.schedule_microbatches: past 4 x PP microbatches the schedule's peak repeats."""
    workload = workload_from_flags(LLAMA2_7B, global_batch_size=512)
    for p, v, d in ((4, 2, 2), (4, None, 2), (2, 4, 4), (8, 2, 1)):
        lay = Layout(1, p, v, d, 1, 512, "selective", True)
        row = types.SimpleNamespace(layout=lay, config=layout_config(workload, lay),
                                    padded_vocab_size=32000)
        exact, fast = exact_memory(workload, row), layout_memory(workload, lay, row.config)
        assert lay.num_microbatches > 4 * p
        assert [(s.total, s.activations.in_flight) for s in exact.stages] == \
            [(s.total, s.activations.in_flight) for s in fast.stages]


def test_row_flags_parse_back_to_the_planned_configs(llama_8x80):
    workload, result = llama_8x80
    interleaved = next(r for r in result.rows if r.layout.virtual_pipeline)
    full = next(r for r in result.rows if r.layout.recompute == "full")
    for row in result.rows[:5] + [interleaved, full]:
        configs = configs_of(workload.flags + row.flags, 8, 32000)
        assert configs.transformer == row.config
        assert configs.training.data_parallel_size == row.layout.data_parallel
        assert estimate_from_configs(configs, 4096).max_total == row.memory.max_total
        if row.overlapped_optimizer_flags:  # Megatron-LLaMA's spelling of the same optimizer
            flags = [f for f in row.flags if f not in (
                "--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather")]
            odo = configs_of(workload.flags + flags + row.overlapped_optimizer_flags, 8, 32000)
            assert estimate_from_configs(odo, 4096).max_total == row.overlapped_optimizer_bytes
            assert abs(row.overlapped_optimizer_bytes - row.memory.max_total) < 2 ** 20


def test_bubble_is_the_schedules():
    workload = workload_from_flags(TINY_LLAMA, global_batch_size=16)
    result = plan(workload, Cluster(num_gpus=8), top=None)
    rows = [r for r in result.rows if r.layout.virtual_pipeline]
    assert rows
    for row in rows[:3]:
        lay = row.layout
        p, v, m = lay.pipeline_parallel, lay.virtual_pipeline, lay.num_microbatches
        assert row.step.bubble_fraction == pytest.approx((p - 1) / (v * m + p - 1), rel=1e-12)
        assert row.step.bubble_fraction == pytest.approx(simulate(p, m, v).bubble_fraction(),
                                                         rel=1e-9)
        assert row.step.bubble_s == pytest.approx((p - 1) / v * row.step.microbatch_s)


def test_step_time_by_hand():
    """LLaMA-2 7B, TP 2 x PP 2 x DP 2 on 4 nodes of 2 GPUs, micro batch 1, 8 microbatches,
    selective recomputation, distributed optimizer: every term of the documented model."""
    workload = workload_from_flags(LLAMA2_7B, global_batch_size=16)
    cluster = Cluster(num_gpus=8, gpus_per_node=2, peak_tflops=312, compute_efficiency=0.6,
                      intra_node_bandwidth_gbs=300, inter_node_bandwidth_gbs=10)
    lay = Layout(2, 2, None, 2, 1, 16, "selective", True)
    config = layout_config(workload, lay)
    memory = layout_memory(workload, lay, config)
    step = estimate_step_time(config, lay, cluster, memory, 4096, 32000)

    macs_per_token = (4096 * (4096 + 2 * 4096) + 2 * 4096 * 4096 + 4096 * 4096
                      + 3 * 4096 * 11008)  # QKV, QK^T and xV, projection, SwiGLU MLP
    layer = 6 * 4096 * macs_per_token  # one layer, one sequence, forward and backward
    logits = 6 * 4096 * 4096 * 32000
    redo = 16 * 4 * 4096 ** 2 * 32 * 128  # the attention core's forward again, 16 layers
    rate = 2 * 312e12 * 0.6  # a stage's two GPUs
    stages = [16 * layer, 16 * layer + logits]  # the last stage also computes the logits
    forward = [w / 3 / rate for w in stages]
    backward = [(2 * w / 3 + redo) / rate for w in stages]
    tp = 16 * 3 * 2 * (1 / 2) * 4096 * 4096 * 2 / 300e9  # 3 exposed all-reduce volumes
    p2p = 2 * (4096 * 4096 * 2 / 2) / 10e9  # an activation and a gradient, across nodes
    assert step.compute_s == pytest.approx(forward[1] + backward[1], rel=1e-12)
    assert step.tensor_parallel_s == pytest.approx(tp, rel=1e-12)
    assert step.pipeline_p2p_s == pytest.approx(p2p, rel=1e-12)
    microbatch = forward[1] + backward[1] + tp + p2p
    assert step.microbatch_s == pytest.approx(microbatch, rel=1e-12)
    assert step.bubble_s == pytest.approx(microbatch, rel=1e-12)  # (p - 1) / v = 1
    # DP spans 4 GPUs = 2 nodes: reduce-scatter fp32 grads, all-gather bf16 params at 10 GB/s,
    # hidden behind the last microbatch's backward / the first one's forward where they fit.
    exposed = []
    for stage, fwd, bwd in zip(memory.stages, forward, backward):
        reduce = 0.5 * stage.state.grads / 10e9
        gather = 0.5 * stage.state.params / 10e9
        exposed.append(max(0, reduce - bwd) + max(0, gather - fwd))
    assert max(exposed) > 0.01
    assert step.data_parallel_exposed_s == pytest.approx(max(exposed), rel=1e-12)
    total = 8 * microbatch + microbatch + max(exposed)
    assert step.step_s == pytest.approx(total, rel=1e-12)
    model_flops = 16 * (32 * layer + logits)
    assert step.model_flops == model_flops
    assert step.mfu == pytest.approx(model_flops / (total * 8 * 312e12), rel=1e-12)
    assert step.tokens_per_s_per_gpu == pytest.approx(16 * 4096 / (total * 8), rel=1e-12)
    assert step.bubble_fraction == pytest.approx(1 / 9)


def test_ranking(llama_8x80):
    _, result = llama_8x80
    rows = result.rows
    ties = 0
    for a, b in zip(rows, rows[1:]):
        assert round(a.step.mfu, 9) >= round(b.step.mfu, 9)
        if round(a.step.mfu, 9) == round(b.step.mfu, 9):
            ties += 1
            assert a.memory.max_total <= b.memory.max_total
    assert ties > 0  # e.g. the same layout with and without the distributed optimizer
    assert rows[0].step.mfu == max(r.step.mfu for r in rows)


def table_rows(text):
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.split()[:2] == ["#", "TP"])
    rows = []
    for line in lines[start + 1:]:
        if not line.strip():
            break
        rows.append(line.split())
    return rows


def test_json_has_the_tables_rows():
    argv = ["--num-gpus", "8", "--global-batch-size", "32", "--top", "6", "--"] + TINY_LLAMA
    table = table_rows(plan_parallelism.run(argv))
    data = json.loads(plan_parallelism.run(["--json"] + argv))
    assert len(table) == len(data["rows"]) == 6
    for cells, row in zip(table, data["rows"]):
        assert cells[1:7] == [str(row["tensor_parallel"]), str(row["context_parallel"]),
                              str(row["pipeline_parallel"]), str(row["virtual_pipeline"] or "-"),
                              str(row["data_parallel"]), str(row["micro_batch_size"])]
        assert cells[7] == (row["recompute"] or "none")
        assert cells[8].startswith("yes" if row["distributed_optimizer"] else "no")
        assert float(cells[9]) == pytest.approx(row["memory_bytes"] / GIB, abs=0.051)
        assert float(cells[13].rstrip("%")) == pytest.approx(100 * row["mfu"], abs=0.051)
        assert sum(s["total_bytes"] == row["memory_bytes"]
                   for s in row["memory"]["stages"]) >= 1
        assert row["command"].endswith(row["flags"])
    assert data["enumerated"] >= data["fitting"] >= 6


def model_config(flags, layout=Layout(2, 2, None, 2, 1, 16, "selective", True)):
    workload = workload_from_flags(flags, global_batch_size=16)
    return workload, layout_config(workload, layout)


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_hf_config_gives_the_models_flags(tmp_path, name):
    import transformers

    if name == "llama":
        config = transformers.LlamaConfig(
            hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=8,
            num_key_value_heads=4, vocab_size=1000, max_position_embeddings=512,
            rms_norm_eps=1e-5, tie_word_embeddings=False)
        flags = TINY_LLAMA
    else:
        config = transformers.GPT2Config(n_embd=256, n_layer=4, n_head=8, n_positions=512,
                                         vocab_size=1000)
        flags = TINY_GPT2
    config.save_pretrained(tmp_path)
    from_hf = plan_parallelism.flags_of_hf_config(str(tmp_path / "config.json"), None)
    hf_workload, hf_config = model_config(from_hf)
    workload, expected = model_config(flags)
    assert hf_config == expected
    assert hf_workload.vocab_size == 1000 and hf_workload.seq_length == 512
    assert hf_workload.args.untie_embeddings_and_output_weights == (name == "llama")
    argv = ["--num-gpus", "8", "--global-batch-size", "16", "--top", "3", "--json"]
    by_hf = json.loads(plan_parallelism.run(argv + ["--hf-config", str(tmp_path)]))
    by_flags = json.loads(plan_parallelism.run(argv + ["--"] + flags))
    assert [(r["flags"], r["memory_bytes"]) for r in by_hf["rows"]] == \
        [(r["flags"], r["memory_bytes"]) for r in by_flags["rows"]]


def test_config_file_and_layout_flags_are_replaced():
    path = os.path.join(ROOT, "shtools", "configs", "llama2_7b.sh")
    from_file = plan_parallelism.flags_of_config_file(path)
    assert "--tensor-model-parallel-size" in from_file  # TP=2 there; the planner drops it
    workload = workload_from_flags(from_file, vocab_size=32000)
    assert workload.global_batch_size == 1024 and workload.seq_length == 4096
    assert workload.args.tensor_model_parallel_size == 1
    assert not workload.args.sequence_parallel and workload.args.recompute_granularity is None
    lay = Layout(2, 2, None, 2, 1, 16, "selective", True)
    assert layout_config(workload, lay) == model_config(LLAMA2_7B, lay)[1]
    kept = without_layout_flags(shlex.split(
        "--recompute-activations --micro-batch-size=4 --overlapped-distributed-optimizer "
        "--reduce-bucket-size=2e8 --pipeline-model-parallel-size 2 --num-layers 8 --bf16"))
    # The flags that mean something only with a dropped one go too (dependencies.py's
    # table); one that did nothing in the input either stays, for parse_args to refuse.
    assert kept == ["--num-layers", "8"]
    assert without_layout_flags(shlex.split(
        "--fp16 --loss-scale 1024 --pipeline-model-parallel-size 2 --pipeline-schedule 1f1b "
        "--reduce-bucket-size 100 --num-layers 8")) == ["--reduce-bucket-size", "100",
                                                         "--num-layers", "8"]


def error_of(argv, capsys):
    assert plan_parallelism.main(argv) == 1
    out, err = capsys.readouterr()
    assert out == "" and len(err.strip().splitlines()) == 1, err
    assert err.startswith("plan_parallelism.py: error: ")
    return err


@pytest.mark.parametrize("args, message", [
    ([], "give the model once: --hf-config, --config-file or Megatron flags after --."),
    (["--config-file", "x.sh", "--", "--num-layers", "2"], "(got --config-file and Megatron "
                                                          "flags after --)"),
    (["--config-file", "/nonexistent/c.sh"], "--config-file /nonexistent/c.sh: no such file."),
    (["--hf-config", "/nonexistent/config.json"], "--hf-config /nonexistent/config.json: no "
                                                  "such file or directory."),
    (["--num-gpus", "12", "--"] + TINY_LLAMA, "--num-gpus 12 is not a multiple of "
                                              "--gpus-per-node 8: plan for whole nodes (16"),
    (["--compute-efficiency", "1.5", "--"] + TINY_LLAMA, "--compute-efficiency is a fraction"),
    (["--", "--num-layers", "4", "--hidden-size", "64", "--seq-length", "64",
      "--num-attention-heads", "4", "--vocab-size", "10", "--bogus"], "unknown flag --bogus"),
    (["--", "--num-layers", "4", "--hidden-size", "64", "--seq-length", "64",
      "--num-attention-heads", "4"], "the vocabulary size is unknown: pass --vocab-size N"),
    (["--global-batch-size", "0", "--"] + TINY_LLAMA, "--global-batch-size must be >= 1"),
    (["--num-gpus", "64", "--global-batch-size", "3", "--"] + TINY_LLAMA,
     "no layout of 64 GPUs splits this model and batch"),
    (["--gpu-memory-gib", "1", "--memory-reserve-gib", "0.999", "--"] + TINY_LLAMA,
     "no layout fits in 1 GiB per GPU minus the 0.999 GiB reserve: the smallest estimate is"),
])
def test_bad_input(capsys, args, message):
    base = ["--num-gpus", "8", "--global-batch-size", "16"]  # the later value wins
    assert message in error_of(base + args, capsys)


def test_bad_files(tmp_path, capsys):
    argv = ["--num-gpus", "8", "--global-batch-size", "16"]
    broken = tmp_path / "config.json"
    broken.write_text("{not json")
    assert "is not valid JSON" in error_of(argv + ["--hf-config", str(broken)], capsys)
    broken.write_text(json.dumps({"model_type": "bert", "architectures": ["BertModel"]}))
    assert "unsupported architecture: model_type 'bert'" in error_of(
        argv + ["--hf-config", str(broken)], capsys)
    script = tmp_path / "config.sh"
    script.write_text("TP=1\n")
    assert "must define the array CONFIG_FLAGS" in error_of(
        argv + ["--config-file", str(script)], capsys)
    script.write_text("CONFIG_FLAGS=(--num-layers 2 --hidden-size 64 --num-attention-heads 4 "
                      "--seq-length 32 --vocab-size 10)\n")
    assert "the global batch size is unknown: pass --global-batch-size" in error_of(
        ["--num-gpus", "8", "--config-file", str(script)], capsys)


def test_selective_recomputation_is_planned_only_where_attention_keeps_scores(llama_8x80):
    """With a fused kernel on CUDA selective recomputation is a no-op (the same memory as none,
    attention.py), so the planner offers it only where the math kernel keeps s x s scores."""
    _, fused = llama_8x80
    recomputes = {r.layout.recompute for r in fused.rows}
    assert "selective" not in recomputes and {None, "full"} <= recomputes
    # Head dim 300 (the planner plans in bf16): above flash's 256 and not a multiple of 8
    # (the memory-efficient kernel's alignment), so SDPA on CUDA runs the math kernel.
    flags = list(TINY_GPT2)
    flags[flags.index("--hidden-size") + 1] = "600"
    flags[flags.index("--num-attention-heads") + 1] = "2"
    math = plan(workload_from_flags(flags, global_batch_size=16), Cluster(num_gpus=2))
    assert "selective" in {r.layout.recompute for r in math.rows}


def test_hf_context_past_the_cap_is_planned_at_the_cap_with_a_warning(tmp_path, capsys):
    import transformers

    transformers.LlamaConfig(
        hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=8,
        num_key_value_heads=4, vocab_size=1000, max_position_embeddings=8192,
        tie_word_embeddings=False).save_pretrained(tmp_path)
    argv = ["--num-gpus", "8", "--global-batch-size", "16", "--top", "1", "--json",
            "--hf-config", str(tmp_path)]
    assert json.loads(plan_parallelism.run(argv))["seq_length"] == 4096
    assert capsys.readouterr().err == (
        f"plan_parallelism.py: warning: --hf-config {tmp_path}: the model's context is 8192 "
        "positions (max_position_embeddings), but the plan is for sequences of 4096, the "
        "default cap (memory and step time grow with the sequence, and long-context models "
        "are mostly pretrained shorter); pass --seq-length 8192 to plan for the full "
        "context.\n")
    full = json.loads(plan_parallelism.run(argv + ["--seq-length", "8192"]))
    assert full["seq_length"] == 8192 and capsys.readouterr().err == ""


# --- memory modes (issue 27) -------------------------------------------------------------------

@pytest.mark.parametrize("mode,sharded", [("zero2", True), ("fsdp2", False),
                                          ("fsdp2-zero2", False), ("cpu-offload", True),
                                          ("cpu-offload", False),
                                          ("fsdp2-cpu-offload", False)])
def test_memory_mode_flags_parse_back_to_the_planned_estimate(mode, sharded):
    """A mode's row flags build the configs (and estimate) the planner costed."""
    workload = workload_from_flags(TINY_LLAMA + shlex.split(
        "--lr 1e-4 --train-iters 1 --mock-data --tokenizer-type NullTokenizer"),
        global_batch_size=16)
    layout = Layout(2, 1, None, 4, 1, 16, None, sharded, memory_mode=mode)
    config = layout_config(workload, layout)
    memory = layout_memory(workload, layout, config)
    flags = layout.flags(workload.args.num_layers)
    configs = configs_of(workload.flags + flags, 8, 1000)
    assert configs.transformer == config
    estimate = estimate_from_configs(configs, 512)
    assert estimate.mode == memory.mode and estimate.max_total == memory.max_total
    stage = memory.stages[0]
    if mode == "cpu-offload":  # the optimizer's state is on the host, none on the device
        assert stage.host.total > 0 and stage.state.optimizer_states == 0
    elif mode == "fsdp2-cpu-offload":  # all of FSDP2's state on the host; gathered layers
        assert stage.host.total > 0 and stage.state.total == 0 and stage.transient_bytes > 0
    else:  # ZeRO-2: the full buckets of backward; FSDP2: the gathered layers and gradients
        assert stage.transient_bytes > 0 and stage.host.total == 0


def test_a_memory_mode_is_proposed_when_nothing_fits_otherwise():
    """LLaMA-2 7B, 8 GPUs, 8 sequences a step, 12 GiB per GPU: the smallest layout without a
    mode needs 14.4 GiB (TP 8, full recomputation); FSDP2 needs more (16 bytes a parameter
    over the 8 GPUs: 14 GB of state, at any TP/PP/DP), CPU offload's
    device share fits: it is proposed, and its flags printed."""
    workload = workload_from_flags(LLAMA2_7B, global_batch_size=8)
    cluster = Cluster(num_gpus=8, gpu_memory_gib=12, memory_reserve_gib=0)
    result = plan(workload, cluster, top=3)
    assert result.memory_mode == "cpu-offload" and result.rows
    for row in result.rows:
        assert row.layout.memory_mode == "cpu-offload"
        assert row.memory.max_total <= 12 * GIB and "--optimizer-cpu-offload" in row.flags
    argv = ["--num-gpus", "8", "--global-batch-size", "8", "--gpu-memory-gib", "12",
            "--memory-reserve-gib", "0", "--top", "2", "--"] + LLAMA2_7B
    text = plan_parallelism.run(argv)
    assert "every row uses --optimizer-cpu-offload" in text
    assert "--optimizer-cpu-offload" in text.split("flags (in place")[1]
    assert json.loads(plan_parallelism.run(["--json"] + argv))["memory_mode"] == "cpu-offload"
    # 4 GiB: only FSDP2 with its shards, gradients and optimizer on the host fits (the device
    # holds the gathered layers, their gradients and the activations); 1 GiB: nothing
    tiny = plan(workload, Cluster(num_gpus=8, gpu_memory_gib=4, memory_reserve_gib=0), top=1)
    assert tiny.memory_mode == "fsdp2-cpu-offload" and tiny.rows[0].memory.max_total <= 4 * GIB
    with pytest.raises(Exception, match="none fits with --use-torch-fsdp2"):
        plan(workload, Cluster(num_gpus=8, gpu_memory_gib=1, memory_reserve_gib=0))


@pytest.mark.parametrize("extra,efficiency", [([], 0.51), (["--torch-compile"], 0.51),
                                              (["--no-torch-compile"], 0.32),
                                              (["--compute-efficiency", "0.6"], 0.6)])
def test_default_efficiency_is_the_measured_one(extra, efficiency):
    """One GPU, no communication: the estimate is FLOPs / (peak x efficiency), and the default
    efficiency is what bench/gpu_step.py measured on an H100 (51 % with the compiled
    element-wise path CUDA runs by default, 32 % with --no-torch-compile; BENCHMARKS.md),
    not the assumed 60 % that put the 1.1B's 0.76 s eager step at 0.40 s. An explicit
    --compute-efficiency wins."""
    cli = extra if extra[:1] == ["--compute-efficiency"] else []
    model = [f for f in extra if f not in cli]
    argv = cli + ["--num-gpus", "1", "--global-batch-size", "4", "--json", "--"] + \
        TINY_LLAMA + model
    row = json.loads(plan_parallelism.run(argv))["rows"][0]
    assert row["mfu"] == pytest.approx(efficiency, rel=1e-9)


def test_an_fp8_model_is_planned_with_its_fp8_weight_copies_and_says_so():
    """The FP8 flags reach the planned config: each row's memory is the bf16 row's plus the
    cached FP8 weights (memory/fp8.py, exact), and the summary says the step time is not
    FP8's yet."""
    from megatron.training.memory.fp8 import fp8_weight_cache_bytes
    from megatron.training.memory.params import chunk_param_shapes
    from megatron.training.planner.plan import layout_config

    fp8_flags = ["--fp8-format", "e4m3", "--fp8-recipe", "rowwise"]
    plain = plan(workload_from_flags(LLAMA2_7B, global_batch_size=8), Cluster(num_gpus=8),
                 top=None)
    workload = workload_from_flags(LLAMA2_7B + fp8_flags, global_batch_size=8)
    fp8 = plan(workload, Cluster(num_gpus=8), top=None)
    plain_rows = {row.layout: row for row in plain.rows}
    compared = 0
    for row in fp8.rows:
        if row.layout in plain_rows and row.layout.pipeline_parallel == 1:
            config = layout_config(workload, row.layout)
            extra = fp8_weight_cache_bytes(config, chunk_param_shapes(config, 32000, 0))
            assert row.memory.max_total == plain_rows[row.layout].memory.max_total + extra
            compared += 1
    assert compared
    text = plan_parallelism.run(["--num-gpus", "8", "--top", "1", "--global-batch-size", "8",
                                 "--"] + LLAMA2_7B + fp8_flags)
    assert "FP8 e4m3 rowwise (mem GiB includes the FP8 weight copies" in text


def test_muon_plan_rows_hold_muons_state():
    """--optimizer muon: a row's memory is a Muon run's (one momentum per layer matrix: less
    than Adam's two on the same layout), and no mode Muon refuses is proposed."""
    muon = workload_from_flags(TINY_LLAMA + ["--optimizer", "muon"], global_batch_size=16)
    adam = workload_from_flags(TINY_LLAMA, global_batch_size=16)
    rows = plan(muon, Cluster(num_gpus=8), top=3).rows
    assert rows
    for row in rows:
        assert row.layout.memory_mode is None and row.overlapped_optimizer_flags is None
        assert row.memory.max_total == exact_memory(muon, row).max_total
        assert row.memory.max_total < exact_memory(adam, row).max_total
