"""When training stops: --train-samples, --exit-interval, --exit-duration-in-mins, read from
Megatron's console lines (`iteration 2/ 10 | consumed samples: 16 |`). One process, mock data;
the three runs start together to share the cost of importing torch."""
import pytest

from tests.e2e.runner import LLAMA, TINY, finish, parse_iterations, start_script, without

BASE = without(TINY + LLAMA, "--train-iters", "--eval-interval") + ["--eval-interval", "100"]
RUNS = {
    # 30 samples at global batch 8: 3 iterations (Megatron floors: train_iters =
    # train_samples // global_batch_size; the 6 left over are not trained on).
    "train_samples": ["--train-samples", "30"],
    "exit_interval": ["--train-iters", "10", "--exit-interval", "2"],
    "exit_duration": ["--train-iters", "10", "--exit-duration-in-mins", "1e-6"],
}


@pytest.fixture(scope="module")
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
