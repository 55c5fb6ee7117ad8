"""--use-torch-fsdp2 through pretrain_llama.py on CPU (gloo, fp32): 10 iterations at DP 2 and
4, and TP=2 x DP=2 with sequence parallelism, ZeRO-3 (default) and ZeRO-2
(--no-reshard-after-forward), against one process.

The layouts differ from one process only in the order of the gradient sums (per rank, then
the reduce-scatter over DP; the norm shard by shard), so the losses agree to 1e-6: the log's
last printed digit (7 significant digits, values near 4), i.e. at most one unit of rounding.
"""
import pytest

from tests.e2e.runner import LLAMA, TINY, finish, parse_losses, run_script, start_script

TOL = 1e-6 + 1e-12  # one unit in the printed 7th digit, and the float error of the subtraction
FLAGS = TINY + LLAMA + ["--train-iters", "10"]
ZERO2 = ["--no-reshard-after-forward"]


@pytest.fixture(scope="module")
def single_process():
    losses, valid = parse_losses(run_script("pretrain_llama.py", FLAGS))
    assert len(losses) == 10 and len(valid) == 3
    return losses + valid


def _check_runs(reference, runs):
    """Start all runs at once (they share the cost of importing torch), then compare each."""
    started = {name: start_script("pretrain_llama.py", FLAGS + ["--use-torch-fsdp2"] + extra,
                                  nproc=nproc) for name, (nproc, extra) in runs.items()}
    for name, popen in started.items():
        losses, valid = parse_losses(finish(popen, timeout=600))
        for a, b in zip(reference, losses + valid, strict=True):
            assert abs(a - b) <= TOL, (name, reference, losses + valid)


def test_fsdp2_dp2_and_dp4_equal_one_process(single_process):
    _check_runs(single_process, {"dp2 zero3": (2, []), "dp2 zero2": (2, ZERO2),
                                 "dp4 zero3": (4, []), "dp4 zero2": (4, ZERO2)})


def test_fsdp2_tp2_dp2_sequence_parallel_equals_one_process(single_process):
    tp_sp = ["--tensor-model-parallel-size", "2", "--sequence-parallel"]
    _check_runs(single_process, {"tp2 dp2 sp zero3": (4, tp_sp),
                                 "tp2 dp2 sp zero2": (4, tp_sp + ZERO2)})


def test_fsdp2_bf16_equals_ddp_bf16_at_dp2():
    """bf16 compute from fp32 shards, fp32 reduction: DDP's mixed precision (fp32 main params,
    fp32 gradient accumulation) in other sums; the same printed losses at DP=2."""
    bf16 = FLAGS + ["--bf16"]
    ddp = start_script("pretrain_llama.py", bf16, nproc=2)
    fsdp = start_script("pretrain_llama.py", bf16 + ["--use-torch-fsdp2"], nproc=2)
    want, got = parse_losses(finish(ddp)), parse_losses(finish(fsdp))
    for a, b in zip(want[0] + want[1], got[0] + got[1], strict=True):
        assert abs(a - b) <= TOL, (want, got)


def test_fsdp2_refuses_checkpoints_at_start():
    """One message, exit 2, before any work (the other refusals: tests/unit/test_fsdp2.py)."""
    proc = run_script("pretrain_llama.py", FLAGS + ["--use-torch-fsdp2", "--save", "ckpt"])
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "--use-torch-fsdp2: checkpoints" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr and "iteration" not in proc.stdout
