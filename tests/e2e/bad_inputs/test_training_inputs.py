"""Bad input met by the training run itself: token ids outside the model's vocabulary (found
at start or during training, at any TP), errors printed once under torchrun, --device cuda
without a GPU, Ctrl-C with and without --exit-signal-handler, and output that confused
(MFU on CPU, the scratch-start message, non-finite losses not counted)."""
import os
import re
import signal

import numpy as np
import pytest
import torch

from megatron.core.datasets.indexed_dataset import (
    IndexedDatasetBuilder,
    data_file_path,
    index_file_path,
)
from megatron.training.guards.token_guard import SAMPLE_BYTES
from tests.e2e.bad_inputs.harness import assert_clean_error, listing, run, run_torchrun, tmpfs
from tests.e2e.runner import LLAMA, TINY, finish, start_script, without

SCRIPT = "pretrain_llama.py"
VOCAB = 64  # --vocab-size of TINY: NullTokenizer ids 0..63, end-of-document 64
MODEL_VOCAB = VOCAB + 1
DATA_FLAGS = [f for f in TINY if f != "--mock-data"] + LLAMA + ["--split", "90,10,0"]
DOC = 512  # tokens per document
BAD_ID = 5000  # a bigger tokenizer's id


def _write(prefix: str, documents) -> str:
    builder = IndexedDatasetBuilder(data_file_path(prefix), dtype=np.int32)
    for doc in documents:
        builder.add_document(np.asarray(doc, dtype=np.int32), lengths=[len(doc)])
    builder.finalize(index_file_path(prefix))
    return prefix


