"""Timers on a fake clock, Megatron's console and validation formats, interval averaging,
and TensorBoard scalars read back from disk (FLOP counts: test_flops.py)."""
import math
import re
from datetime import datetime

import numpy as np
import pytest

from megatron.training.logging import timers as timers_module
from megatron.training.logging.timers import Timers
from megatron.training.logging.training_log import (TrainingLogger, format_log_line,
                                            format_validation_block, perplexity)


class FakeClock:
    def __init__(self, t=100.0):
        self.t = t

    def __call__(self):
        return self.t


# ---------------------------------------------------------------- timers

def test_timers_elapsed_with_fake_clock():
    clock = FakeClock()
    timers = Timers(log_level=2, clock=clock)
    fb = timers("forward-backward", log_level=1)
    for _ in range(3):
        fb.start()
        clock.t += 0.25
        fb.stop()
        clock.t += 10.0                          # time outside start/stop does not count
    assert timers("forward-backward") is fb
    assert fb.elapsed(reset=False) == 0.75
    assert timers.log_string(["forward-backward", "never-made"], normalizer=3) == \
        "time (ms) | forward-backward: 250.00"
    assert fb.elapsed() == 0.0                   # log_string reset it
    assert fb.active_time() == 0.75


def test_timer_elapsed_while_running_keeps_running(monkeypatch):
    now = [5.0]
    monkeypatch.setattr(timers_module.time, "perf_counter", lambda: now[0])
    timer = Timers(log_level=0)("interval-time", log_level=0)
    timer.start()
    now[0] = 7.5
    assert timer.elapsed(reset=True) == 2.5
    now[0] = 8.0
    timer.stop()
    assert timer.elapsed() == 0.5


def test_timers_log_level_filtering():
    timers = Timers(log_level=1, clock=FakeClock())
    timers("optimizer-inner-step", log_level=2).start()   # dummy: no error, no entry
    with pytest.raises(RuntimeError):
        timers("optimizer-inner-step", log_level=2).elapsed()
    timers("forward-backward", log_level=1).start()
    assert list(timers.get_elapsed(["optimizer-inner-step", "forward-backward"])) == \
        ["forward-backward"]
    with pytest.raises(ValueError):
        Timers(log_level=3)


def test_timers_write_to_writer():
    class Writer:
        def __init__(self):
            self.scalars = []

        def add_scalar(self, tag, value, step):
            self.scalars.append((tag, value, step))

    clock = FakeClock()
    timers = Timers(log_level=0, clock=clock)
    timers("optimizer", log_level=0).start()
    clock.t += 3.0
    timers("optimizer").stop()
    writer = Writer()
    timers.write(["optimizer", "forward-backward"], writer, iteration=7, normalizer=2)
    assert writer.scalars == [("optimizer-time", 1.5, 7)]
    assert timers("optimizer").elapsed() == 3.0           # write() does not reset


# ---------------------------------------------------------------- console line

BRIEF_LINE = (" iteration       10/     100 | consumed samples:          640 |"
              " elapsed time per iteration (ms): 1234.5 |"
              " throughput per GPU (TFLOP/s/GPU): 12.3 | learning rate: 6.000000E-05 |"
              " global batch size:    64 | lm loss: 7.123456E+00 | loss scale: 1.0 |"
              " grad norm: 1.234 | number of skipped iterations:   0 |"
              " number of nan iterations:   0 |")

# Built from Megatron's format specs: {:8d}, {:12d}, {:.1f}, {:.6E}, {:5d}, {:.3f}, {:3d}.
E6 = r"-?\d\.\d{6}E[+-]\d{2}"
MEGATRON_LINE = re.compile(
    r"^( \[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\])? iteration [ \d]{7}\d/[ \d]{7}\d \|"
    r" consumed samples: [ \d]{11}\d \| elapsed time per iteration \(ms\): \d+\.\d \|"
    r"( throughput per GPU \(TFLOP/s/GPU\): \d+\.\d \|)?"
    rf" learning rate: {E6} \| global batch size: [ \d]{{4}}\d \|"
    rf"(?P<losses>( [a-z ]+: {E6} \|)*) loss scale: \d+\.\d \|"
    r"( grad norm: \d+\.\d{3} \|)?( num zeros: \d+\.\d \|)?( params norm: \d+\.\d{3} \|)?"
    r"( max attention logit: -?\d+\.\d{3} \|)?"
    r" number of skipped iterations: [ \d]{2}\d \| number of nan iterations: [ \d]{2}\d \|"
    r"(?P<extras>.*)$")


