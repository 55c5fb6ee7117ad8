"""Faults under torchrun on CPU, loopback only: a rank SIGKILLed while it saves is restarted
by torchrun (--max-restarts) and the job resumes from its last complete checkpoint with no
manual step, ending bitwise equal to an uninterrupted run; two torchrun agents (two "nodes" of
one process each, c10d rendezvous on 127.0.0.1) train exactly as one node of 2. Two processes
(TP=2) show both, and every launch pays a torch import per process. (A kill mid-iteration
takes the same restart path as one mid-save: one fault keeps the job to two attempts. The
restart is shown on one agent: two agents restarting together, under a loaded machine, once
left a worker of the second attempt waiting forever after both agents had exited.)"""
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
from tests.shared_fixture import once_per_run

ITERS = 20
FLAGS = without(TINY, "--train-iters", "--log-interval", "--eval-interval") + LLAMA + [
    "--train-iters", str(ITERS), "--log-interval", "1", "--eval-interval", "10",
    "--tensor-model-parallel-size", "2", "--save-interval", "5"]  # 2 processes: TP=2
# (both write checkpoint files: rank 1 is killed while it writes its own)
ELASTIC = ["--standalone", "--max-restarts", "1"]


def _run(root, **kwargs):
    return run_script("pretrain_llama.py", FLAGS + ["--save", root, "--load", root], nproc=2,
                      **kwargs)


@pytest.fixture(scope="module")
@once_per_run
def uninterrupted(tmp_path_factory):
    root = tmp_path_factory.mktemp("uninterrupted") / "ckpt"
    parse_losses(_run(root))
    return checkpoint_tensors(root, ITERS)


def _assert_bitwise(root, want):
    got = checkpoint_tensors(root, ITERS)
    assert got.keys() == want.keys() and want
    for key in want:
        assert torch.equal(got[key], want[key]), key


def test_torchrun_restarts_a_rank_killed_while_saving_and_it_ends_bitwise_equal(
        tmp_path, monkeypatch, uninterrupted):
    """Rank 1 is killed while writing the checkpoint of iteration 10 (half written, never
    published); the restarted attempt resumes from iteration 5 and ends bitwise equal."""
    monkeypatch.setenv("MEGATRON_FAULT_INJECTION", "save:1:10")
    root = tmp_path / "ckpt"
    proc = _run(root, torchrun_args=ELASTIC)
    parse_losses(proc)  # exit 0 after the restart
    assert len(re.findall(r"failed \(exitcode: -9\)", proc.stderr)) == 1, proc.stderr[-3000:]
    assert proc.stdout.count("iter_0000005 at iteration 5") == 1, proc.stdout[-3000:]
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
    agents = [start_script("pretrain_llama.py", flags, nproc=1, torchrun_args=rendezvous)
              for _ in range(2)]
    procs = [finish(agent) for agent in agents]
    assert all(p.returncode == 0 for p in procs), [p.stderr[-2000:] for p in procs]
    assert any(re.search(r" iteration +20/", p.stdout) for p in procs)
    _assert_bitwise(root, uninterrupted)
