"""Console, TensorBoard and W&B logging of training and validation, in Megatron's formats.

The console line keeps Megatron-LM's ``training_log`` fields, order and format specs, so
log parsers written for Megatron keep working; our extra fields (tokens/s per device, MFU,
memory, ETA) come after Megatron's last field. Semantics follow Megatron where they show in
the log: losses are averaged over the advanced (not skipped) iterations of the interval, a
loss whose average is not > 0 is not printed, NaN/inf losses are counted only on skipped
iterations, the line is printed by the last rank, validation PPL is ``exp(min(20, loss))``.
Two departures: an advanced iteration with a non-finite loss counts as a NaN iteration too
(Megatron's --check-for-nan-in-loss-and-grad would have stopped there), and MFU is printed
only when the devices' peak is known (``peak_tflops`` not None). Scalars go to every writer
alike (TensorBoard's, W&B's: see ``ScalarWriters``), so all hold the same tags and steps.
"""
import math
import resource
import sys
import time
from datetime import datetime, timedelta
from typing import Callable, Dict, Mapping, NamedTuple, Optional, Sequence, Tuple

import torch

from megatron.core import device, parallel_state
from megatron.training.logging.deferred import DeviceReport, DeviceScalar, resolve_reports
from megatron.training.logging.flops import mfu

# The timers Megatron's training_log reports; names never created are skipped.
TIMERS_TO_LOG = (
    "forward-backward", "forward-compute", "backward-compute", "batch-generator",
    "forward-recv", "forward-send", "backward-recv", "backward-send",
    "forward-send-forward-recv", "forward-send-backward-recv",
    "backward-send-forward-recv", "backward-send-backward-recv",
    "layernorm-grads-all-reduce", "embedding-grads-all-reduce", "all-grads-sync",
    "params-all-gather", "optimizer-copy-to-main-grad", "optimizer-unscale-and-check-inf",
    "optimizer-clip-main-grad", "optimizer-count-zeros", "optimizer-inner-step",
    "optimizer-copy-main-to-model-params", "optimizer",
)
PPL_LOSS_CAP = 20.0  # Megatron caps the exponent so exp() cannot overflow


def format_log_line(iteration: int, train_iters: int, consumed_samples: int,
                    elapsed_ms_per_iteration: float, learning_rate: float,
                    global_batch_size: int, losses: Mapping[str, float], loss_scale: float,
                    grad_norm: Optional[float] = None, num_zeros: Optional[float] = None,
                    params_norm: Optional[float] = None, skipped_iterations: int = 0,
                    nan_iterations: int = 0, throughput_tflops: Optional[float] = None,
                    timestamp: Optional[datetime] = None,
                    extras: Sequence[Tuple[str, str]] = (),
                    max_attention_logit: Optional[float] = None) -> str:
    """One Megatron training line; ``losses`` are interval averages; extras go at the end.
    ``max_attention_logit`` (--qk-clip, --log-max-attention-logit): the logged iteration's,
    where Megatron-LM prints it."""
    line = f" [{timestamp.strftime('%Y-%m-%d %H:%M:%S')}]" if timestamp else ""
    line += " iteration {:8d}/{:8d} |".format(iteration, train_iters)
    line += " consumed samples: {:12d} |".format(consumed_samples)
    line += " elapsed time per iteration (ms): {:.1f} |".format(elapsed_ms_per_iteration)
    if throughput_tflops is not None:
        line += f" throughput per GPU (TFLOP/s/GPU): {throughput_tflops:.1f} |"
    line += " learning rate: {:.6E} |".format(learning_rate)
    line += " global batch size: {:5d} |".format(global_batch_size)
    for key, avg in losses.items():
        if avg > 0.0:  # Megatron's rule; it also hides NaN averages
            line += " {}: {:.6E} |".format(key, avg)
    line += " loss scale: {:.1f} |".format(loss_scale)
    if grad_norm is not None:
        line += " grad norm: {:.3f} |".format(grad_norm)
    if num_zeros is not None:
        line += " num zeros: {:.1f} |".format(num_zeros)
    if params_norm is not None:
        line += " params norm: {:.3f} |".format(params_norm)
    if max_attention_logit is not None:
        line += " max attention logit: {:.3f} |".format(max_attention_logit)
    line += " number of skipped iterations: {:3d} |".format(skipped_iterations)
    line += " number of nan iterations: {:3d} |".format(nan_iterations)
    for label, value in extras:
        line += f" {label}: {value} |"
    return line


