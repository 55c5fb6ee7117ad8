"""Bad flags, as a user types them: each is one ``error:`` line naming the flag, the value and
the valid range or the fix, exit 2, no traceback, no iteration. Sizes and probabilities are
checked before any rule that divides by them (no "negative dimension" from deep in a layer, no
"make it a multiple of 0"). Also the position-table rule (an error for learned positions, a
warning for RoPE) and the planner: a bad flag, and its capped context said out loud."""
import json
import os

import pytest

from tests.e2e.bad_inputs.harness import assert_clean_error, error_lines, run
from tests.e2e.runner import LLAMA, TINY

LLAMA_FLAGS = TINY + LLAMA  # RoPE, SwiGLU, RMSNorm: pretrain_llama.py
GPT_FLAGS = TINY  # learned absolute positions: pretrain_gpt.py

# (id, script, extra flags appended (argparse: the last value wins), env, fragments of the
# one error line). Each row is a different flag or rule.
CASES = [
    ("negative-hidden-size", "pretrain_llama.py", ["--hidden-size", "-8"], None,
     ["--hidden-size must be >= 1, got -8."]),
    ("zero-attention-heads", "pretrain_llama.py", ["--num-attention-heads", "0"], None,
     ["--num-attention-heads must be >= 1, got 0."]),
    ("negative-num-layers", "pretrain_llama.py", ["--num-layers", "-2"], None,
     ["--num-layers must be >= 1, got -2."]),
    ("zero-seq-length", "pretrain_llama.py", ["--seq-length", "0"], None,
     ["--seq-length must be >= 1, got 0."]),
    ("negative-ffn-hidden-size", "pretrain_llama.py", ["--ffn-hidden-size", "-48"], None,
     ["--ffn-hidden-size must be >= 1, got -48."]),
    ("zero-vocab-size", "pretrain_llama.py", ["--vocab-size", "0"], None,
     ["--vocab-size must be >= 1, got 0."]),
    ("hidden-dropout-above-one", "pretrain_llama.py", ["--hidden-dropout", "1.5"], None,
     ["--hidden-dropout must be in [0, 1), got 1.5", "0 = no dropout"]),
    ("negative-attention-dropout", "pretrain_llama.py", ["--attention-dropout", "-0.1"], None,
     ["--attention-dropout must be in [0, 1), got -0.1"]),
    ("zero-micro-batch", "pretrain_llama.py", ["--micro-batch-size", "0"], None,
     ["--micro-batch-size must be >= 1, got 0."]),
    ("global-batch-not-a-multiple", "pretrain_llama.py", ["--global-batch-size", "7"], None,
     ["--global-batch-size 7 is not divisible by --micro-batch-size 2",
      "make it a multiple of 2."]),
    ("negative-train-iters", "pretrain_llama.py", ["--train-iters", "-6"], None,
     ["--train-iters must be >= 1, got -6."]),
    ("negative-lr", "pretrain_llama.py", ["--lr", "-1e-3"], None,
     ["--lr must be >= 0, got -0.001", "the peak learning rate, e.g. 3e-4"]),
    ("nan-lr", "pretrain_llama.py", ["--lr", "nan"], None, ["--lr must be >= 0, got nan"]),
    ("negative-eval-iters", "pretrain_llama.py", ["--eval-iters", "-1"], None,
     ["--eval-iters must be >= 0, got -1 (0 = no evaluation)."]),
    ("adam-beta2-one", "pretrain_llama.py", ["--adam-beta2", "1"], None,
     ["--adam-beta2 must be in [0, 1), got 1.0"]),
    ("zero-seed", "pretrain_llama.py", ["--seed", "0"], None,
     ["--seed must be >= 1, got 0"]),
    ("zero-tensor-parallel-size", "pretrain_llama.py", ["--tensor-model-parallel-size", "0"],
     None, ["--tensor-model-parallel-size must be >= 1, got 0 (1 = no tensor parallelism)."]),
    ("negative-pipeline-parallel-size", "pretrain_llama.py",
     ["--pipeline-model-parallel-size", "-2"], None,
     ["--pipeline-model-parallel-size must be >= 1, got -2"]),
    ("world-size-not-a-multiple-of-tp", "pretrain_llama.py",
     ["--tensor-model-parallel-size", "2"], {"WORLD_SIZE": "3"},
     ["world size 3 is not divisible by --tensor-model-parallel-size 2",
      "launch a multiple of 2 processes."]),
    ("zero-context-parallel-size", "pretrain_llama.py", ["--context-parallel-size", "0"],
     None, ["--context-parallel-size must be >= 1, got 0 (1 = no context parallelism)."]),
    ("seq-not-a-multiple-of-2cp", "pretrain_llama.py",  # TINY's --seq-length is 16
     ["--context-parallel-size", "3"], {"WORLD_SIZE": "3"},
     ["--seq-length 16 is not divisible by 2 x --context-parallel-size 3 = 6",
      "use a sequence length that is a multiple of 6 or another CP size."]),
    ("cp-tokens-not-a-multiple-of-tp-under-sp", "pretrain_llama.py",
     ["--context-parallel-size", "2", "--tensor-model-parallel-size", "3",
      "--sequence-parallel"], {"WORLD_SIZE": "6"},
     ["--sequence-parallel with --context-parallel-size 2 splits each rank's 8 tokens over "
      "--tensor-model-parallel-size 3, which does not divide them",
      "use a sequence length that is a multiple of 12."]),
    ("world-size-not-a-multiple-of-tp-x-cp", "pretrain_llama.py",
     ["--context-parallel-size", "2", "--tensor-model-parallel-size", "2"],
     {"WORLD_SIZE": "6"},
     ["world size 6 is not divisible by --tensor-model-parallel-size 2 x "
      "--context-parallel-size 2 x --pipeline-model-parallel-size 1",
      "launch a multiple of 4 processes."]),
    ("unknown-cp-comm-type", "pretrain_llama.py", ["--cp-comm-type", "a2a"], None,
     ["--cp-comm-type", "a2a", "p2p", "all_gather"]),
    ("learned-positions-shorter-than-seq", "pretrain_gpt.py",
     ["--max-position-embeddings", "8"], None,
     ["--seq-length 16 is longer than --max-position-embeddings 8",
      "raise --max-position-embeddings to 16 or shorten --seq-length."]),
    ("unknown-flag-with-suggestion", "pretrain_llama.py", ["--hiden-size", "32"], None,
     ["unknown flag --hiden-size; did you mean --hidden-size"]),
    ("interleaved-schedule-without-virtual-stages", "pretrain_llama.py",
     ["--pipeline-model-parallel-size", "2", "--pipeline-schedule", "interleaved"], None,
     ["--pipeline-schedule interleaved needs virtual pipeline stages: add "
      "--num-layers-per-virtual-pipeline-stage"]),
    ("1f1b-schedule-with-virtual-stages", "pretrain_llama.py",
     ["--pipeline-model-parallel-size", "2", "--pipeline-schedule", "1f1b",
      "--num-layers-per-virtual-pipeline-stage", "1"], None,
     ["--pipeline-schedule 1f1b runs one model chunk per pipeline rank; drop "
      "--num-layers-per-virtual-pipeline-stage"]),
    ("zb-h1-schedule-with-virtual-stages", "pretrain_llama.py",
     ["--pipeline-model-parallel-size", "2", "--pipeline-schedule", "zb-h1",
      "--num-virtual-stages-per-pipeline-rank", "2"], None,
     ["--pipeline-schedule zb-h1 runs one model chunk per pipeline rank"]),
    ("zbv-schedule-without-pipeline", "pretrain_llama.py", ["--pipeline-schedule", "zbv"],
     None, ["--pipeline-schedule zbv needs --pipeline-model-parallel-size >= 2, got 1."]),
    ("zbv-schedule-with-other-virtual-size", "pretrain_llama.py",
     ["--pipeline-model-parallel-size", "2", "--pipeline-schedule", "zbv",
      "--num-virtual-stages-per-pipeline-rank", "4", "--num-layers", "8"], None,
     ["--pipeline-schedule zbv places 2 model chunks per pipeline rank (in a V)",
      "ask for 4; drop them."]),
    ("zbv-schedule-layers-not-in-2pp-stages", "pretrain_llama.py",
     ["--pipeline-model-parallel-size", "2", "--pipeline-schedule", "zbv", "--num-layers",
      "6"], None,
     ["--pipeline-schedule zbv cuts the model into 2 x --pipeline-model-parallel-size 2 = 4 "
      "virtual stages; --num-layers 6 is not a multiple of 4."]),
    ("zbv-schedule-with-first-stage-layers", "pretrain_llama.py",
     ["--pipeline-model-parallel-size", "2", "--pipeline-schedule", "zbv",
      "--decoder-first-pipeline-num-layers", "2", "--decoder-last-pipeline-num-layers", "2"],
     None, ["--pipeline-schedule zbv puts the first and the last stage on pipeline rank 0"]),
    ("zbv-schedule-with-too-few-microbatches", "pretrain_llama.py",  # TINY: 8 / (2 x 2) = 2
     ["--pipeline-model-parallel-size", "2", "--pipeline-schedule", "zbv"], {"WORLD_SIZE": "4"},
     ["the zbv schedule needs at least 2 x pipeline size = 4 microbatches, got 2",
      "(--global-batch-size 8 / (--micro-batch-size 2 x data-parallel size 2) microbatches)"]),
    ("interleaved-microbatches-not-a-multiple-of-pp", "pretrain_llama.py",
     ["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1",
      "--global-batch-size", "6"], {"WORLD_SIZE": "2"},
     ["the interleaved schedule needs the number of microbatches (3) to be a multiple of the "
      "pipeline-model-parallel size (2)"]),
    ("unknown-pipeline-schedule", "pretrain_llama.py", ["--pipeline-schedule", "gpipe"], None,
     ["--pipeline-schedule", "gpipe", "1f1b", "zbv"]),
    ("swiglu-ffn-of-zero", "pretrain_gpt.py",  # no --ffn-hidden-size: the default is 0
     ["--swiglu", "--hidden-size", "8", "--num-attention-heads", "2"], None,
     ["--swiglu with --hidden-size 8 gives an FFN size of 0; pass --ffn-hidden-size."]),
    # Mixture of experts: each refused at start, before any process group exists.
    ("moe-experts-not-divisible-by-ep", "pretrain_llama.py",
     ["--num-experts", "3", "--expert-model-parallel-size", "2"], {"WORLD_SIZE": "2"},
     ["--num-experts 3 is not divisible by --expert-model-parallel-size 2"]),
    ("moe-topk-above-experts", "pretrain_llama.py",
     ["--num-experts", "2", "--moe-router-topk", "3"], None,
     ["--moe-router-topk 3 is more than --num-experts 2"]),
    ("moe-ep-does-not-divide-world", "pretrain_llama.py",
     ["--num-experts", "4", "--expert-model-parallel-size", "4"], {"WORLD_SIZE": "2"},
     ["--expert-model-parallel-size 4 x expert tensor parallel size 1 = 4 does not divide the "
      "2 ranks of a pipeline stage"]),
    ("moe-tp-without-sequence-parallel", "pretrain_llama.py",
     ["--num-experts", "4", "--tensor-model-parallel-size", "2"], {"WORLD_SIZE": "2"},
     ["MoE with tensor_model_parallel_size 2 needs sequence_parallel", "--sequence-parallel"]),
    ("moe-gelu-experts", "pretrain_gpt.py", ["--num-experts", "4"], None,
     ["the MoE experts are gated FFNs ([gate; up] fc1 rows); activation 'gelu' is not: use "
      "--swiglu or --quick-geglu."]),
    ("moe-zero-experts", "pretrain_llama.py", ["--num-experts", "0"], None,
     ["--num-experts must be >= 1, got 0"]),
    # A flag that means something only with another, given without it (dependencies.py).
    ("moe-flag-without-experts", "pretrain_llama.py", ["--moe-router-topk", "4"], None,
     ["--moe-router-topk has no effect without --num-experts N: add --num-experts N or drop "
      "--moe-router-topk."]),
    ("expert-parallel-without-experts", "pretrain_llama.py",
     ["--expert-model-parallel-size", "2"], {"WORLD_SIZE": "2"},
     ["--expert-model-parallel-size has no effect without --num-experts N"]),
    ("pipeline-schedule-without-pipeline", "pretrain_llama.py", ["--pipeline-schedule", "1f1b"],
     None, ["--pipeline-schedule has no effect without --pipeline-model-parallel-size N (N >= 2)"
            ": add --pipeline-model-parallel-size N (N >= 2) or drop --pipeline-schedule."]),
    ("loss-scale-without-fp16", "pretrain_llama.py", ["--loss-scale", "1024"], None,
     ["--loss-scale has no effect without --fp16: add --fp16 or drop --loss-scale."]),
    ("fsdp2-flag-without-fsdp2", "pretrain_llama.py", ["--no-reshard-after-forward"], None,
     ["--no-reshard-after-forward has no effect without --use-torch-fsdp2"]),
    ("fsdp2-reduce-once-without-fsdp2", "pretrain_llama.py", ["--fsdp2-reduce-gradients-once"],
     None, ["--fsdp2-reduce-gradients-once has no effect without --use-torch-fsdp2"]),
    ("rotary-base-with-learned-positions", "pretrain_gpt.py", ["--rotary-base", "500000"], None,
     ["--rotary-base has no effect without --position-embedding-type rope"]),
    ("recompute-method-without-full", "pretrain_llama.py", ["--recompute-method=uniform"], None,
     ["--recompute-method has no effect without --recompute-granularity full"]),
    ("hsdp-zero-instances", "pretrain_llama.py",
     ["--num-distributed-optimizer-instances", "0"], None,
     ["--num-distributed-optimizer-instances must be >= 1, got 0"]),
    ("hsdp-without-a-sharded-optimizer", "pretrain_llama.py",
     ["--num-distributed-optimizer-instances", "2"], None,
     ["--num-distributed-optimizer-instances 2 replicates a sharded optimizer: add "
      "--use-distributed-optimizer or --use-torch-fsdp2"]),
    ("hsdp-instances-not-dividing-dp", "pretrain_llama.py",
     ["--num-distributed-optimizer-instances", "2", "--use-distributed-optimizer"], None,
     ["--num-distributed-optimizer-instances 2 does not divide the 1 data-parallel x "
      "context-parallel ranks; choose a divisor of it."]),
    ("moe-bad-layer-freq", "pretrain_llama.py",
     ["--num-experts", "4", "--moe-layer-freq", "[1,0]"], None,
     ["moe_layer_freq lists 2 layers, the model has 4"]),
]


