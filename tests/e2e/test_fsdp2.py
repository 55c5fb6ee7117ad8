"""--use-torch-fsdp2 through pretrain_llama.py on CPU (gloo, fp32): 10 iterations at DP 2 and
4, TP=2 x DP=2 with sequence parallelism, and context parallelism (CP=2 x DP=2, TP=2 x CP=2),
ZeRO-3 (default) and ZeRO-2 (--no-reshard-after-forward), against one process.

The layouts differ from one process only in the order of the gradient sums (per rank, then
the reduce-scatter over DP; the norm shard by shard), so the losses agree to 1e-6: the log's
last printed digit (7 significant digits, values near 4), i.e. at most one unit of rounding.
"""
import json
import math
import re

import pytest

from tests.e2e.bad_inputs.harness import run as run_forked
from tests.e2e.runner import LLAMA, TINY, finish, parse_losses, run_script, start_script
from tests.e2e.test_checkpoint_resume import (
    _assert_bitwise,
    _flags,
    _is_sharded,
    _iteration_losses,
    _straight_then_resume,
)
from tests.shared_fixture import once_per_run

TOL = 1e-6 + 1e-12  # one unit in the printed 7th digit, and the float error of the subtraction
FLAGS = TINY + LLAMA + ["--train-iters", "10"]
ZERO2 = ["--no-reshard-after-forward"]
# fp16: the loss scale halves after the first steps overflow (DP2 skips iterations 1 and 2);
# a resume that lost the scaler's state would start from 2^20 again and skip iteration 3.
FP16 = ["--fp16", "--initial-loss-scale", "1048576"]


@pytest.fixture(scope="module")
@once_per_run
def single_process():
    losses, valid = parse_losses(run_script("pretrain_llama.py", FLAGS))
    # validations at iterations 3, 6 and 9 (--eval-interval 3), and after training at 10
    assert len(losses) == 10 and len(valid) == 4
    return losses + valid


def _check_runs(reference, runs):
    """Start all runs at once (they share the cost of importing torch), then compare each."""
    started = {name: start_script("pretrain_llama.py", FLAGS + ["--use-torch-fsdp2"] + extra,
                                  nproc=nproc) for name, (nproc, extra) in runs.items()}
    for name, popen in started.items():
        losses, valid = parse_losses(finish(popen, timeout=600))
        for a, b in zip(reference, losses + valid, strict=True):
            assert abs(a - b) <= TOL, (name, reference, losses + valid)


@pytest.mark.quick
def test_fsdp2_dp2_and_dp4_equal_one_process(single_process):
    _check_runs(single_process, {"dp2 zero3": (2, []), "dp2 zero2": (2, ZERO2),
                                 "dp4 zero3": (4, []), "dp4 zero2": (4, ZERO2)})


def test_fsdp2_tp2_dp2_sequence_parallel_equals_one_process(single_process):
    """ZeRO-2 (ZeRO-3 at TP2 x DP2: tests/e2e/test_composition_matrix.py's TP+SP x FSDP2)."""
    tp_sp = ["--tensor-model-parallel-size", "2", "--sequence-parallel"]
    _check_runs(single_process, {"tp2 dp2 sp zero2": (4, tp_sp + ZERO2)})


def test_fsdp2_with_context_parallelism_equals_one_process(single_process):
    """FSDP2 shards over DP x CP (the ranks that reduce the same gradients): TP2 (SP) x CP2
    with ZeRO-2, sharded 2 ways over CP alone (CP2 x DP2, 4 ways over DP x CP: the
    composition matrix's CP x FSDP2)."""
    cp = ["--context-parallel-size", "2"]
    _check_runs(single_process, {
        "tp2 sp cp2 zero2": (4, cp + ["--tensor-model-parallel-size", "2",
                                      "--sequence-parallel"] + ZERO2)})


def test_fsdp2_bf16_equals_ddp_bf16_at_dp2():
    """bf16 compute from fp32 shards, fp32 reduction: DDP's mixed precision (fp32 main params,
    fp32 gradient accumulation) in other sums; the same printed losses at DP=2."""
    bf16 = FLAGS + ["--bf16"]
    ddp = start_script("pretrain_llama.py", bf16, nproc=2)
    fsdp = start_script("pretrain_llama.py", bf16 + ["--use-torch-fsdp2"], nproc=2)
    want, got = parse_losses(finish(ddp)), parse_losses(finish(fsdp))
    for a, b in zip(want[0] + want[1], got[0] + got[1], strict=True):
        assert abs(a - b) <= TOL, (want, got)


# fp16 compute: the sums' other order reaches the weights, which are rounded to fp16's 11-bit
# significand at each forward's cast, so the losses differ in the 5th decimal (2e-5 seen).
FP16_TOL = 1e-4


