"""A checkpoint loaded under other architecture flags than its saved args record (issue 38):
a LLaMA-3 style checkpoint (RoPE base 500000 with LLaMA-3.1 scaling) loaded without them,
or with another --norm-epsilon, is one error line before iteration 1, in both formats and
with --finetune too; --use-checkpoint-args takes the checkpoint's architecture instead."""
import re

import pytest

from tests.e2e.bad_inputs.harness import (
    ITERATION,
    assert_clean_error,
    listing,
    run,
    run_torchrun,
)
from tests.e2e.runner import LLAMA, TINY, without

FLAGS = without(TINY, "--train-iters", "--eval-interval") + LLAMA + [
    "--train-iters", "2", "--eval-interval", "100"]
LLAMA3 = ["--rotary-base", "500000", "--use-rope-scaling"]
CONVERT = "tools/checkpoint/convert.py"
# What --use-checkpoint-args supplies: every architecture flag of FLAGS (with a value, or a
# switch) is left off the command line.
VALUED = ("--num-layers", "--hidden-size", "--num-attention-heads", "--ffn-hidden-size",
          "--max-position-embeddings", "--normalization", "--position-embedding-type")
SWITCHES = ("--swiglu", "--disable-bias-linear", "--untie-embeddings-and-output-weights")


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A tiny LLaMA-3 style checkpoint of iteration 2 (weights only) in the sharded format,
    and its copy in the torch format."""
    root = tmp_path_factory.mktemp("llama3")
    proc = run("pretrain_llama.py", FLAGS + LLAMA3 + ["--save", root / "torch_dist",
                                                      "--no-save-optim"])
    assert proc.returncode == 0, proc.stderr[-2000:]
    proc = run(CONVERT, ["megatron-to-megatron", "--load", root / "torch_dist",
                         "--save", root / "torch", "--ckpt-format", "torch"])
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert (root / "torch" / "iter_0000002" / "mp_rank_00").is_dir()
    return root


def _refused(saved, fmt, flags, *fragments):
    ckpt = saved / fmt
    before = listing(ckpt)
    proc = run("pretrain_llama.py", flags + ["--load", ckpt, "--no-load-optim"])
    line = assert_clean_error(proc, 1, f"the checkpoint at {ckpt / 'iter_0000002'} was "
                              f"trained with", *fragments)
    assert listing(ckpt) == before
    return line


@pytest.mark.parametrize("fmt", ["torch_dist", "torch"])
def test_llama3_checkpoint_without_its_rotary_base_is_one_error(saved, fmt):
    _refused(saved, fmt, FLAGS + ["--use-rope-scaling"],
             "trained with --rotary-base 500000, this run has --rotary-base 10000",
             "pass the checkpoint's value, or --use-checkpoint-args to take the checkpoint's "
             "architecture")


def test_llama3_checkpoint_without_its_rope_scaling_is_one_error(saved):
    _refused(saved, "torch_dist", FLAGS + ["--rotary-base", "500000"],
             "trained with --use-rope-scaling, this run has no --use-rope-scaling")


@pytest.mark.parametrize("fmt", ["torch_dist", "torch"])
def test_another_norm_epsilon_is_one_error(saved, fmt):
    _refused(saved, fmt, FLAGS + LLAMA3 + ["--norm-epsilon", "1e-6"],
             "trained with --norm-epsilon 1e-05, this run has --norm-epsilon 1e-06")


def test_finetune_does_not_waive_the_check(saved):
    _refused(saved, "torch_dist", FLAGS + ["--use-rope-scaling", "--finetune"],
             "--rotary-base 500000, this run has --rotary-base 10000")


def test_the_same_flags_at_another_layout_load(saved):
    """Layout flags are not architecture: the TP=1 checkpoint loads at TP=2 (resharded)."""
    proc = run_torchrun("pretrain_llama.py", FLAGS + LLAMA3 + [
        "--load", saved / "torch_dist", "--finetune", "--train-iters", "1",
        "--tensor-model-parallel-size", "2"], nproc=2)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resharded from TP=1" in proc.stdout and ITERATION.search(proc.stdout)


def _without_architecture(flags):
    return [f for f in without(flags, *VALUED) if f not in SWITCHES]


def _first_loss(proc):
    match = re.search(r"lm loss: ([0-9.E+-]+)", proc.stdout)
    assert match, proc.stdout[-2000:]
    return float(match.group(1))


@pytest.mark.parametrize("fmt", ["torch_dist", "torch"])
def test_use_checkpoint_args_trains_with_the_checkpoints_architecture(saved, fmt):
    """Without any architecture flag, --use-checkpoint-args builds the checkpoint's model and
    says what it took; its first loss is the one of the same fine-tune given every flag."""
    common = ["--load", saved / fmt, "--finetune", "--train-iters", "1"]
    proc = run("pretrain_llama.py", _without_architecture(FLAGS) + common +
               ["--use-checkpoint-args"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    took = [ln for ln in proc.stdout.splitlines() if ln.startswith("--use-checkpoint-args:")]
    assert len(took) == 1, proc.stdout[-3000:]
    assert f"took the architecture of the checkpoint at {saved / fmt / 'iter_0000002'}" in \
        took[0]
    for flag in ("--num-layers 4", "--hidden-size 32", "--ffn-hidden-size 48",
                 "--position-embedding-type rope", "--rotary-base 500000",
                 "--use-rope-scaling", "--normalization RMSNorm", "--swiglu",
                 "--disable-bias-linear", "--untie-embeddings-and-output-weights"):
        assert flag in took[0], (flag, took[0])
    assert ITERATION.search(proc.stdout)
    reference = run("pretrain_llama.py", FLAGS + LLAMA3 + common)
    assert reference.returncode == 0, reference.stderr[-3000:]
    assert _first_loss(proc) == _first_loss(reference)


def test_use_checkpoint_args_overrides_the_command_line(saved):
    """The checkpoint's settings win over flags given anyway (Megatron's rule)."""
    proc = run("pretrain_llama.py", FLAGS + ["--norm-epsilon", "1e-6", "--use-checkpoint-args",
                                             "--load", saved / "torch_dist", "--finetune",
                                             "--train-iters", "1"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "--norm-epsilon 1e-05" in proc.stdout and "--rotary-base 500000" in proc.stdout


def test_use_checkpoint_args_without_load(tmp_path):
    proc = run("pretrain_llama.py", _without_architecture(FLAGS) + ["--use-checkpoint-args"])
    assert_clean_error(proc, 2, "--use-checkpoint-args", "add --load DIR")
