"""Context parallelism through pretrain_llama.py / pretrain_gpt.py: the same global batches give
the same per-iteration losses and gradient norms as one process, with TP + SP + the
distributed optimizer, with PP (1F1B; interleaved + full recomputation + packed documents), and
at CP = 4 on long sequences; a checkpoint saved at CP = 2 resumes at CP = 1 and CP = 4.

Tolerance 1e-5 (the issue's): under CP each rank sums the loss of its own chunks and the
ranks' sums are added (a different association than one process's sum over the sequence), and
attention merges the blocks' partial softmaxes by their log-sum-exp; both re-associate fp32
sums (measured differences are ~1e-7 on losses ~4)."""
import functools
import re

import pytest

from tests.e2e.runner import LLAMA, TINY, parse_losses, run_script, without

TOL = 1e-5
# Gradient norms are logged with 3 decimals: equal up to rounding. They catch what losses
# cannot: Adam's update hardly changes if every gradient is scaled by the same factor (a loss
# not scaled by CP, or gradients averaged over the wrong group, would still train alike).
GRAD_NORM_TOL = 2e-3
BASE = without(TINY, "--train-iters", "--eval-interval") + [
    "--train-iters", "10", "--eval-interval", "5"]


def _losses_and_grad_norms(proc):
    losses, valid = parse_losses(proc)
    return losses, valid, [float(x) for x in re.findall(r"\| grad norm: ([0-9.]+) \|",
                                                        proc.stdout)]


@functools.lru_cache(maxsize=None)
def _single(script, flags):
    """One process's (training losses, validation losses, grad norms) of ``flags`` (shared
    between tests)."""
    return _losses_and_grad_norms(run_script(script, list(flags)))


def _assert_equal_to_single(script, flags, parallel_flags, nproc):
    single, single_valid, single_norms = _single(script, tuple(flags))
    parallel, parallel_valid, norms = _losses_and_grad_norms(
        run_script(script, flags + parallel_flags, nproc=nproc))
    assert len(single) == 10 and len(single_valid) == 2 and len(single_norms) == 10
    for a, b in zip(single + single_valid, parallel + parallel_valid, strict=True):
        assert abs(a - b) <= TOL, (single, parallel)
    for a, b in zip(single_norms, norms, strict=True):
        assert abs(a - b) <= GRAD_NORM_TOL, (single_norms, norms)


def test_cp2_tp2_dp2_with_sp_and_distributed_optimizer_equals_one_process():
    flags = BASE + LLAMA + ["--group-query-attention", "--num-query-groups", "2"]
    _assert_equal_to_single("pretrain_llama.py", flags, [
        "--context-parallel-size", "2", "--tensor-model-parallel-size", "2",
        "--sequence-parallel", "--use-distributed-optimizer"], nproc=8)


def test_cp2_tp2_sliding_windows_and_attention_sinks_equal_one_process():
    """gpt-oss's attention under CP: learned sinks, a 5-token window on odd layers (the
    ring's distance mask), full attention on even ones."""
    flags = BASE + LLAMA + ["--softmax-type", "learnable", "--window-size", "5,0",
                            "--window-attn-skip-freq", "2"]
    _assert_equal_to_single("pretrain_llama.py", flags, [
        "--context-parallel-size", "2", "--tensor-model-parallel-size", "2",
        "--sequence-parallel"], nproc=4)


def test_cp2_pp2_dp2_interleaved_recompute_packed_documents_equals_one_process():
    flags = BASE + LLAMA + ["--reset-attention-mask", "--reset-position-ids",
                            "--eod-mask-loss", "--recompute-granularity", "full",
                            "--recompute-method", "uniform", "--recompute-num-layers", "1"]
    _assert_equal_to_single("pretrain_llama.py", flags, [
        "--context-parallel-size", "2", "--pipeline-model-parallel-size", "2",
        "--num-layers-per-virtual-pipeline-stage", "1", "--cp-comm-type", "all_gather"],
        nproc=8)


def test_cp4_at_sequence_256_on_4_ranks_equals_one_process():
    flags = without(BASE, "--seq-length", "--max-position-embeddings") + [
        "--seq-length", "256", "--max-position-embeddings", "256"]
    # GPT: learned absolute positions, looked up at each rank's own (non-contiguous) positions.
    _assert_equal_to_single("pretrain_gpt.py", flags, ["--context-parallel-size", "4"],
                            nproc=4)


@pytest.mark.quick
def test_cp2_pp2_1f1b_with_distributed_optimizer_equals_one_process():
    flags = BASE + LLAMA + ["--use-distributed-optimizer"]  # the checkpoint test's reference
    _assert_equal_to_single("pretrain_llama.py", flags, [
        "--context-parallel-size", "2", "--pipeline-model-parallel-size", "2"], nproc=4)


def test_checkpoint_saved_at_cp2_resumes_at_cp1_and_cp4(tmp_path):
    flags = BASE + LLAMA + ["--use-distributed-optimizer"]
    single, _, _ = _single("pretrain_llama.py", tuple(flags))
    save = ["--save", str(tmp_path / "ckpt"), "--save-interval", "5", "--exit-interval", "5"]
    parse_losses(run_script("pretrain_llama.py", flags + save + ["--context-parallel-size", "2"],
                            nproc=2))
    load = ["--load", str(tmp_path / "ckpt")]
    for cp in (1, 4):
        resumed, _ = parse_losses(run_script(
            "pretrain_llama.py", flags + load + ["--context-parallel-size", str(cp)], nproc=cp))
        assert len(resumed) == 5, resumed  # iterations 6..10
        for a, b in zip(single[5:], resumed, strict=True):
            assert abs(a - b) <= TOL, (cp, single[5:], resumed)
