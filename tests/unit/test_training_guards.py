"""The training run's guards on their own: token ids outside the vocabulary (the bounded
start sample, the device-side flag, the message naming the dataset), non-finite losses as NaN
iterations, MFU only with a known peak, and the signal handlers."""
import math
import os
import signal

import numpy as np
import pytest
import torch

from megatron.core.datasets.indexed_dataset import (
    IndexedDataset,
    IndexedDatasetBuilder,
    data_file_path,
    index_file_path,
)
from megatron.training.guards import exit_signal
from megatron.training.guards.nan_guard import NanGuard
from megatron.training.guards.token_guard import (
    TokenGuard,
    TokenIdError,
    check_datasets_at_start,
    indexed_datasets,
    sample_bad_id,
    scan_bad_id,
)
from megatron.training.logging.training_log import TrainingLogger


def _dataset(tmp_path, name, documents, dtype=np.uint16):
    prefix = str(tmp_path / name)
    builder = IndexedDatasetBuilder(data_file_path(prefix), dtype=dtype)
    for doc in documents:
        builder.add_document(np.asarray(doc, dtype=dtype), lengths=[len(doc)])
    builder.finalize(index_file_path(prefix))
    return IndexedDataset(prefix)


class _Gpt:  # what the guard needs of a GPTDataset / BlendedDataset
    def __init__(self, dataset=None, datasets=None):
        self.dataset, self.datasets = dataset, datasets


def test_start_sample_reads_only_its_bytes_and_finds_the_first_bad_id(tmp_path):
    # 100 tokens of uint16 = 200 bytes; the bad id 70 sits at token 60 (byte 120).
    ds = _dataset(tmp_path, "d", [list(range(50)), [1] * 10 + [70] + [2] * 39])
    assert sample_bad_id(ds, 64, sample_bytes=120) is None  # tokens 0..59 only
    assert sample_bad_id(ds, 64, sample_bytes=122) == (60, 70)
    assert scan_bad_id(ds, 64) == (60, 70)
    assert scan_bad_id(ds, 71) is None


def test_start_check_names_the_dataset_of_a_blend(tmp_path):
    good = _dataset(tmp_path, "good", [[1, 2, 3]])
    bad = _dataset(tmp_path, "bad", [[1, 2, 99]])
    blend = _Gpt(datasets=[_Gpt(good), _Gpt(bad), _Gpt(good)])
    assert [d.path_prefix for d in indexed_datasets([blend, None, _Gpt(good)])] == \
        [good.path_prefix, bad.path_prefix]
    check_datasets_at_start([_Gpt(good)], 4)
    with pytest.raises(TokenIdError, match=rf"{data_file_path(bad.path_prefix)} holds token "
                                           rf"id 99 \(at token 2\).*\[0, 10\).*retokenize"):
        check_datasets_at_start([blend], 10)


def test_sanitize_flags_on_device_and_zeroes_only_the_bad_ids(tmp_path):
    bad = _dataset(tmp_path, "bad", [[1, 2, 3, 12]])
    guard = TokenGuard(10, [_Gpt(bad)])
    clean = guard.sanitize(torch.tensor([[1, 9, 0]]))
    assert clean.tolist() == [[1, 9, 0]] and not guard.bad_on_any_rank()
    guard.check(4)  # clean: remembers where
    assert guard.sanitize(torch.tensor([[3, 10, -1, 4]])).tolist() == [[3, 0, 0, 4]]
    assert guard.sanitize(torch.tensor([[5]])).tolist() == [[5]]  # the flag stays set
    assert guard.flag.dtype == torch.bool and guard.bad_on_any_rank()
    with pytest.raises(TokenIdError) as info:
        guard.check(6)
    message = str(info.value)
    assert f"{data_file_path(bad.path_prefix)} holds token id 12 (at token 3)" in message
    assert "between iterations 5 and 6" in message
    assert "nothing was saved after iteration 4" in message


