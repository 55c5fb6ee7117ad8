"""Surviving bad steps and signals on one process: an injected NaN gradient is skipped and
logged; several in a row stop the run with a message, keeping the last good state; SIGTERM
with --exit-signal-handler saves and exits 0, and the resumed run continues exactly."""
import re
import signal
import subprocess

import torch

from tests.e2e.bad_inputs.harness import run as run_forked
from tests.e2e.runner import (
    LLAMA,
    TINY,
    checkpoint_tensors,
    parse_losses,
    run_script,
    start_script,
    without,
)

FLAGS = without(TINY, "--train-iters", "--hidden-dropout", "--attention-dropout") + LLAMA + [
    "--hidden-dropout", "0.1", "--attention-dropout", "0.1", "--train-iters", "6"]


def _model_tensors(root, iteration):
    """The model's weights in a checkpoint (the default, sharded format)."""
    tensors = checkpoint_tensors(root, iteration)
    return {k: v for k, v in tensors.items() if k.startswith("model/")}


def test_one_nan_gradient_is_skipped_and_logged(monkeypatch):
    monkeypatch.setenv("MEGATRON_FAULT_INJECTION", "nan:0:2")
    proc = run_script("pretrain_llama.py", FLAGS)
    parse_losses(proc)  # exit 0
    assert "iteration 2: non-finite gradients (grad norm nan): the update was skipped (1 in a " \
           "row)" in proc.stdout
    lines = re.findall(r" iteration +(\d+)/.*?number of skipped iterations: +(\d+)", proc.stdout)
    assert lines == [("1", "0"), ("2", "1"), ("3", "0"), ("4", "0"), ("5", "0"), ("6", "0")]


def test_nan_gradients_in_a_row_stop_the_run_keeping_the_last_good_state(tmp_path, monkeypatch):
    monkeypatch.setenv("MEGATRON_FAULT_INJECTION", "nan:0:2-9")
    root = tmp_path / "ckpt"
    proc = run_forked("pretrain_llama.py", FLAGS + [  # a failing run: not the warm pool's
        "--save", root, "--save-interval", "1", "--max-consecutive-nan-iterations", "3"])
    assert proc.returncode == 1
    assert "3 iterations in a row (2-4) had non-finite gradients; stopping" in proc.stderr
    assert (root / "latest_checkpointed_iteration.txt").read_text() == "4"
    good, kept = _model_tensors(root, 1), _model_tensors(root, 4)
    assert good and good.keys() == kept.keys()
    assert all(torch.equal(good[k], kept[k]) for k in good)  # no update after iteration 1


def _losses_by_iteration(stdout):
    return dict(re.findall(r" iteration +(\d+)/.*?\| lm loss: ([0-9.E+-]+) \|", stdout))


def test_sigterm_saves_exits_zero_and_resume_continues_exactly(tmp_path):
    root = tmp_path / "ckpt"
    long_run = without(FLAGS, "--train-iters") + ["--train-iters", "1000"]
    flags = long_run + ["--save", root, "--load", root, "--exit-signal-handler"]
    popen = start_script("pretrain_llama.py", flags, warm=False)  # a real process to signal
    seen = []
    for line in popen.stdout:  # wait until training really runs, then signal it
        seen.append(line)
        if re.search(r" iteration +2/", line):
            popen.send_signal(signal.SIGTERM)
            break
    try:
        out, err = popen.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        popen.kill()
        raise
    stdout = "".join(seen) + out
    assert popen.returncode == 0, err[-2000:]
    stopped = int((root / "latest_checkpointed_iteration.txt").read_text())
    assert f"received SIGTERM: saving at iteration {stopped} and exiting" in stdout
    end = str(stopped + 2)
    resumed = run_script("pretrain_llama.py", flags + ["--exit-interval", end])
    assert f"at iteration {stopped}" in resumed.stdout
    first, again = _losses_by_iteration(stdout), _losses_by_iteration(resumed.stdout)
    assert sorted(first, key=int)[-1] == str(stopped)
    assert sorted(again, key=int) == [str(stopped + 1), end]
    straight = _losses_by_iteration(run_script("pretrain_llama.py", long_run + [
        "--exit-interval", end]).stdout)
    assert {**first, **again} == straight  # every printed digit
