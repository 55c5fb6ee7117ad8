"""Issue 36: the training loop keeps its per-iteration reports (losses, gradient norm) on the
device and the logger reads a log interval's in one host copy; each read is a host sync on
CUDA. Before: the loss ``.tolist()`` and the norm ``.item()`` every iteration (>= 2 each).

What stays per iteration where its documented behaviour needs it: the NaN check's skip of
the update and the NaN guard's loss check (``--check-for-nan-in-loss-and-grad``, the default:
one read, the optimizer's of the norm with the losses) and fp16's found_inf. What stays per log
interval: the token guard's check (guards/token_guard.py) and the logger's one read."""
import math

import pytest
import torch

from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32
from megatron.core.device import read_together
from megatron.training.logging.deferred import DeviceReport
from megatron.training.training import LossReport
from tests.sync_counter import SyncCounter
from tests.unit.test_pretrain_loop import _pretrain, world_of_one  # noqa: F401 (fixture)
from tests.unit.test_training_log import _logger

LOG_INTERVAL = 5
INTERVALS = 10 // LOG_INTERVAL  # in the 10 iterations counted
# Reads per log interval, by others than the logger: the token guard's flag (guards/
# token_guard.py) and the timers' cross-rank table (logging/timers.py, also at level 0).
OTHER_READS_PER_LOG_INTERVAL = 2
FLAGS = ["--log-interval", str(LOG_INTERVAL), "--eval-interval", "1000", "--num-workers", "0"]
# On CPU the device is the host, so the counter sees the batch's host-to-device copy
# (tensor_parallel/data.py) as a .to(cpu); on CUDA it is no read.
HOST_TO_DEVICE_ON_CPU = "tensor_parallel/data.py"
# Where a one-copy read of several tensors happens (device.read_together): the logger's at the
# log interval, or the optimizer's (the norm with the iteration's losses) under the NaN check.
ONE_COPY_READ = "core/device.py"


def _reads(flags, iterations):
    history, _, _, syncs = _pretrain(FLAGS + flags + ["--train-iters", str(iterations)],
                                     patch=SyncCounter)
    assert len(history) == iterations and all(h["lm loss"] > 0 for h in history)
    return [call for call in syncs.calls if HOST_TO_DEVICE_ON_CPU not in call]


def _reads_of_ten_iterations(flags):
    """Reads of 20 iterations less those of 10: the start-up's drop out."""
    short, long = _reads(flags, 10), _reads(flags, 20)
    return len(long) - len(short), long


def test_fp32_loop_reads_the_device_once_per_log_interval(world_of_one):
    # Before: 20 per 10 iterations more (the loss .tolist() and the norm .item() each).
    extra, calls = _reads_of_ten_iterations(["--no-check-for-nan-in-loss-and-grad"])
    assert extra == (1 + OTHER_READS_PER_LOG_INTERVAL) * INTERVALS, calls
    # Without the check only the logger reads them: once per interval of the 20 iterations,
    # and once at iteration 1 (the run's first line, logged whatever the interval).
    assert sum(ONE_COPY_READ in call for call in calls) == 20 // LOG_INTERVAL + 1, calls


def test_with_the_nan_check_one_read_per_iteration_stays(world_of_one):
    """The default: the update's skip and the guard's stop are decided at each iteration, so
    the optimizer reads the norm, and the losses in the same copy (for the guard); the logger
    then has nothing left to read. Before: 20 per 10 iterations more, as without the check."""
    extra, calls = _reads_of_ten_iterations([])
    assert extra == 10 + OTHER_READS_PER_LOG_INTERVAL * INTERVALS, calls
    # One per iteration of the 20, all the optimizer's: the logger adds none of its own.
    assert sum(ONE_COPY_READ in call for call in calls) == 20, calls


# --- the logger: device values read at the log interval, the same scalars ------------------

class Recorder:
    def __init__(self):
        self.scalars = []

    def add_scalar(self, tag, value, step):
        self.scalars.append((tag, value, step))

    def flush(self):
        pass

    def close(self):
        pass


def _report(values):
    """A LossReport of one iteration's microbatches, made as train_step makes it (DP = 1)."""
    report = LossReport.__new__(LossReport)
    report._keys = ["lm loss"]
    report._rows = torch.tensor([[v] for v in values], dtype=torch.float32)
    report._value = None
    return report