def _argv(script, extra):
    return (LLAMA_FLAGS if script == "pretrain_llama.py" else GPT_FLAGS) + extra


@pytest.mark.parametrize("script, extra, env, fragments",
                         [case[1:] for case in CASES], ids=[case[0] for case in CASES])
def test_bad_flag_is_one_line_before_any_work(script, extra, env, fragments, tmp_path):
    proc = run(script, _argv(script, extra), env=env, cwd=str(tmp_path))
    assert_clean_error(proc, 2, *fragments)
    assert os.listdir(tmp_path) == []  # nothing written where it ran


def test_cases_are_distinct():
    assert len({tuple(case[2]) for case in CASES}) == len(CASES) >= 14


def test_rope_past_max_positions_trains_with_one_warning():
    flags = LLAMA_FLAGS + ["--max-position-embeddings", "8", "--train-iters", "1",
                           "--eval-iters", "0"]
    proc = run("pretrain_llama.py", flags)
    assert proc.returncode == 0, proc.stderr[-3000:]
    warnings = [line for line in proc.stderr.splitlines() if "--max-position-embeddings" in line]
    assert warnings == [
        "warning: --seq-length 16 is longer than --max-position-embeddings 8: RoPE computes "
        "every position, so training uses all 16, but the model records a context of 8 (an HF "
        "export's max_position_embeddings); pass --max-position-embeddings 16 to record the "
        "length trained on, or, to extend a model trained at 8 positions, --use-rope-scaling "
        "--rope-scaling-factor 2 --rope-original-max-position-embeddings 8."]
    assert " iteration        1/       1 |" in proc.stdout
    assert not error_lines(proc.stderr) and "Traceback" not in proc.stderr


