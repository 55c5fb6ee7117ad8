"""Checkpoint flags on one process: stop and resume exactly (sync and --async-save), the first
start of an auto-resuming job, --finetune, and each load error's message."""
import os
import re

import pytest

from tests.e2e.bad_inputs.harness import run as run_forked
from tests.e2e.runner import LLAMA, TINY, parse_losses, run_script, without

FLAGS = without(TINY, "--hidden-dropout", "--attention-dropout", "--train-iters") + LLAMA + [
    "--hidden-dropout", "0.1", "--attention-dropout", "0.1", "--dataloader-type", "cyclic",
    "--lr-decay-style", "cosine", "--train-iters", "6"]


def _losses_by_iteration(proc):
    parse_losses(proc)
    return dict(re.findall(r" iteration +(\d+)/.*?\| lm loss: ([0-9.E+-]+) \|", proc.stdout))


@pytest.fixture(scope="module")
def straight():
    return _losses_by_iteration(run_script("pretrain_llama.py", FLAGS))


@pytest.mark.parametrize("mode", [[], ["--async-save"]], ids=["sync", "async"])
def test_stop_and_resume_equals_the_straight_run(tmp_path, straight, mode):
    root = tmp_path / "ckpt"
    flags = FLAGS + ["--save", root, "--load", root, "--save-interval", "2", *mode]
    first = _losses_by_iteration(run_script("pretrain_llama.py", flags + ["--exit-interval",
                                                                          "3"]))
    assert sorted(first) == ["1", "2", "3"]
    # Saved at 2 (interval) and at 3 (on exit); the job restarts with the same command.
    assert (root / "latest_checkpointed_iteration.txt").read_text() == "3"
    second = run_script("pretrain_llama.py", flags)
    assert "iter_0000003 at iteration 3" in second.stdout
    resumed = _losses_by_iteration(second)
    assert {**first, **resumed} == straight  # every printed digit
    assert sorted(os.listdir(root)) == ["iter_0000002", "iter_0000003", "iter_0000004",
                                        "iter_0000006", "latest_checkpointed_iteration.txt"]


def test_first_start_of_an_auto_resuming_job_starts_fresh(tmp_path, straight):
    root = tmp_path / "ckpt"
    proc = run_script("pretrain_llama.py", FLAGS + ["--save", root, "--load", root])
    assert f"no checkpoint in {root} yet: starting from scratch" in proc.stdout
    assert _losses_by_iteration(proc) == straight
    assert (root / "latest_checkpointed_iteration.txt").read_text() == "6"  # final save


def test_finetune_loads_weights_only_and_starts_at_iteration_zero(tmp_path):
    root = tmp_path / "ckpt"
    run_script("pretrain_llama.py", FLAGS + ["--save", root, "--train-iters", "2"])
    proc = run_script("pretrain_llama.py", FLAGS + ["--load", root, "--finetune",
                                                    "--train-iters", "2"])
    its = re.findall(r" iteration +(\d+)/", proc.stdout)
    assert its == ["1", "2"] and "at iteration 0" in proc.stdout


def _failed_run(flags):
    """The error output of a run meant to fail: forked from the bad-input catalogue's warm
    server, as ``python pretrain_llama.py`` (its exit code is the test), not the pool's."""
    return _error(run_forked("pretrain_llama.py", flags))


def _error(proc):
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    return proc.stderr


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("saved") / "ckpt"
    proc = run_script("pretrain_llama.py", FLAGS + ["--save", root, "--train-iters", "2",
                                                    "--no-save-optim"])
    parse_losses(proc)
    return root


def test_load_errors_say_what_is_wrong(tmp_path, saved):
    missing = tmp_path / "missing"
    err = _failed_run(FLAGS + ["--load", missing])
    assert f"--load {missing}: there is no checkpoint there" in err
    err = _failed_run(FLAGS + ["--load", saved, "--ckpt-step", "7"])
    assert "--ckpt-step 7" in err and "[2]" in err
    err = _failed_run(FLAGS + ["--load", saved])
    assert "holds no optimizer state" in err and "--no-load-optim" in err
    other = without(FLAGS, "--ffn-hidden-size") + ["--ffn-hidden-size", "64"]
    err = _failed_run(other + ["--load", saved, "--no-load-optim"])
    assert "was trained with --ffn-hidden-size 48, this run has --ffn-hidden-size 64" in err \
        and "--use-checkpoint-args" in err  # the saved args name the flag, before any shape


def test_corrupt_checkpoint_file_is_named(tmp_path, saved):
    import shutil

    root = tmp_path / "ckpt"
    shutil.copytree(saved, root)
    path = root / "iter_0000002" / "shard_00000.safetensors"  # the sharded default format
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size // 3)
    err = _failed_run(FLAGS + ["--load", root, "--no-load-optim"])
    assert str(path) in err and "truncated" in err and "--ckpt-step" in err
