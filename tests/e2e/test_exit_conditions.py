"""When training stops: --train-samples, --exit-interval, --exit-duration-in-mins, read from
Megatron's console lines (`iteration 2/ 10 | consumed samples: 16 |`). One process, mock data;
the three runs start together to share the cost of importing torch."""
import pytest

from tests.e2e.runner import LLAMA, TINY, finish, parse_iterations, start_script, without
from tests.shared_fixture import once_per_run

BASE = without(TINY + LLAMA, "--train-iters", "--eval-interval") + ["--eval-interval", "100"]
RUNS = {
    # 30 samples at global batch 8: 3 iterations (Megatron floors: train_iters =
    # train_samples // global_batch_size; the 6 left over are not trained on).
    "train_samples": ["--train-samples", "30"],
    "exit_interval": ["--train-iters", "10", "--exit-interval", "2"],
    "exit_duration": ["--train-iters", "10", "--exit-duration-in-mins", "1e-6"],
}


@pytest.fixture(scope="module")
@once_per_run
def runs():
    started = {name: start_script("pretrain_llama.py", BASE + flags)
               for name, flags in RUNS.items()}
    return {name: finish(popen) for name, popen in started.items()}


def test_train_samples_sets_the_iterations(runs):
    assert parse_iterations(runs["train_samples"]) == [(1, 3, 8), (2, 3, 16), (3, 3, 24)]


def test_exit_interval_stops_after_that_iteration(runs):
    assert parse_iterations(runs["exit_interval"]) == [(1, 10, 8), (2, 10, 16)]


def test_exit_duration_stops_after_the_first_iteration(runs):
    assert parse_iterations(runs["exit_duration"]) == [(1, 10, 8)]


_RAISE_AT_3 = """
import os, sys
sys.path.insert(0, {root!r})
from megatron.training.guards import fault_injection

def boom(iteration):
    if iteration == 3:
        raise RuntimeError("unexpected failure at iteration 3")

fault_injection.maybe_kill_at = boom
import pretrain_llama
sys.argv = ["pretrain_llama.py"] + sys.argv[1:]
pretrain_llama.main()
"""


def test_an_unexpected_exception_in_the_loop_exits_with_loader_workers_running(tmp_path):
    """A bug (not a user's mistake) raised inside the loop, with 2 loader workers (which
    ignore SIGTERM): the traceback is printed and the process exits 1. It used to hang at
    interpreter exit, multiprocessing waiting for workers that ignored its SIGTERM."""
    from tests.e2e.runner import ROOT

    script = tmp_path / "raise_at_3.py"
    script.write_text(_RAISE_AT_3.format(root=ROOT))
    proc = finish(start_script(str(script), BASE + ["--train-iters", "6", "--num-workers", "2"]),
                  timeout=120)
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert "RuntimeError: unexpected failure at iteration 3" in proc.stderr
    assert " iteration        2/       6 |" in proc.stdout and "iteration        3/" not in \
        proc.stdout
