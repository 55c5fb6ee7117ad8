"""pretrain()'s loop in this process (a world of one, as a plain ``python pretrain_gpt.py``):
--num-workers reaches the DataLoader and changes no number; --timing-log-level prints
Megatron's timers. (Not in the test pool, whose ranks are daemons and cannot start DataLoader
workers; except at TP=2 with --num-workers 0: ranks without a data iterator.)"""
import contextlib
import io
import os
import re

import pytest
import torch.distributed as dist

from tests.distributed import run_distributed

TINY = ("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 "
        "--max-position-embeddings 16 --micro-batch-size 2 --global-batch-size 4 "
        "--train-iters 4 --lr 1e-3 --lr-decay-style constant --mock-data "
        "--tokenizer-type NullTokenizer --vocab-size 64 --log-interval 2 --eval-interval 2 "
        "--eval-iters 1 --hidden-dropout 0 --attention-dropout 0").split()


@pytest.fixture
def world_of_one():
    """Undo what pretrain() leaves behind: the process group, parallel_state, the env vars
    initialize_megatron sets for a world of one."""
    from megatron.core import device, parallel_state

    env = dict(os.environ)
    try:
        yield
    finally:
        parallel_state.destroy_model_parallel()
        if dist.is_initialized():
            dist.destroy_process_group()
        device.set_device_type(None)
        os.environ.clear()
        os.environ.update(env)


def _pretrain(flags, patch=None):
    """Run pretrain_gpt's pretrain() with ``flags``; returns (history, stdout, loaders' settings,
    whatever ``patch()`` -- a context manager -- yields)."""
    from megatron.core import parallel_state
    from megatron.core.enums import ModelType
    from megatron.core.models import GPTModel
    from megatron.training import gpt_step
    from megatron.training import pretrain as pretrain_module

    loaders = []
    build = pretrain_module.build_pretraining_data_loader

    def recording(*args, **kwargs):
        loader = build(*args, **kwargs)
        loaders.append((loader.num_workers, loader.persistent_workers, loader.pin_memory))
        return loader

    pretrain_module.build_pretraining_data_loader = recording
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out), (patch or contextlib.nullcontext)() as patched:
            history = pretrain_module.pretrain(
                gpt_step.train_valid_test_datasets_provider,
                gpt_step.model_provider_for(GPTModel), ModelType.encoder_or_decoder,
                gpt_step.forward_step, argv=TINY + flags)
    finally:
        pretrain_module.build_pretraining_data_loader = build
        parallel_state.destroy_model_parallel()  # the next run initializes it again
    return history, out.getvalue(), loaders, patched


def test_num_workers_reaches_the_data_loader_and_changes_no_loss(world_of_one):
    history0, _, loaders0, _ = _pretrain(["--num-workers", "0"])
    history2, out2, loaders2, _ = _pretrain(["--num-workers", "2"])
    # Train and validation loaders; workers kept across epochs and evaluations; pinned
    # memory only on CUDA.
    assert loaders0 == [(0, False, False)] * 2
    assert loaders2 == [(2, True, False)] * 2
    assert len(history2) == 4 and all(h["lm loss"] > 0 for h in history2)
    assert history2 == history0  # bitwise: the samplers decide the order, not the workers
    assert "validation loss at iteration 4" in out2


@contextlib.contextmanager
def _counting_synchronize():
    from megatron.core import device

    calls = []
    original = device.synchronize
    device.synchronize = lambda: (calls.append(1), original())[1]
    try:
        yield calls
    finally:
        device.synchronize = original


TIMER_LINE = re.compile(r"^    (\S+) \.*: \((\d+\.\d\d), (\d+\.\d\d)\)$")


def test_timing_log_level_prints_megatrons_timers_and_syncs_only_to_read_them(world_of_one):
    history, out, _, syncs = _pretrain(["--timing-log-level", "2", "--num-workers", "0"],
                                       patch=_counting_synchronize)
    # iteration 1 (the run's first, always logged), then 2 and 4
    assert out.count("(min, max) time across ranks (ms):") == 3
    timed = {}
    for match in filter(None, map(TIMER_LINE.match, out.splitlines())):
        timed.setdefault(match.group(1), []).append(
            (float(match.group(2)), float(match.group(3))))
    # Levels 1 and 2 of Megatron's names that the loop and the forward step time (the
    # schedule's backward-compute and p2p timers are not wired).
    assert set(timed) == {"forward-backward", "forward-compute", "batch-generator",
                          "all-grads-sync", "optimizer"}
    for name, values in timed.items():
        # One rank: the (min, max) pair is one reading twice; the cross-rank min/max itself
        # is checked exactly in test_timers.py.
        assert len(values) == 3 and all(low > 0 for low, _ in values), name
    # The device is waited for once per read of the timers, i.e. once per logged iteration.
    assert len(syncs) == 3
    # Level 0 (the default): no timer lines and no synchronize at all.
    history0, out0, _, syncs0 = _pretrain(["--num-workers", "0"], patch=_counting_synchronize)
    assert "time across ranks" not in out0 and syncs0 == []
    assert history0 == history  # timing changes no number


def _pretrain_on_pool(flags):
    os.environ["WORLD_SIZE"] = str(dist.get_world_size())  # build_configs' world size
    history, out, loaders, _ = _pretrain(flags)
    return history, loaders


def test_tp_ranks_without_a_data_iterator_train_and_evaluate():
    # TP rank 1 reads no batch (it receives TP rank 0's), so it has no loader, yet it must
    # join every step and every evaluation (deciding evaluation by the iterator hung).
    ranks = run_distributed(_pretrain_on_pool, world_size=2, timeout=120,
                            flags=["--tensor-model-parallel-size", "2", "--num-workers", "0"])
    (history0, loaders0), (history1, loaders1) = ranks
    assert len(loaders0) == 2 and loaders1 == []
    assert len(history0) == 4 and history0 == history1


@pytest.mark.slow  # starts processes: the full suite, not the quick tier
def test_error_exit_tears_down_the_process_group_first():
    """An exit with an agreed error destroys the process group before the interpreter's
    teardown, where gloo's threads can abort the process ("terminate called without an
    active exception", exit -6 instead of 1: seen once in the e2e load-error test)."""
    import subprocess
    import sys

    code = (
        "import atexit, os, torch.distributed as dist\n"
        "os.environ.update(MASTER_ADDR='127.0.0.1', MASTER_PORT='0')\n"
        "dist.init_process_group('gloo', rank=0, world_size=1)\n"
        "atexit.register(lambda: print('still initialized:', dist.is_initialized()))\n"
        "from megatron.training.pretrain import _exit_with\n"
        "_exit_with(ValueError('the checkpoint is bad'), code=1)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "RANK": "0"})
    assert done.returncode == 1, done.stderr
    assert done.stderr.strip().splitlines()[-1] == "error: the checkpoint is bad", done.stderr
    assert "still initialized: False" in done.stdout, done.stdout
