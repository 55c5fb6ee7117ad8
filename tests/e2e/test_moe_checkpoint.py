"""MoE checkpoints end to end (pretrain_llama.py, CPU, gloo, fp32), both formats.

A run at EP=2 (nproc 2, DP=2) trains 5 iterations saving at 3; runs resumed from iteration 3
at EP=2 (the same layout), EP=1 (nproc 1) and EP=4 (nproc 4, DP=4) train iterations 4 and 5.
Their losses equal the straight run's: bitwise (as printed) at the same layout; within 1e-6
relative at another, because the gradients of a step are summed over other DP / expert-DP
groups in another order (the tokens and the experts that see them are the same).
"""
import re

import pytest

from tests.e2e.runner import LLAMA, TINY, finish, parse_losses, start_script, without

MOE = ["--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "16",
       "--moe-aux-loss-coeff", "0.01", "--moe-router-enable-expert-bias",
       "--use-distributed-optimizer", "--train-iters", "5", "--eval-interval", "100"]


def _losses(proc):
    parse_losses(proc)  # exit status
    return {int(i): float(x) for i, x in re.findall(
        r" iteration +(\d+)/.*?\| lm loss: ([0-9.E+-]+) \|", proc.stdout)}


@pytest.mark.parametrize("fmt", ["torch_dist", "torch"])
def test_ep2_resumes_at_ep2_ep1_and_ep4(tmp_path, fmt):
    flags = without(TINY, "--train-iters", "--eval-interval") + LLAMA + MOE + [
        "--ckpt-format", fmt]
    straight = _losses(finish(start_script(
        "pretrain_llama.py", flags + ["--expert-model-parallel-size", "2", "--save",
                                      tmp_path, "--save-interval", "3"], nproc=2)))
    assert sorted(straight) == [1, 2, 3, 4, 5]
    resume = flags + ["--load", tmp_path, "--ckpt-step", "3"]
    runs = {ep: start_script("pretrain_llama.py", resume + [
        "--expert-model-parallel-size", str(ep)], nproc=ep) for ep in (2, 1, 4)}
    for ep, run in runs.items():
        got = _losses(finish(run, timeout=400))
        assert sorted(got) == [4, 5], (ep, got)
        for i in (4, 5):
            if ep == 2:
                assert got[i] == straight[i], (ep, i)
            else:
                assert got[i] == pytest.approx(straight[i], rel=1e-6, abs=0), (ep, i)


def test_deepseek_saved_at_tp2_ep2_pp2_resumes_at_cp2_ep2_and_one_process(tmp_path):
    """A tiny DeepSeek-V3 (MLA, MTP with its copy of the untied embedding on the last stage,
    grouped routing, a dense first layer; see test_moe.py) saved at TP 2 x EP 2 x PP 2 resumes
    at CP 2 x EP 2 and on one process: iterations 4 and 5 within 1e-5 relative of the straight
    run (TP and CP re-associate sums, as in test_moe.py's comparisons with one process)."""
    from tests.e2e.test_moe import DEEPSEEK

    flags = without(TINY, "--train-iters", "--eval-interval") + LLAMA + MOE + DEEPSEEK
    straight = _losses(finish(start_script("pretrain_llama.py", flags + [
        "--tensor-model-parallel-size", "2", "--sequence-parallel",
        "--expert-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
        "--save", tmp_path, "--save-interval", "3"], nproc=8), timeout=400))
    assert sorted(straight) == [1, 2, 3, 4, 5]
    resume = flags + ["--load", tmp_path, "--ckpt-step", "3"]
    runs = {"cp2 ep2": start_script("pretrain_llama.py", resume + [
                "--context-parallel-size", "2", "--expert-model-parallel-size", "2"], nproc=4),
            "one process": start_script("pretrain_llama.py", resume)}
    for name, run in runs.items():
        got = _losses(finish(run, timeout=400))
        assert sorted(got) == [4, 5], (name, got)
        for i in (4, 5):
            assert got[i] == pytest.approx(straight[i], rel=1e-5, abs=0), (name, i)