def _good_docs(count: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    return [np.append(rng.integers(0, VOCAB, DOC - 1), VOCAB) for _ in range(count)]


@pytest.fixture(scope="module")
def oov_early(tmp_path_factory):
    """A bad id in the first document: the start check's sample holds it."""
    docs = _good_docs(40)
    docs[0][7] = BAD_ID
    return _write(str(tmp_path_factory.mktemp("early") / "data"), docs)


@pytest.fixture(scope="module")
def oov_late(tmp_path_factory):
    """Clean for the start check's first SAMPLE_BYTES, then every document has bad ids: the
    sample misses them and training meets them in its first batches."""
    clean = SAMPLE_BYTES // 4 // DOC + 1  # int32 tokens
    docs = _good_docs(clean) + [np.full(DOC, BAD_ID) for _ in range(clean)]
    return _write(str(tmp_path_factory.mktemp("late") / "data"), docs)


@pytest.fixture(scope="module")
def clean_data(tmp_path_factory):
    return _write(str(tmp_path_factory.mktemp("clean") / "data"), _good_docs(40))


def _bin(prefix: str) -> str:
    return data_file_path(prefix)


def test_oov_ids_found_at_start_name_the_dataset(oov_early, tmp_path):
    save = tmp_path / "ckpt"
    proc = run(SCRIPT, DATA_FLAGS + ["--data-path", oov_early, "--save", save])
    assert_clean_error(proc, 2, _bin(oov_early), f"token id {BAD_ID}",
                       f"vocabulary is [0, {MODEL_VOCAB})", "retokenize", "--vocab-size")
    assert not save.exists()


def test_oov_ids_the_sample_misses_stop_training_at_the_log_interval(oov_late, tmp_path):
    save = tmp_path / "ckpt"
    flags = without(DATA_FLAGS, "--log-interval", "--train-iters") + [
        "--log-interval", "2", "--train-iters", "6", "--save-interval", "4"]
    proc = run(SCRIPT, flags + ["--data-path", oov_late, "--save", save])
    line = assert_clean_error(proc, 1, _bin(oov_late), f"token id {BAD_ID}",
                              "between iterations 1 and 2", "nothing was saved after "
                              "iteration 0", "retokenize", trained=True)
    assert "IndexError" not in proc.stderr, line
    assert re.search(r" iteration +2/", proc.stdout) and \
        not re.search(r" iteration +3/", proc.stdout)  # stopped at the first log interval
    assert listing(tmp_path) == {}  # no checkpoint of the bad state


def test_oov_ids_at_tp2_are_one_error_from_rank_0(oov_late):
    """TP=2 used to train to the end with `lm loss: INF` and exit 0."""
    flags = DATA_FLAGS + ["--data-path", oov_late, "--tensor-model-parallel-size", "2"]
    proc = run_torchrun(SCRIPT, flags, nproc=2)
    assert_clean_error(proc, 1, _bin(oov_late), f"token id {BAD_ID}",
                       "between iterations 1 and 1", trained=True, torchrun=True)
    assert "INF" not in proc.stdout.upper().replace("INFO", "")


def test_a_config_error_under_torchrun_is_printed_once():
    """Each rank used to print it. torchrun exits 1 whatever its failed worker's code."""
    proc = run_torchrun(SCRIPT, without(TINY, "--global-batch-size") + LLAMA + [
        "--global-batch-size", "3"], nproc=2)
    assert_clean_error(proc, 1, "--global-batch-size 3 is not divisible", "multiple of 4",
                       torchrun=True)
    assert "exitcode  : 2" in proc.stderr  # the worker's own code: a flag was wrong


def test_device_cuda_without_a_gpu_is_one_line_before_any_work():
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    proc = run(SCRIPT, TINY + LLAMA + ["--device", "cuda"])
    assert_clean_error(proc, 2, "--device cuda", "no CUDA device", "--device cpu")
    assert "theoretical memory" not in proc.stdout  # before the model was built


def test_mfu_is_not_printed_on_cpu_unless_a_peak_is_given():
    plain = run(SCRIPT, TINY + LLAMA + ["--train-iters", "1"])
    given = run(SCRIPT, TINY + LLAMA + ["--train-iters", "1", "--peak-tflops", "0.5"])
    assert plain.returncode == 0 and given.returncode == 0, plain.stderr + given.stderr
    assert re.search(r" iteration +1/", plain.stdout) and "MFU" not in plain.stdout
    assert re.search(r"\| MFU \(%\): \d+\.\d\d \|", given.stdout)


def test_first_start_of_an_auto_resuming_run_says_one_thing(tmp_path):
    root = tmp_path / "ckpt"
    proc = run(SCRIPT, TINY + LLAMA + ["--train-iters", "1", "--save", root, "--load", root])
    assert proc.returncode == 0, proc.stderr
    said = [line for line in proc.stdout.splitlines() if "checkpoint" in line]
    assert said[0] == f"no checkpoint in {root} yet: starting from scratch"
    assert "loaded checkpoint" not in proc.stdout


def _interrupt_at(flags, iteration: int, signum=signal.SIGINT):
    """Start a long run, send ``signum`` to its process group (as a terminal's Ctrl-C does)
    once ``iteration`` is logged, and wait for it."""
    popen = start_script(SCRIPT, flags, warm=False)  # a real process group to signal
    seen = []
    for line in popen.stdout:
        seen.append(line)
        if re.search(rf" iteration +{iteration}/", line):
            os.killpg(popen.pid, signum)
            break
    proc = finish(popen, timeout=120)
    proc.stdout = "".join(seen) + proc.stdout
    return proc


# Interrupted runs keep Megatron's 2 loader workers: a Ctrl-C reaches them too.
LONG = without(TINY, "--train-iters", "--eval-interval", "--num-workers") + LLAMA + [
    "--train-iters", "100000", "--eval-interval", "100000", "--num-workers", "2"]


def test_sigint_without_the_handler_is_one_line_and_exit_130(tmp_path):
    proc = _interrupt_at(LONG + ["--save", tmp_path / "ckpt", "--save-interval", "100000"], 2)
    assert_clean_error(proc, 130, "interrupted (SIGINT) at iteration",
                       "no checkpoint was saved", "--exit-signal-handler", trained=True)
    assert listing(tmp_path) == {}  # not asked to save: nothing written


def test_sigint_with_the_handler_saves_and_exits_zero(tmp_path):
    root = tmp_path / "ckpt"
    proc = _interrupt_at(LONG + ["--save", root, "--exit-signal-handler"], 2)
    assert proc.returncode == 0, proc.stderr[-3000:]
    stopped = int((root / "latest_checkpointed_iteration.txt").read_text())
    assert f"received SIGINT: saving at iteration {stopped} and exiting" in proc.stdout
    assert "Traceback" not in proc.stderr and "error:" not in proc.stderr


def test_oov_ids_in_the_second_dataset_of_a_blend_name_that_one(clean_data, oov_early):
    proc = run(SCRIPT, DATA_FLAGS + ["--data-path", "1", clean_data, "1", oov_early])
    line = assert_clean_error(proc, 2, _bin(oov_early), f"token id {BAD_ID}")
    assert _bin(clean_data) not in line


def test_negative_token_ids_found_at_start(tmp_path):
    docs = _good_docs(40)
    docs[3][0] = -1
    prefix = _write(str(tmp_path / "neg"), docs)
    assert_clean_error(run(SCRIPT, DATA_FLAGS + ["--data-path", prefix]), 2, _bin(prefix),
                       "token id -1", f"[0, {MODEL_VOCAB})")


def test_nccl_backend_on_cpu_is_one_line():
    proc = run(SCRIPT, TINY + LLAMA, env={"MEGATRON_DIST_BACKEND": "nccl"})
    assert_clean_error(proc, 2, "MEGATRON_DIST_BACKEND=nccl needs CUDA tensors",
                       "unset MEGATRON_DIST_BACKEND")


def test_sigterm_to_the_process_group_with_loader_workers_still_saves(tmp_path):
    """What torchrun's shutdown and Slurm do: SIGTERM to the whole process group, the data
    loader's worker processes included. They ignore it; the rank finishes its iteration,
    saves and exits 0 (before, torch's worker handler exited and the rank failed on its next
    batch: "DataLoader worker ... is killed by signal: Terminated", nothing saved)."""
    root = tmp_path / "ckpt"
    flags = LONG + ["--save", root, "--exit-signal-handler"]
    proc = _interrupt_at(flags, 2, signum=signal.SIGTERM)
    assert proc.returncode == 0, proc.stderr[-3000:]
    stopped = int((root / "latest_checkpointed_iteration.txt").read_text())
    assert stopped >= 2
    assert f"received SIGTERM: saving at iteration {stopped} and exiting" in proc.stdout
    assert "Traceback" not in proc.stderr and "error:" not in proc.stderr


# --tensorboard-dir that cannot be written: found before iteration 1 (it failed inside it, with
# a traceback naming no flag), exit 2, nothing created.
def _tensorboard_is_file(tmp_path):
    (tmp_path / "tb").write_text("not a directory")
    return tmp_path / "tb", ("is a file, not a directory",
                             "give a directory path for the TensorBoard event files")


def _tensorboard_under_file(tmp_path):
    (tmp_path / "afile").write_text("x")
    return tmp_path / "afile" / "run" / "tb", (f"{tmp_path / 'afile'} is a file",
                                               "choose a --tensorboard-dir path whose parents "
                                               "are directories")


def _tree(root):
    """Every directory and file under ``root`` (an empty directory left behind shows too)."""
    return sorted(os.path.relpath(os.path.join(base, name), root)
                  for base, dirs, files in os.walk(root) for name in dirs + files)


@pytest.mark.parametrize("make", [_tensorboard_is_file, _tensorboard_under_file],
                         ids=["tensorboard-dir-is-a-file", "tensorboard-dir-under-a-file"])
def test_unusable_tensorboard_dir_is_an_error_before_training(tmp_path, make):
    tensorboard_dir, fragments = make(tmp_path)
    before = _tree(tmp_path)
    proc = run(SCRIPT, TINY + LLAMA + ["--tensorboard-dir", tensorboard_dir],
               cwd=str(tmp_path))
    assert_clean_error(proc, 2, f"--tensorboard-dir {tensorboard_dir}", *fragments)
    assert _tree(tmp_path) == before


def test_read_only_tensorboard_dir_is_an_error_before_training(tmp_path):
    with tmpfs(tmp_path / "ro", "1m", read_only=True) as mount:
        proc = run(SCRIPT, TINY + LLAMA + ["--tensorboard-dir", mount / "run" / "tb"])
        assert_clean_error(proc, 2, f"--tensorboard-dir {mount / 'run' / 'tb'} cannot be "
                           "created (read-only file system)", "choose a --tensorboard-dir "
                           "directory you can write to")
        assert _tree(mount) == []
