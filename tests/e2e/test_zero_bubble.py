"""The zero-bubble schedules through pretrain_llama.py: PP=2 x DP=2 with the distributed
optimizer (overlapped reduce-scatter and parameter all-gather), 10 iterations.

Against our 1F1B on the same layout the printed losses, validation losses and gradient norms
are the SAME TEXT: the schedules run the same arithmetic (W accumulates each weight's
microbatch gradients in microbatch order), and DDP's reduce-scatter, clipping and the step
only act after every W. Against one process the sums over DP are ordered differently: within
1e-5 (the resharding tests' bound). A zbv checkpoint (its chunks in a V) resumes under 1F1B
at PP=2 with 1F1B's own losses."""
import re

import pytest

from tests.e2e.runner import LLAMA, TINY, finish, parse_losses, run_script, start_script, without
from tests.shared_fixture import once_per_run

FLAGS = without(TINY, "--global-batch-size", "--train-iters") + LLAMA + [
    "--global-batch-size", "16", "--train-iters", "10"]  # 4 microbatches per DP rank
PIPELINE = ["--pipeline-model-parallel-size", "2", "--overlapped-distributed-optimizer"]
TOL = 1e-5


def _printed(proc):
    """Per iteration: (iteration, loss text, grad norm text); and the validation losses."""
    parse_losses(proc)  # exit status 0
    train = re.findall(r" iteration +(\d+)/.*?\| lm loss: ([0-9.E+-]+) \|.*?\| grad norm: "
                       r"([0-9.]+) \|", proc.stdout)
    return train, re.findall(r"lm loss value: ([0-9.E+-]+)", proc.stdout)


@pytest.fixture(scope="module")
@once_per_run
def runs(tmp_path_factory):
    """1F1B, zb-h1, zbv (saving at 5) at PP=2 x DP=2, and one process: started together."""
    root = tmp_path_factory.mktemp("zero_bubble")
    started = {name: start_script("pretrain_llama.py", FLAGS + PIPELINE + extra, nproc=4)
               for name, extra in {
                   "1f1b": [],
                   "zb-h1": ["--pipeline-schedule", "zb-h1"],
                   "zbv": ["--pipeline-schedule", "zbv", "--save", root / "zbv",
                           "--save-interval", "5"]}.items()}
    started["one process"] = start_script("pretrain_llama.py", FLAGS)
    printed = {name: _printed(finish(proc, timeout=600)) for name, proc in started.items()}
    return root, printed


@pytest.mark.quick
def test_zero_bubble_schedules_print_1f1b_losses_and_grad_norms(runs):
    _, printed = runs
    want_train, want_valid = printed["1f1b"]
    # validations at iterations 3, 6, 9 and after training at 10
    assert len(want_train) == 10 and len(want_valid) == 4
    for name in ("zb-h1", "zbv"):
        assert printed[name] == printed["1f1b"], name
    one_train, one_valid = printed["one process"]
    for (_, a, _), (_, b, _) in zip(one_train, want_train, strict=True):
        assert abs(float(a) - float(b)) <= TOL
    for a, b in zip(one_valid, want_valid, strict=True):
        assert abs(float(a) - float(b)) <= TOL


def test_a_zbv_checkpoint_resumes_under_1f1b(runs):
    """The same arithmetic from the same state: 1F1B's own losses and grad norms, as text.
    (Loading the V's layers at PP=1: tests/unit/test_v_placement.py.)"""
    root, printed = runs
    proc = run_script("pretrain_llama.py", FLAGS + PIPELINE + [
        "--load", root / "zbv", "--ckpt-step", "5"], 4, timeout=600)
    got, _ = _printed(proc)
    want = {it: (loss, norm) for it, loss, norm in printed["1f1b"][0]}
    assert [it for it, _, _ in got] == [str(i) for i in range(6, 11)]
    for it, loss, norm in got:
        assert (loss, norm) == want[it], it