def format_validation_block(iteration: int, losses: Mapping[str, float]) -> Tuple[str, ...]:
    """Megatron's three lines: dashes, ``validation loss at iteration N | ...``, dashes."""
    string = " validation loss at iteration {} | ".format(iteration)
    for key, value in losses.items():
        string += "{} value: {:.6E} | ".format(key, value)
        string += "{} PPL: {:.6E} | ".format(key, perplexity(value))
    dashes = "-" * (len(string) + 1)
    return dashes, string, dashes


def perplexity(loss: float) -> float:
    return math.exp(min(PPL_LOSS_CAP, loss))


def format_eta(seconds: float) -> str:
    return str(timedelta(seconds=int(round(seconds))))


def is_last_rank() -> bool:
    """Megatron prints from the last rank: it holds the loss under pipeline parallelism. Under
    the V placement (--pipeline-schedule zbv) pipeline rank 0 holds the loss: the last global
    rank of that pipeline slice prints."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return True
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    if not parallel_state.model_parallel_is_initialized():
        return rank == world - 1
    return rank == parallel_state.get_loss_logging_rank()


def memory_usage() -> Tuple[str, float]:
    """(label, GiB): peak allocated on the accelerator, else this process's peak RSS."""
    allocated = device.max_memory_allocated()
    if allocated is not None:
        return "max allocated (GiB)", allocated / 2**30
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    rss_bytes = rss if sys.platform == "darwin" else rss * 1024  # Linux reports KiB
    return "max RSS (GiB)", rss_bytes / 2**30


class ScalarWriters:
    """The logger's one scalar sink: ``add_scalar(tag, value, step)``, ``flush``, ``close``
    passed to each writer (TensorBoard's SummaryWriter, ``wandb_log.WandbWriter``, a test's
    recorder); timers write through it too."""

    def __init__(self, writers):
        self.writers = list(writers)

    def add_scalar(self, tag: str, value, step: int) -> None:
        for writer in self.writers:
            writer.add_scalar(tag, value, step)

    def flush(self) -> None:
        for writer in self.writers:
            writer.flush()

    def close(self) -> None:
        for writer in self.writers:
            writer.close()


class _Step(NamedTuple):
    """One ``training_log`` call, waiting for its device values to be read."""
    iteration: int
    losses: Mapping[str, float]
    learning_rate: float
    loss_scale: float
    skipped_iter: bool
    grad_norm: Optional[float]
    num_zeros: Optional[float]
    params_norm: Optional[float]
    consumed_samples: Optional[int]
    max_attention_logit: Optional[float] = None


def _read(value):
    """A resolved device report's value (see ``_log_waiting``); other values as they are."""
    return value.value() if isinstance(value, DeviceReport) else value


def _as_float(value) -> float:
    return float(value.item() if isinstance(value, torch.Tensor) else value)