def _loss_scales_and_skips(proc):
    return (re.findall(r"loss scale: ([0-9.E+-]+)", proc.stdout),
            re.findall(r"number of skipped iterations: +(\d+)", proc.stdout))


def test_fsdp2_fp16_equals_ddp_fp16_at_dp2():
    """fp16 with dynamic loss scaling: FSDP2's fp32 shards unscaled and checked for inf on
    every rank (one overflow anywhere skips the step everywhere) as DDP's fp32 main grads are.
    From 2^20 the first two steps overflow and the scale halves: the same steps are skipped,
    with the same scales, and the losses agree within FP16_TOL."""
    fp16 = FLAGS + FP16
    ddp = finish(start_script("pretrain_llama.py", fp16, nproc=2))
    fsdp = finish(start_script("pretrain_llama.py", fp16 + ["--use-torch-fsdp2"], nproc=2))
    scales, skips = _loss_scales_and_skips(ddp)
    assert skips[:3] == ["1", "1", "0"] and len(set(scales)) == 2
    assert _loss_scales_and_skips(fsdp) == (scales, skips)
    want, got = parse_losses(ddp), parse_losses(fsdp)
    assert len(want[0]) == 8  # two iterations skipped: no loss printed
    for a, b in zip(want[0] + want[1], got[0] + got[1], strict=True):
        assert abs(a - b) <= FP16_TOL, (want, got)


# --- checkpoints (the sharded format) --------------------------------------------------------
# Bitwise: a resumed FSDP2 run repeats the uninterrupted run's arithmetic (same layout, data
# order and saved RNG streams): losses and every saved tensor are equal, not close. Across
# layouts (FSDP2 <-> the distributed optimizer at another DP, or one process) the sums are
# ordered differently: the resumed losses are within RESHARD_TOL (1e-5, the resharding
# tests' bound) of an uninterrupted run of the target layout.
RESHARD_TOL = 1e-5
FSDP2 = ["--use-torch-fsdp2"]
DISTRIBUTED = ["--use-distributed-optimizer"]


@pytest.mark.parametrize("mode", [[], ZERO2, ["--bf16"], FP16],
                         ids=["zero3", "zero2", "zero3_bf16", "zero3_fp16"])
def test_fsdp2_resume_at_dp2_is_bitwise(tmp_path, mode):
    first, second, straight, resumed = _straight_then_resume(
        tmp_path, _flags(*FSDP2, *mode), nproc=2)
    want, got = _iteration_losses(first), _iteration_losses(second)
    stepped = ["3", "4"] if mode == FP16 else ["1", "2", "3", "4"]  # skipped: no loss line
    assert sorted(want) == stepped and sorted(got) == ["3", "4"]
    assert [got[i] for i in "34"] == [want[i] for i in "34"]
    _assert_bitwise(straight, resumed, 4)  # weights, Adam state, scheduler, RNG
    assert _is_sharded(straight / "iter_0000004", 2)


def _reshard_flags():
    return _flags(dropout="0", loader="single")  # masks and sample order independent of DP


HSDP = ["--num-distributed-optimizer-instances", "2"]
LAYOUTS = {"fsdp2 dp2 zero3": (2, FSDP2), "fsdp2 dp2 zero2": (2, FSDP2 + ZERO2),
           "distributed dp4": (4, DISTRIBUTED), "plain dp1": (1, []),
           "fsdp2 tp2 dp2": (4, FSDP2 + ["--tensor-model-parallel-size", "2"]),
           "fsdp2 pp2 dp2": (4, FSDP2 + ["--pipeline-model-parallel-size", "2"]),
           # HSDP: two instances of two ranks; instance 0 alone writes what both hold
           "fsdp2 hsdp dp4": (4, FSDP2 + HSDP), "distributed hsdp dp4": (4, DISTRIBUTED + HSDP)}


def uninterrupted_runs(root, flags, layouts):
    """Each of ``layouts`` ({name: (ranks, extra flags)}) run uninterrupted, saving at
    iteration 2 (started together): {name: (its checkpoint root, its per-iteration losses)}."""
    started = {name: start_script("pretrain_llama.py", flags + extra + [
        "--save", root / name.replace(" ", "_"), "--save-interval", "2"], nproc=nproc)
        for name, (nproc, extra) in layouts.items()}
    return {name: (root / name.replace(" ", "_"), _iteration_losses(finish(popen, timeout=600)))
            for name, popen in started.items()}


@pytest.fixture(scope="module")
@once_per_run
def straight_runs(tmp_path_factory):
    """Each layout uninterrupted for 4 iterations, saving at 2."""
    return uninterrupted_runs(tmp_path_factory.mktemp("fsdp2_reshard"), _reshard_flags(),
                              LAYOUTS)


