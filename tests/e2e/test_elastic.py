"""Faults under torchrun on CPU, loopback only: a rank SIGKILLed mid-training or mid-save is
restarted by torchrun (--max-restarts) and the job resumes from its last checkpoint with no
manual step, ending bitwise equal to an uninterrupted run; two torchrun agents (two "nodes"
of 2 processes, c10d rendezvous on 127.0.0.1) train exactly as one node of 4."""
import re
import socket

import pytest
import torch

from tests.e2e.runner import (
    LLAMA,
    TINY,
    checkpoint_tensors,
    finish,
    parse_losses,
    run_script,
    start_script,
    without,
)

ITERS = 20
FLAGS = without(TINY, "--train-iters", "--log-interval", "--eval-interval") + LLAMA + [
    "--train-iters", str(ITERS), "--log-interval", "1", "--eval-interval", "10",
    "--tensor-model-parallel-size", "2", "--save-interval", "5"]  # 4 processes: TP=2 x DP=2
# (ranks 0 and 1 are DP rank 0: the ones that write checkpoint files)
ELASTIC = ["--standalone", "--max-restarts", "2"]


def _run(root, **kwargs):
    return run_script("pretrain_llama.py", FLAGS + ["--save", root, "--load", root], nproc=4,
                      **kwargs)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    root = tmp_path_factory.mktemp("uninterrupted") / "ckpt"
    parse_losses(_run(root))
    return checkpoint_tensors(root, ITERS)


def _assert_bitwise(root, want):
    got = checkpoint_tensors(root, ITERS)
    assert got.keys() == want.keys() and want
    for key in want:
        assert torch.equal(got[key], want[key]), key


@pytest.mark.parametrize("fault,resumed_from", [("kill:1:7", 5), ("save:1:10", 5)],
                         ids=["killed-at-iteration-7", "killed-while-saving-10"])
def test_torchrun_restarts_the_job_and_it_ends_bitwise_equal(tmp_path, monkeypatch,
                                                             uninterrupted, fault, resumed_from):
    monkeypatch.setenv("MEGATRON_FAULT_INJECTION", fault)
    root = tmp_path / "ckpt"
    proc = _run(root, torchrun_args=ELASTIC)
    parse_losses(proc)  # exit 0 after the restart
    assert re.search(r"failed \(exitcode: -9\)", proc.stderr), proc.stderr[-2000:]
    assert f"iter_{resumed_from:07d} at iteration {resumed_from}" in proc.stdout
    _assert_bitwise(root, uninterrupted)


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_torchrun_agents_on_loopback_train_as_one_node(tmp_path, uninterrupted):
    root = tmp_path / "ckpt"
    rendezvous = ["--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint",
                  f"127.0.0.1:{_free_port()}", "--rdzv-id", "two-nodes"]
    flags = FLAGS + ["--save", root, "--load", root]
    agents = [start_script("pretrain_llama.py", flags, nproc=2, torchrun_args=rendezvous)
              for _ in range(2)]
    procs = [finish(agent) for agent in agents]
    assert all(p.returncode == 0 for p in procs), [p.stderr[-2000:] for p in procs]
    assert any(re.search(r" iteration +20/", p.stdout) for p in procs)
    _assert_bitwise(root, uninterrupted)