class TrainingLogger:
    """Accumulates per-iteration results; prints every ``log_interval``; writes scalars to
    TensorBoard (``tensorboard_dir``), W&B (``wandb_project``) and any ``writers`` given.

    The loop calls ``start()`` before its first step, ``training_log(...)`` after each step
    and ``log_validation(...)`` after each evaluation. Interval time comes from ``clock``
    (time since the previous log), unless the caller passes ``interval_seconds``.
    """

    def __init__(self, train_iters: int, global_batch_size: int, seq_length: int,
                 num_devices: int, flops_per_iteration: Optional[float] = None,
                 peak_tflops: Optional[float] = 989.0, log_interval: int = 100,
                 tensorboard_dir: Optional[str] = None, tensorboard_queue_size: int = 1000,
                 tensorboard_log_interval: int = 1, log_timers_to_tensorboard: bool = False,
                 log_batch_size_to_tensorboard: bool = False,
                 log_validation_ppl_to_tensorboard: bool = False,
                 log_learning_rate_to_tensorboard: bool = True,
                 log_loss_scale_to_tensorboard: bool = True, log_throughput: bool = False,
                 timers=None, timestamps: bool = True,
                 should_log: Callable[[], bool] = is_last_rank,
                 print_fn: Callable[[str], None] = lambda s: print(s, flush=True),
                 clock: Callable[[], float] = time.perf_counter,
                 now: Callable[[], datetime] = datetime.now,
                 memory_fn: Optional[Callable[[], Tuple[str, float]]] = memory_usage,
                 wandb_project: Optional[str] = None, wandb_exp_name: Optional[str] = None,
                 wandb_save_dir: str = "wandb", wandb_config: Optional[dict] = None,
                 writers: Sequence = (), fp8_peak_tflops: Optional[float] = None):
        self.train_iters, self.global_batch_size = train_iters, global_batch_size
        self.seq_length, self.num_devices = seq_length, num_devices
        self.flops_per_iteration, self.peak_tflops = flops_per_iteration, peak_tflops
        # FP8 runs: MFU against the FP8 peak as well (the same model FLOPs; only the linears'
        # GEMMs can run at that rate).
        self.fp8_peak_tflops = fp8_peak_tflops
        self.log_interval, self.tensorboard_log_interval = log_interval, tensorboard_log_interval
        self.log_timers_to_tensorboard = log_timers_to_tensorboard
        self.log_batch_size_to_tensorboard = log_batch_size_to_tensorboard
        self.log_validation_ppl_to_tensorboard = log_validation_ppl_to_tensorboard
        self.log_learning_rate_to_tensorboard = log_learning_rate_to_tensorboard
        self.log_loss_scale_to_tensorboard = log_loss_scale_to_tensorboard
        self.log_throughput, self.timers = log_throughput, timers
        self.timestamps, self.should_log, self.print_fn = timestamps, should_log, print_fn
        self.clock, self.now, self.memory_fn = clock, now, memory_fn
        writers = list(writers)
        # Whether scalars are written anywhere, the same on every rank (``self.writer`` is
        # opened on the logging rank only): ``reports`` must agree across ranks.
        self._writes_scalars = bool(writers or tensorboard_dir or wandb_project)
        if tensorboard_dir and should_log():
            from torch.utils.tensorboard import SummaryWriter
            writers.append(SummaryWriter(log_dir=tensorboard_dir,
                                         max_queue=tensorboard_queue_size))
        if wandb_project and should_log():
            from megatron.training.logging.wandb_log import open_wandb_writer
            writers.append(open_wandb_writer(wandb_project, wandb_exp_name, wandb_save_dir,
                                             dict(wandb_config or {}), print_fn))
        self.writer = ScalarWriters(writers) if writers else None
        self._waiting = []  # _Steps whose device values are read at the log interval
        self._loss_sums: Dict[str, float] = {}
        self._advanced = self._skipped = self._nan = 0
        self._interval_start = None
        self._total_seconds = 0.0  # over logged intervals, for the ETA
        self._total_iterations = 0
        self._first_iteration = None

    def start(self, first_iteration: Optional[int] = None) -> None:
        """Mark the start of the first interval (Megatron's 'interval-time' timer).
        ``first_iteration``: the run's first step, logged whatever the interval (a new run
        shows its first loss and speed at once; the next line covers the rest of the first
        interval)."""
        self._interval_start = self.clock()
        self._first_iteration = first_iteration

    def _is_log_point(self, iteration: int) -> bool:
        return iteration % self.log_interval == 0 or iteration == self._first_iteration

    def reports(self, iteration: int) -> bool:
        """Whether ``iteration``'s values are printed or written as scalars (TensorBoard,
        W&B): where a value computed only for the log is needed (--log-params-norm, a
        collective: the answer is the same on every rank)."""
        return self._is_log_point(iteration) or (
            self._writes_scalars and iteration % self.tensorboard_log_interval == 0)

    def _print(self, line: str) -> None:
        if self.should_log():
            self.print_fn(line)

    def _add(self, tag: str, value, iteration: int, consumed_samples: Optional[int]) -> None:
        self.writer.add_scalar(tag, value, iteration)
        if consumed_samples is not None:
            self.writer.add_scalar(tag + " vs samples", value, consumed_samples)

    def _accumulate(self, losses: Mapping[str, float], skipped: bool) -> None:
        """Megatron's total_loss_dict bookkeeping: skipped steps only count NaNs; a
        non-finite loss is a NaN iteration whether or not the step was skipped."""
        values = [_as_float(v) for v in losses.values()]
        self._nan += int(any(math.isnan(v) or math.isinf(v) for v in values))
        if skipped:
            self._skipped += 1
            return
        self._advanced += 1
        for key, value in losses.items():
            self._loss_sums[key] = self._loss_sums.get(key, 0.0) + _as_float(value)

    def _write_iteration_scalars(self, iteration, losses, learning_rate, loss_scale,
                                 grad_norm, num_zeros, params_norm, consumed_samples,
                                 max_attention_logit=None):
        if self.log_learning_rate_to_tensorboard:
            self._add("learning-rate", learning_rate, iteration, consumed_samples)
        if self.log_batch_size_to_tensorboard:
            self._add("batch-size", self.global_batch_size, iteration, consumed_samples)
        for key, value in losses.items():
            self._add(key, _as_float(value), iteration, consumed_samples)
        if self.log_loss_scale_to_tensorboard:
            self._add("loss-scale", loss_scale, iteration, consumed_samples)
        for tag, value in (("grad-norm", grad_norm), ("num-zeros", num_zeros),
                           ("params-norm", params_norm),
                           ("max-attention-logit", max_attention_logit)):
            if value is not None:
                self._add(tag, value, iteration, consumed_samples)

    def training_log(self, iteration: int, losses: Mapping[str, float], learning_rate: float,
                     loss_scale: float, skipped_iter: bool = False,
                     grad_norm: Optional[float] = None, num_zeros: Optional[float] = None,
                     params_norm: Optional[float] = None,
                     consumed_samples: Optional[int] = None,
                     interval_seconds: Optional[float] = None,
                     max_attention_logit: Optional[float] = None) -> Optional[str]:
        """Record one step; at the log interval print and return the console line.

        Losses (a ``deferred.DeviceReport``), a grad norm or a max attention logit (tensors)
        still on the device wait for the log interval (or ``close()``): then the interval's
        steps are read in one host copy and logged in order, so the writers get the same
        values at the same steps."""
        if isinstance(grad_norm, torch.Tensor):
            grad_norm = DeviceScalar(grad_norm)
        if isinstance(params_norm, torch.Tensor):
            params_norm = DeviceScalar(params_norm)
        if isinstance(max_attention_logit, torch.Tensor):
            max_attention_logit = DeviceScalar(max_attention_logit)
        self._waiting.append(_Step(iteration, losses, learning_rate, loss_scale, skipped_iter,
                                   grad_norm, num_zeros, params_norm, consumed_samples,
                                   max_attention_logit))
        on_device = any(isinstance(v, DeviceReport)
                        for v in (losses, grad_norm, params_norm, max_attention_logit))
        if on_device and not self._is_log_point(iteration):
            return None
        return self._log_waiting(interval_seconds)

    def _log_waiting(self, interval_seconds: Optional[float]) -> Optional[str]:
        steps, self._waiting = self._waiting, []
        resolve_reports([s.losses for s in steps] + [s.grad_norm for s in steps] +
                        [s.params_norm for s in steps] + [s.max_attention_logit for s in steps])
        line = None
        for s in steps:
            line = self._log_step(
                s.iteration, _read(s.losses), s.learning_rate, s.loss_scale, s.skipped_iter,
                _read(s.grad_norm), s.num_zeros, _read(s.params_norm), s.consumed_samples,
                interval_seconds, _read(s.max_attention_logit))
        return line

    def _log_step(self, iteration, losses, learning_rate, loss_scale, skipped_iter, grad_norm,
                  num_zeros, params_norm, consumed_samples, interval_seconds,
                  max_attention_logit=None) -> Optional[str]:
        self._accumulate(losses, skipped_iter)
        interval_iters = self._advanced + self._skipped
        # Timers are read only at the log interval: reading one synchronizes the device, and a
        # per-iteration read (Megatron writes them every --tensorboard-log-interval) would
        # stall the GPU every step.
        if self.timers is not None and self.log_timers_to_tensorboard and \
                self._is_log_point(iteration):
            self.timers.write(TIMERS_TO_LOG, self.writer, iteration, normalizer=interval_iters)
        if self.writer is not None and iteration % self.tensorboard_log_interval == 0:
            self._write_iteration_scalars(iteration, losses, learning_rate, loss_scale,
                                          grad_norm, num_zeros, params_norm, consumed_samples,
                                          max_attention_logit)
        if not self._is_log_point(iteration):
            return None
        seconds = self._interval_seconds(interval_seconds) / interval_iters
        self._total_seconds += seconds * interval_iters
        self._total_iterations += interval_iters
        throughput = self._tflops_per_device(seconds)
        if self.writer is not None and self.log_timers_to_tensorboard:
            self.writer.add_scalar("iteration-time", seconds, iteration)
            if self.log_throughput and throughput is not None:
                self.writer.add_scalar("throughput", throughput, iteration)
                if self.peak_tflops is not None:
                    self.writer.add_scalar("mfu", self._mfu(seconds), iteration)
                if self.fp8_peak_tflops is not None:
                    self.writer.add_scalar("mfu-fp8-peak", self._mfu(seconds,
                                                                     self.fp8_peak_tflops),
                                           iteration)
        line = format_log_line(
            iteration, self.train_iters,
            consumed_samples if consumed_samples is not None
            else iteration * self.global_batch_size,
            seconds * 1000.0, learning_rate, self.global_batch_size,
            {k: v / max(1, self._advanced) for k, v in self._loss_sums.items()}, loss_scale,
            grad_norm, num_zeros, params_norm, self._skipped, self._nan,
            throughput if self.log_throughput else None,
            self.now() if self.timestamps else None, self._extras(iteration, seconds),
            max_attention_logit)
        self._reset_interval()
        self._print(line)
        if self.timers is not None:
            self.timers.log(TIMERS_TO_LOG, normalizer=interval_iters, print_fn=self._print)
        return line

    def _interval_seconds(self, given: Optional[float]) -> float:
        now = self.clock()
        if given is None:
            if self._interval_start is None:
                raise RuntimeError("call TrainingLogger.start() before the first step, "
                                   "or pass interval_seconds")
            given = now - self._interval_start
        self._interval_start = now
        return given

    def _tflops_per_device(self, seconds: float) -> Optional[float]:
        if self.flops_per_iteration is None or seconds <= 0:
            return None
        return self.flops_per_iteration / (seconds * 1e12 * self.num_devices)

    def _mfu(self, seconds: float, peak: Optional[float] = None) -> float:
        return mfu(self.flops_per_iteration, seconds, self.num_devices,
                   peak or self.peak_tflops)

    def log_moe(self, iteration: int, metrics: Mapping[str, float]) -> Optional[str]:
        """The MoE layers' interval means (moe_metrics.gather_moe_metrics): one console
        line of the layer means, every entry to the writers."""
        if not metrics:
            return None
        if self.writer is not None:
            for tag, value in metrics.items():
                self.writer.add_scalar(tag if tag.startswith("moe/") else f"moe/{tag}", value,
                                       iteration)
        fields = [f" {k}: {v:.6E} |" if "loss" in k else f" {k}: {v:.3f} |"
                  for k, v in metrics.items() if not k.startswith("moe/")]
        line = f" MoE at iteration {iteration} |" + "".join(fields)
        self._print(line)
        return line

    def log_mtp(self, iteration: int, metrics: Mapping[str, float]) -> Optional[str]:
        """The multi-token prediction depths' interval means (mtp_metrics): one console line,
        every entry to the writers."""
        if not metrics:
            return None
        if self.writer is not None:
            for tag, value in metrics.items():
                self.writer.add_scalar(f"mtp/{tag}", value, iteration)
        line = f" MTP at iteration {iteration} |" + "".join(
            f" {k}: {v:.6E} |" for k, v in metrics.items())
        self._print(line)
        return line

    def _extras(self, iteration: int, seconds: float) -> Sequence[Tuple[str, str]]:
        """Our fields after Megatron's: tokens/s/device, MFU %, memory, ETA."""
        extras = []
        if seconds > 0:
            tokens = self.global_batch_size * self.seq_length / (seconds * self.num_devices)
            extras.append(("tokens per second per device", f"{tokens:.1f}"))
            if self.flops_per_iteration is not None and self.peak_tflops is not None:
                extras.append(("MFU (%)", f"{100.0 * self._mfu(seconds):.2f}"))
            if self.flops_per_iteration is not None and self.fp8_peak_tflops is not None:
                extras.append(("MFU of the FP8 peak (%)",
                               f"{100.0 * self._mfu(seconds, self.fp8_peak_tflops):.2f}"))
        if self.memory_fn is not None:
            label, gib = self.memory_fn()
            extras.append((label, f"{gib:.2f}"))
        average = self._total_seconds / max(1, self._total_iterations)
        extras.append(("ETA", format_eta(average * max(0, self.train_iters - iteration))))
        return extras

    def _reset_interval(self) -> None:
        # Keys stay (at zero) so their order is stable, as in Megatron's total_loss_dict.
        self._loss_sums = {key: 0.0 for key in self._loss_sums}
        self._advanced = self._skipped = self._nan = 0

    def log_validation(self, iteration: int, losses: Mapping[str, float],
                       consumed_samples: Optional[int] = None) -> Tuple[str, ...]:
        """Print Megatron's validation block; write '<key> validation' (and ppl) scalars."""
        if self._waiting:  # the iterations before it first, so every writer sees them in order
            self._log_waiting(None)
        values = {key: _as_float(value) for key, value in losses.items()}
        block = format_validation_block(iteration, values)
        if self.writer is not None:
            for key, value in values.items():
                self._add(f"{key} validation", value, iteration, consumed_samples)
                if self.log_validation_ppl_to_tensorboard:
                    self._add(f"{key} validation ppl", perplexity(value), iteration,
                              consumed_samples)
        for line in block:
            self._print(line)
        return block

    def close(self) -> None:
        """Flush and close the writers (TensorBoard's events sit in a queue until then; W&B's
        run is finished)."""
        if self._waiting:  # the steps since the last log interval (the run ended between)
            self._log_waiting(None)
        if self.writer is not None:
            self.writer.flush()
            self.writer.close()
            self.writer = None
