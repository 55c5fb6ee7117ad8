"""The zero-bubble schedules through pretrain_llama.py: PP=2 x DP=2 with the distributed
optimizer (overlapped reduce-scatter and parameter all-gather), 10 iterations.

Against our 1F1B on the same layout the printed losses, validation losses and gradient norms
are the SAME TEXT: the schedules run the same arithmetic (W accumulates each weight's
microbatch gradients in microbatch order), and DDP's reduce-scatter, clipping and the step
only act after every W. Against one process the sums over DP are ordered differently: within
1e-5 (the resharding tests' bound)."""
import re

from tests.e2e.runner import LLAMA, TINY, finish, parse_losses, start_script, without

FLAGS = without(TINY, "--global-batch-size", "--train-iters") + LLAMA + [
    "--global-batch-size", "16", "--train-iters", "10"]  # 4 microbatches per DP rank
PIPELINE = ["--pipeline-model-parallel-size", "2", "--overlapped-distributed-optimizer"]


def _printed(proc):
    """Per iteration (loss text, grad norm text), and the validation losses' text."""
    parse_losses(proc)  # exit status 0
    train = re.findall(r"\| lm loss: ([0-9.E+-]+) \|.*?\| grad norm: ([0-9.]+) \|", proc.stdout)
    return train, re.findall(r"lm loss value: ([0-9.E+-]+)", proc.stdout)


def test_zero_bubble_schedules_equal_1f1b_through_pretrain_llama():
    runs = {name: start_script("pretrain_llama.py", FLAGS + PIPELINE + extra, nproc=4)
            for name, extra in {"1f1b": [],
                                "zb-h1": ["--pipeline-schedule", "zb-h1"],
                                "zbv": ["--pipeline-schedule", "zbv"]}.items()}
    single = start_script("pretrain_llama.py", FLAGS)
    printed = {name: _printed(finish(proc, timeout=600)) for name, proc in runs.items()}
    want_train, want_valid = printed["1f1b"]
    assert len(want_train) == 10 and len(want_valid) == 3
    for name in ("zb-h1", "zbv"):
        assert printed[name] == printed["1f1b"], name
    one_train, one_valid = _printed(finish(single, timeout=600))
    for (a, _), (b, _) in zip(one_train, want_train, strict=True):
        assert abs(float(a) - float(b)) <= 1e-5
    for a, b in zip(one_valid, want_valid, strict=True):
        assert abs(float(a) - float(b)) <= 1e-5