def test_nan_guard_counts_a_non_finite_loss_with_finite_gradients():
    guard = NanGuard(enabled=True, max_in_a_row=2)
    assert not guard.check(1, 0.5, {"lm loss": 3.0})
    assert not guard.check(2, 0.5, {"lm loss": math.inf})
    assert guard.check(3, 0.5, {"lm loss": math.nan})  # two in a row
    assert guard.streak == [2, 3]
    assert not guard.check(4, 0.5, {"lm loss": 3.0}) and guard.streak == []
    assert not NanGuard(enabled=False, max_in_a_row=1).check(1, math.nan, {"lm loss": math.inf})


def _logger(peak):
    printed, t = [], [0.0]
    logger = TrainingLogger(10, 8, 16, 1, flops_per_iteration=1e12, peak_tflops=peak,
                            log_interval=2, print_fn=printed.append, clock=lambda: t[0],
                            timestamps=False, memory_fn=None)
    logger.start()
    return logger, printed, t


def test_logger_counts_a_non_finite_loss_of_an_advanced_step_as_nan():
    logger, printed, t = _logger(peak=None)
    t[0] = 1.0
    logger.training_log(1, {"lm loss": math.inf}, 1e-3, 1.0, grad_norm=0.5)
    t[0] = 2.0
    logger.training_log(2, {"lm loss": 2.0}, 1e-3, 1.0, grad_norm=0.5)
    assert "number of skipped iterations:   0 | number of nan iterations:   1 |" in printed[0]


def test_mfu_only_with_a_known_peak():
    for peak, shown in ((None, None), (2.0, "MFU (%): 50.00")):
        logger, printed, t = _logger(peak)
        for iteration in (1, 2):
            t[0] = float(iteration)
            logger.training_log(iteration, {"lm loss": 2.0}, 1e-3, 1.0)
        assert ("MFU" in printed[0]) == (shown is not None), printed[0]
        assert shown is None or shown in printed[0]  # 1e12 FLOP in 1 s of a 2 TFLOP/s peak


def test_sigint_raises_interrupted_once_and_is_recorded():
    previous = exit_signal.install_sigint_handler()
    try:
        assert not exit_signal.interrupted()
        with pytest.raises(exit_signal.Interrupted):
            os.kill(os.getpid(), signal.SIGINT)
        assert exit_signal.interrupted()
        os.kill(os.getpid(), signal.SIGINT)  # torchrun's forwarded copy: no second raise
    finally:
        signal.signal(signal.SIGINT, previous)
    assert exit_signal.SIGINT_EXIT_CODE == 130


def test_exit_signal_records_sigint_like_sigterm():
    previous = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        handler = exit_signal.ExitSignal(True)
        os.kill(os.getpid(), signal.SIGINT)
        os.kill(os.getpid(), signal.SIGINT)
        assert handler._received == signal.SIGINT
        assert signal.Signals(handler._received).name == "SIGINT"
    finally:
        for signum, old in previous.items():
            signal.signal(signum, old)



_THREAD_ERRORS_AROUND_A_SIGINT = """
import os, signal, threading
from megatron.training.guards import exit_signal

def raise_in_a_thread(text):
    def fail():
        raise ConnectionResetError(text)
    thread = threading.Thread(target=fail)
    thread.start()
    thread.join()

exit_signal.install_sigint_handler()
raise_in_a_thread("before the interrupt")
try:
    os.kill(os.getpid(), signal.SIGINT)
except exit_signal.Interrupted:
    pass
raise_in_a_thread("after the interrupt")
"""


@pytest.mark.slow  # starts processes: the full suite, not the quick tier
@pytest.mark.parametrize("debug", [False, True], ids=["plain", "MEGATRON_TRACEBACK"])
def test_after_a_sigint_errors_in_background_threads_are_not_printed(debug):
    """The data loader's fd-sharing thread can lose a worker's connection while a Ctrl-C
    stops the run: its traceback followed the one error line (seen once in CI). In a child
    process: pytest replaces threading.excepthook in its own."""
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "MEGATRON_TRACEBACK"}
    if debug:
        env["MEGATRON_TRACEBACK"] = "1"
    proc = subprocess.run([sys.executable, "-c", _THREAD_ERRORS_AROUND_A_SIGINT], env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "ConnectionResetError: before the interrupt" in proc.stderr
    assert ("ConnectionResetError: after the interrupt" in proc.stderr) == debug, proc.stderr