PLANNER = "tools/plan_parallelism.py"
PLAN_RUN = ["--num-gpus", "8", "--global-batch-size", "16", "--top", "1"]
PLAN_MODEL = ["--num-layers", "4", "--hidden-size", "256", "--num-attention-heads", "8",
              "--seq-length", "512", "--vocab-size", "1000"]


@pytest.mark.parametrize("argv, fragments", [
    (PLAN_RUN + ["--"] + PLAN_MODEL + ["--hidden-size", "-8"],
     ["the model flags do not parse: --hidden-size must be >= 1, got -8."]),
    (PLAN_RUN + ["--num-gpus", "0", "--"] + PLAN_MODEL,
     ["--num-gpus (0) and --gpus-per-node (8) must be >= 1."]),
], ids=["planner-negative-hidden-size", "planner-zero-gpus"])
def test_planner_bad_flag(argv, fragments):
    proc = run(PLANNER, argv)
    line = assert_clean_error(proc, 1, *fragments)  # the planner's bad-input code is 1
    assert line.startswith("plan_parallelism.py: error: ") and proc.stdout == ""


def test_planner_says_when_it_caps_a_configs_context(tmp_path):
    config = dict(model_type="llama", architectures=["LlamaForCausalLM"], hidden_size=256,
                  intermediate_size=688, num_hidden_layers=4, num_attention_heads=8,
                  num_key_value_heads=4, vocab_size=1000, max_position_embeddings=8192,
                  rms_norm_eps=1e-5, tie_word_embeddings=False, hidden_act="silu")
    (tmp_path / "config.json").write_text(json.dumps(config))
    proc = run(PLANNER, PLAN_RUN + ["--json", "--hf-config", str(tmp_path)])
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.splitlines() == [
        f"plan_parallelism.py: warning: --hf-config {tmp_path}: the model's context is 8192 "
        "positions (max_position_embeddings), but the plan is for sequences of 4096, the "
        "default cap (memory and step time grow with the sequence, and long-context models "
        "are mostly pretrained shorter); pass --seq-length 8192 to plan for the full "
        "context."]
    assert json.loads(proc.stdout)["seq_length"] == 4096