@pytest.mark.parametrize("saved,target", [
    ("fsdp2 dp2 zero3", "distributed dp4"), ("distributed dp4", "fsdp2 dp2 zero2"),
    ("fsdp2 dp2 zero2", "plain dp1"), ("plain dp1", "fsdp2 dp2 zero3"),
    ("fsdp2 tp2 dp2", "distributed dp4"),  # TP 2 -> 1: FSDP2's rows of column-split tensors
    # FSDP2 x PP2 (tests/e2e/test_fsdp2_pipeline.py): each stage's rows, to and from one stage
    ("fsdp2 pp2 dp2", "plain dp1"), ("fsdp2 pp2 dp2", "distributed dp4"),
    ("plain dp1", "fsdp2 pp2 dp2"), ("distributed dp4", "fsdp2 pp2 dp2"),
    ("fsdp2 hsdp dp4", "plain dp1"), ("distributed hsdp dp4", "fsdp2 dp2 zero3"),
    ("fsdp2 dp2 zero3", "fsdp2 hsdp dp4"), ("plain dp1", "distributed hsdp dp4"),
])
def test_fsdp2_checkpoint_loads_into_another_layout(straight_runs, tmp_path, saved, target):
    root, _ = straight_runs[saved]
    nproc, extra = LAYOUTS[target]
    proc = run_script("pretrain_llama.py", _reshard_flags() + extra + [
        "--load", root, "--ckpt-step", "2", "--save", tmp_path / "again"], nproc)
    got, want = _iteration_losses(proc), straight_runs[target][1]
    assert "resharded from" in proc.stdout
    assert _each_element_written_once(root / "iter_0000002")
    assert sorted(got) == ["3", "4"]
    for i in "34":
        assert abs(float(got[i]) - float(want[i])) <= RESHARD_TOL, (got, want)


def test_hsdp_torch_format_checkpoint_loads_at_one_process(tmp_path):
    """The torch format under HSDP's distributed optimizer: each instance gathers its own
    shards, and instance 0's gather (DP rank 0) is the one written; loaded by one process it
    continues as one process's uninterrupted run does."""
    flags = _reshard_flags() + ["--ckpt-format", "torch"]
    runs = uninterrupted_runs(tmp_path, flags, {"hsdp": (4, DISTRIBUTED + HSDP),
                                                "plain": (1, [])})
    proc = run_script("pretrain_llama.py", flags + [
        "--load", runs["hsdp"][0], "--ckpt-step", "2", "--save", tmp_path / "again"], 1)
    got, want = _iteration_losses(proc), runs["plain"][1]
    assert sorted(got) == ["3", "4"]
    for i in "34":
        assert abs(float(got[i]) - float(want[i])) <= RESHARD_TOL, (got, want)


def _each_element_written_once(iteration_dir) -> bool:
    """The pieces of every tensor add up to it (HSDP's instances hold the same rows: a second
    instance writing them would count twice)."""
    tensors = json.loads((iteration_dir / "metadata.json").read_text())["tensors"]
    return all(sum(stop - start for *_, start, stop in entry["pieces"])
               == math.prod(entry["shape"]) for entry in tensors.values())


def test_fsdp2_bf16_checkpoint_loads_into_the_bf16_distributed_optimizer(tmp_path):
    """FSDP2's fp32 shards are the distributed optimizer's main params: loaded at DP=2 they
    continue within the bf16 runs' own difference (test_fsdp2_bf16_equals_ddp_bf16_at_dp2)."""
    bf16 = _reshard_flags() + ["--bf16"]
    fsdp = start_script("pretrain_llama.py", bf16 + FSDP2 + [
        "--save", tmp_path / "fsdp2", "--save-interval", "2"], nproc=2)
    straight = start_script("pretrain_llama.py", bf16 + DISTRIBUTED, nproc=2)
    finish(fsdp, timeout=600)
    want = _iteration_losses(finish(straight, timeout=600))
    proc = run_script("pretrain_llama.py", bf16 + DISTRIBUTED + [
        "--load", tmp_path / "fsdp2", "--ckpt-step", "2"], 2)
    got = _iteration_losses(proc)
    assert "loaded checkpoint from" in proc.stdout and sorted(got) == ["3", "4"]
    for i in "34":
        assert abs(float(got[i]) - float(want[i])) <= RESHARD_TOL, (got, want)


def test_fsdp2_refuses_the_torch_checkpoint_format_at_start():
    """One message, exit 2, before any work (the other refusals: tests/unit/test_fsdp2.py)."""
    proc = run_forked("pretrain_llama.py", FLAGS + FSDP2 + ["--save", "ckpt", "--ckpt-format",
                                                            "torch"])
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "sharded checkpoint format only" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr and "iteration" not in proc.stdout