def test_format_log_line_exact():
    line = format_log_line(10, 100, 640, 1234.5, 6e-5, 64, {"lm loss": 7.123456}, 1.0,
                           grad_norm=1.234, throughput_tflops=12.3)
    assert line == BRIEF_LINE
    assert MEGATRON_LINE.match(line)


def test_format_log_line_timestamp_and_extras_keep_megatron_prefix():
    line = format_log_line(10, 100, 640, 1234.5, 6e-5, 64, {"lm loss": 7.123456}, 1.0,
                           grad_norm=1.234, throughput_tflops=12.3,
                           timestamp=datetime(2024, 5, 6, 7, 8, 9),
                           extras=[("MFU (%)", "41.20"), ("ETA", "0:01:00")])
    assert line == " [2024-05-06 07:08:09]" + BRIEF_LINE + " MFU (%): 41.20 | ETA: 0:01:00 |"
    match = MEGATRON_LINE.match(line)
    assert match and match.group("extras") == " MFU (%): 41.20 | ETA: 0:01:00 |"


def test_loss_has_at_least_six_significant_digits():
    line = format_log_line(1, 1, 8, 1.0, 1e-4, 8, {"lm loss": 2.718281828}, 1.0)
    printed = float(re.search(r"lm loss: (\S+) \|", line).group(1))
    assert printed == 2.718282
    assert abs(printed - 2.718281828) / 2.718281828 < 5e-7


def _logger(**kwargs):
    printed = []
    clock = FakeClock()
    defaults = dict(train_iters=100, global_batch_size=8, seq_length=128, num_devices=2,
                    flops_per_iteration=2e15, peak_tflops=1000.0, log_interval=4,
                    log_throughput=True, timestamps=False, should_log=lambda: True,
                    print_fn=printed.append, clock=clock,
                    memory_fn=lambda: ("max RSS (GiB)", 1.5))
    defaults.update(kwargs)
    return TrainingLogger(**defaults), printed, clock


def test_interval_average_skips_skipped_iteration_and_counts_nan():
    logger, printed, clock = _logger()
    logger.start()
    steps = [(1, 7.25, False), (2, 7.0, False), (3, float("nan"), True), (4, 6.5, False)]
    for iteration, loss, skipped in steps:
        clock.t += 2.0
        result = logger.training_log(iteration, {"lm loss": loss}, 1e-4, 1.0,
                                     skipped_iter=skipped, grad_norm=0.5)
        assert (result is None) == (iteration < 4)
    # (7.25 + 7.0 + 6.5) / 3 advanced iterations; 8 s over 4 iterations = 2 s each.
    # 2e15 FLOPs / (2 s * 2 devices) = 500 TFLOP/s/device = 50 % of 1000; 8*128/(2*2) tok/s.
    assert printed == [
        " iteration        4/     100 | consumed samples:           32 |"
        " elapsed time per iteration (ms): 2000.0 |"
        " throughput per GPU (TFLOP/s/GPU): 500.0 | learning rate: 1.000000E-04 |"
        " global batch size:     8 | lm loss: 6.916667E+00 | loss scale: 1.0 |"
        " grad norm: 0.500 | number of skipped iterations:   1 |"
        " number of nan iterations:   1 | tokens per second per device: 256.0 |"
        " MFU (%): 50.00 | max RSS (GiB): 1.50 | ETA: 0:03:12 |"]
    assert MEGATRON_LINE.match(printed[0])
    # The next interval starts from zero counts.
    for iteration in range(5, 9):
        clock.t += 1.0
        logger.training_log(iteration, {"lm loss": 2.0}, 1e-4, 1.0)
    assert "lm loss: 2.000000E+00 | loss scale: 1.0 | number of skipped iterations:   0 |" \
        " number of nan iterations:   0 |" in printed[1]
    assert "ETA: 0:02:18 |" in printed[1]     # (8 + 4) s / 8 iterations * 92 = 138 s


def test_skipped_finite_loss_is_not_nan():
    logger, printed, clock = _logger(log_interval=2)
    logger.start()
    logger.training_log(1, {"lm loss": 3.0}, 1e-4, 65536.0, skipped_iter=True)
    logger.training_log(2, {"lm loss": 4.0}, 1e-4, 32768.0, interval_seconds=1.0)
    assert "lm loss: 4.000000E+00 | loss scale: 32768.0 |" in printed[0]
    assert "number of skipped iterations:   1 | number of nan iterations:   0 |" in printed[0]