ITERATIONS = [(1, [7.25, 7.0], 1.5), (2, [6.5, 6.25], float("inf")), (3, [6.0, 5.5], 0.75),
              (4, [float("nan"), 5.0], 2.0), (5, [4.5, 4.25], 0.5)]


def _log(logger, on_device):
    lines = []
    for iteration, losses, norm in ITERATIONS:
        if on_device:
            args = _report(losses), torch.tensor([norm])
        else:
            means = {"lm loss": float(sum(torch.tensor(losses).tolist()) / len(losses))}
            args = means, float(torch.tensor(norm))
        lines.append(logger.training_log(iteration, args[0], 1e-4 * iteration, 1.0,
                                         skipped_iter=iteration == 2, grad_norm=args[1],
                                         consumed_samples=8 * iteration))
        if iteration == 2:  # an evaluation between log intervals
            lines.append(logger.log_validation(iteration, {"lm loss": 3.0}))
    return lines


def test_logger_reads_device_values_once_per_interval_and_writes_the_same():
    want, got = Recorder(), Recorder()
    logger, printed_floats, _ = _logger(log_interval=4, writers=[want])
    logger.start()
    lines_floats = _log(logger, on_device=False)
    logger.close()

    logger, printed, _ = _logger(log_interval=4, writers=[got])
    logger.start()
    with SyncCounter() as syncs:
        lines = _log(logger, on_device=True)
        # Iterations 1-2 before the validation scalars of iteration 2 (W&B sends a row per
        # iteration: they must not come before that iteration's), 3-4 at iteration 4.
        assert len(syncs.calls) == 2, syncs.calls
        logger.close()  # iteration 5, after the last interval
    assert len(syncs.calls) == 3, syncs.calls
    assert lines == lines_floats and printed == printed_floats and len(printed) == 4
    # The same tags, values (NaN included) and steps, in the same order.
    assert repr(got.scalars) == repr(want.scalars)
    assert ("grad-norm", math.inf, 2) in got.scalars and \
        ("lm loss", 4.375, 5) in got.scalars


def test_loss_report_is_the_old_mean_and_reads_itself_as_a_mapping():
    report = _report([7.25, 1.0 / 3.0])
    assert isinstance(report, DeviceReport) and report.pending() is not None
    rows = report.pending().tolist()
    assert dict(report) == {"lm loss": float((rows[0][0] + rows[1][0]) / 2)}
    assert report.pending() is None


def test_read_together_gives_what_tolist_gives():
    tensors = [torch.tensor([1.0 / 3.0, 1e-40]), torch.tensor([[2.5]], dtype=torch.bfloat16),
               torch.tensor([float("nan")])]
    read = read_together(tensors)
    assert read[0] == tensors[0].tolist() and read[1] == [2.5] and math.isnan(read[2][0])


def _clip_on_the_host(grads, max_norm, total_norm: float):
    """The previous code: the coefficient from the read norm, applied only where < 1."""
    coeff = max_norm / (total_norm + 1.0e-6)
    if coeff < 1.0:
        torch._foreach_mul_(grads, coeff)


@pytest.mark.parametrize("max_norm", [0.5, 1.0, 3.0])
def test_clip_on_the_device_is_bitwise_the_host_code(max_norm):
    g = torch.Generator().manual_seed(3)
    grads = [torch.randn(n, generator=g) * s for n, s in ((17, 1.0), (5, 1e-3), (64, 30.0))]
    norms = [torch.linalg.vector_norm(torch.cat(grads)).reshape(1), torch.tensor([0.999999]),
             torch.tensor([1.0]), torch.tensor([2.9999990463]), torch.tensor([1e-12]),
             torch.tensor([math.inf]), torch.tensor([math.nan])]
    for norm in norms:
        on_host = [t.clone() for t in grads]
        _clip_on_the_host(on_host, max_norm, norm.item())
        on_device = [t.clone() for t in grads]
        clip_grad_by_total_norm_fp32(on_device, max_norm, norm)
        assert all(torch.equal(a.view(torch.int32), b.view(torch.int32))
                   for a, b in zip(on_host, on_device)), norm