def test_max_attention_logit_is_printed_where_megatron_prints_it():
    """--qk-clip / --log-max-attention-logit: the logged iteration's value (a device scalar,
    read with the interval's other values), after the params norm."""
    import torch
    logger, printed, clock = _logger(log_interval=2)
    logger.start()
    for iteration, value in ((1, 12.5), (2, 101.25)):
        clock.t += 1.0
        result = logger.training_log(iteration, {"lm loss": 2.0}, 1e-4, 1.0,
                                     grad_norm=torch.tensor(0.5),
                                     max_attention_logit=torch.tensor(value))
        assert (result is None) == (iteration == 1)
    assert " grad norm: 0.500 | max attention logit: 101.250 | number of skipped iterations:" \
        in printed[0]
    assert MEGATRON_LINE.match(printed[0])
    assert "max attention logit" not in format_log_line(1, 1, 8, 1.0, 1e-4, 8, {}, 1.0)


def test_only_the_logging_rank_prints(tmp_path):
    logger, printed, clock = _logger(log_interval=1, should_log=lambda: False,
                                     tensorboard_dir=str(tmp_path / "tb"))
    assert logger.writer is None
    line = logger.training_log(1, {"lm loss": 1.0}, 1e-4, 1.0, interval_seconds=1.0)
    assert line is not None and printed == []


# ---------------------------------------------------------------- validation

def test_validation_block_and_ppl():
    logger, printed, _ = _logger()
    block = logger.log_validation(10, {"lm loss": 2.5})
    text = " validation loss at iteration 10 | lm loss value: 2.500000E+00 | " \
           "lm loss PPL: 1.218249E+01 | "
    assert block == ("-" * (len(text) + 1), text, "-" * (len(text) + 1))
    assert printed == list(block)
    assert perplexity(2.5) == math.exp(2.5)


def test_validation_ppl_is_capped_like_megatron():
    assert perplexity(1000.0) == math.exp(20.0)
    _, text, _ = format_validation_block(3, {"lm loss": 1000.0})
    assert "lm loss value: 1.000000E+03 | lm loss PPL: 4.851652E+08 | " in text


# ---------------------------------------------------------------- TensorBoard

def _read_scalars(log_dir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    acc = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def f32(x):
    return float(np.float32(x))


def test_tensorboard_scalars_round_trip(tmp_path):
    clock = FakeClock()
    timers = Timers(log_level=0, clock=clock)
    logger, printed, _ = _logger(
        log_interval=2, clock=clock, timers=timers, tensorboard_dir=str(tmp_path),
        tensorboard_queue_size=5, log_timers_to_tensorboard=True,
        log_batch_size_to_tensorboard=True, log_validation_ppl_to_tensorboard=True)
    logger.start()
    losses = {1: 7.1, 2: 6.9, 3: 6.7, 4: 6.5}
    for it, loss in losses.items():
        timers("forward-backward", log_level=0).start()
        clock.t += 0.5
        timers("forward-backward").stop()
        clock.t += 0.5                                        # 1 s per iteration
        logger.training_log(it, {"lm loss": loss}, 1e-4 * it, 1.0, grad_norm=0.25 * it,
                            num_zeros=float(it), consumed_samples=8 * it)
    logger.log_validation(4, {"lm loss": 6.4}, consumed_samples=32)
    logger.close()
    assert printed[1] == "time (ms) | forward-backward: 500.00"
    scalars = _read_scalars(tmp_path)
    steps = [1, 2, 3, 4]
    assert scalars["learning-rate"] == [(s, f32(1e-4 * s)) for s in steps]
    assert scalars["learning-rate vs samples"] == [(8 * s, f32(1e-4 * s)) for s in steps]
    assert scalars["batch-size"] == [(s, 8.0) for s in steps]
    assert scalars["lm loss"] == [(s, f32(losses[s])) for s in steps]
    assert scalars["loss-scale"] == [(s, 1.0) for s in steps]
    assert scalars["grad-norm"] == [(s, 0.25 * s) for s in steps]
    assert scalars["num-zeros"] == [(s, float(s)) for s in steps]
    # Timers are read (a device sync) only at the log interval, averaged over it.
    assert scalars["forward-backward-time"] == [(2, 0.5), (4, 0.5)]
    assert scalars["iteration-time"] == [(2, 1.0), (4, 1.0)]
    # 2e15 / (1 s * 1e12 * 2 devices) = 1000 TFLOP/s/device = 100 % of 1000.
    assert scalars["throughput"] == [(2, 1000.0), (4, 1000.0)]
    assert scalars["mfu"] == [(2, 1.0), (4, 1.0)]
    assert scalars["lm loss validation"] == [(4, f32(6.4))]
    assert scalars["lm loss validation vs samples"] == [(32, f32(6.4))]
    assert scalars["lm loss validation ppl"] == [(4, f32(math.exp(6.4)))]
    assert "params-norm" not in scalars


def test_memory_usage_goes_through_device_and_works_without_torch_accelerator(monkeypatch):
    """On CUDA the peak comes from megatron.core.device (torch.cuda), not from
    torch.accelerator's memory API, which torch releases before 2.9 lack."""
    import torch

    from megatron.core import device
    from megatron.training.logging.training_log import memory_usage

    monkeypatch.setattr(device, "device_type", lambda: "cuda")
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda *a: 3 * 2**30)
    if hasattr(torch, "accelerator"):
        monkeypatch.delattr(torch.accelerator, "max_memory_allocated", raising=False)
    assert memory_usage() == ("max allocated (GiB)", 3.0)
    monkeypatch.setattr(device, "device_type", lambda: "cpu")
    label, gib = memory_usage()
    assert label == "max RSS (GiB)" and gib > 0


def test_moe_metrics_go_to_the_console_and_tensorboard(tmp_path):
    logger, printed, _ = _logger(log_interval=1, tensorboard_dir=str(tmp_path))
    metrics = {"load balancing loss": 0.0125, "z loss": 0.002,
               "max/mean tokens per expert": 1.5, "moe/load balancing loss layer 1": 0.01,
               "moe/load balancing loss layer 3": 0.015,
               "moe/max/mean tokens per expert layer 3": 1.5}
    line = logger.log_moe(7, metrics)
    logger.close()
    assert line == (" MoE at iteration 7 | load balancing loss: 1.250000E-02 | z loss: "
                    "2.000000E-03 | max/mean tokens per expert: 1.500 |")
    assert printed[-1] == line
    scalars = _read_scalars(tmp_path)
    assert scalars["moe/load balancing loss"] == [(7, f32(0.0125))]
    assert scalars["moe/load balancing loss layer 3"] == [(7, f32(0.015))]
    assert scalars["moe/max/mean tokens per expert layer 3"] == [(7, 1.5)]
    assert logger.log_moe(8, {}) is None


def test_an_fp8_run_reports_mfu_against_both_peaks():
    """2e15 FLOPs in 2 s on 2 devices: 500 TFLOP/s a device, 50 % of the bf16 peak (1000) and
    25 % of the FP8 peak (2000), both in the line; without FP8 only the first."""
    for fp8_peak, want in ((2000.0, " MFU (%): 50.00 | MFU of the FP8 peak (%): 25.00 |"),
                           (None, " MFU (%): 50.00 | max RSS")):
        logger, printed, clock = _logger(log_interval=1, fp8_peak_tflops=fp8_peak)
        logger.start()
        clock.t += 2.0
        logger.training_log(1, {"lm loss": 1.0}, 1e-4, 1.0)
        assert want in printed[0], printed
        assert MEGATRON_LINE.match(printed[0])


def test_reports_is_where_a_value_computed_for_the_log_appears():
    """--log-params-norm is computed (a collective) where ``reports`` says: the run's first
    iteration, every --log-interval and every scalar write; the same on a rank that opens no
    writer, so every rank joins the same collectives."""
    from tests.unit.test_host_syncs_per_iteration import Recorder

    recorder = Recorder()
    logger, printed, clock = _logger(log_interval=3, tensorboard_log_interval=2,
                                     writers=[recorder])
    other_rank, _, _ = _logger(log_interval=3, tensorboard_log_interval=2,
                               tensorboard_dir="/nonexistent", should_log=lambda: False)
    for each in (logger, other_rank):
        each.start(first_iteration=1)
    reported = [i for i in range(1, 9) if logger.reports(i)]
    assert reported == [1, 2, 3, 4, 6, 8]
    assert [i for i in range(1, 9) if other_rank.reports(i)] == reported
    for iteration in range(1, 9):
        clock.t += 1.0
        logger.training_log(iteration, {"lm loss": 2.0}, 1e-4, 1.0,
                            params_norm=float(iteration) if iteration in reported else None)
    assert len(printed) == 3  # iterations 1, 3, 6
    assert all(" params norm: " in line for line in printed), printed
    assert [(v, s) for tag, v, s in recorder.scalars if tag == "params-norm"] == \
        [(2.0, 2), (4.0, 4), (6.0, 6), (8.0, 8)]
    quiet, _, _ = _logger(log_interval=3, tensorboard_log_interval=2)  # no scalars written
    quiet.start(first_iteration=1)
    assert [i for i in range(1, 9) if quiet.reports(i)] == [1, 3, 6]
