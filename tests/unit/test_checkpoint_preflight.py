"""The functions behind issue 22's checkpoint checks: --save probing, disk-full detection,
an incomplete checkpoint's missing directory, and the tokenizer fingerprint."""
import errno
import os

import pytest
import torch

from megatron.training.checkpointing.disk_space import (
    disk_full_message,
    looks_like_disk_full,
    tree_nbytes,
)
from megatron.training.checkpointing.load import check_rank_dirs_complete
from megatron.training.checkpointing.paths import CheckpointError
from megatron.training.checkpointing.preflight import create_output_directory, probe_writable
from megatron.training.checkpointing.safe_io import atomic_save
from megatron.training.tokenizer import fingerprint as fp
from megatron.training.tokenizer.null import NullTokenizer


def test_create_output_directory_says_what_blocks_it(tmp_path):
    (tmp_path / "f").write_text("x")
    assert "is a file, not a directory" in create_output_directory(str(tmp_path / "f"))
    problem = create_output_directory(str(tmp_path / "f" / "a" / "b"))
    assert f"{tmp_path / 'f'} is a file, not a directory" in problem
    assert create_output_directory(str(tmp_path / "new" / "dir")) is None
    assert (tmp_path / "new" / "dir").is_dir()


def test_probe_writable_leaves_nothing(tmp_path):
    assert probe_writable(str(tmp_path)) is None
    assert os.listdir(tmp_path) == []
    problem = probe_writable(str(tmp_path / "missing"))
    assert problem.startswith(f"--save {tmp_path / 'missing'} is not writable (no such file")


@pytest.mark.parametrize("exc,free,full", [
    (OSError(errno.ENOSPC, "No space left on device"), 10 << 30, True),
    (RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 576 vs 534"),
     0, True),
    (RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 576 vs 534"),
     10 << 30, False),  # plenty of room: another failure, reported as itself
    (Exception("Error while serializing: I/O error: No space left on device (os error 28)"),
     10 << 30, True),
    (OSError(errno.EACCES, "Permission denied"), 0, False),
    (ValueError("something else"), 0, False),
], ids=["enospc", "torch-zip-writer-disk-full", "torch-zip-writer-room-left", "safetensors",
        "permission", "other"])
def test_looks_like_disk_full(exc, free, full):
    assert looks_like_disk_full(exc, free, needed=4096) is full


def test_disk_full_message_names_directory_and_bytes():
    assert disk_full_message("/ckpt/iter_0000002.partial", 1234, 56, ranks=2) == (
        "no space left on device: writing /ckpt/iter_0000002.partial needs about 1234 bytes "
        "on its file system (the 2 ranks writing there), 56 were free when it began; free "
        "some space or choose a directory on a larger disk")
    # Free space at least the estimate: said, not left as a contradiction.
    assert "something else filled the disk meanwhile" in disk_full_message("/c", 10, 20)


def test_tree_nbytes_counts_each_storage_once():
    x = torch.zeros(10)
    assert tree_nbytes({"a": x, "b": [x[2:], torch.zeros(3, dtype=torch.float16)],
                        "c": "text"}) == 40 + 6


def test_atomic_save_removes_its_temporary_file_on_failure(tmp_path, monkeypatch):
    def failing_save(obj, path):
        with open(path, "wb") as f:
            f.write(b"partial")
        raise RuntimeError("unexpected pos 287680 vs 287568")

    monkeypatch.setattr(torch, "save", failing_save)
    with pytest.raises(RuntimeError, match="unexpected pos"):
        atomic_save({"x": 1}, str(tmp_path / "model.pt"))
    assert os.listdir(tmp_path) == []


def test_missing_rank_dir_is_named_with_the_saved_layout(tmp_path):
    layout = {"tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 2}
    found = {(0, 0): "a", (1, 0): "b", (0, 1): "c"}
    with pytest.raises(CheckpointError) as info:
        check_rank_dirs_complete(str(tmp_path), found, layout)
    assert str(info.value).startswith(f"{tmp_path / 'mp_rank_01_001'} is missing: the "
                                      f"checkpoint was saved with TP=2 x PP=2 (4 mp_rank_* "
                                      f"directories) and holds only 3")
    check_rank_dirs_complete(str(tmp_path), {**found, (1, 1): "d"}, layout)


def test_vocabulary_hash_depends_on_pairs_not_order():
    assert fp.vocabulary_hash({"a": 0, "b": 1}) == fp.vocabulary_hash({"b": 1, "a": 0})
    assert fp.vocabulary_hash({"a": 0, "b": 1}) != fp.vocabulary_hash({"a": 1, "b": 0})


def test_fingerprint_of_null_tokenizer_is_its_size():
    assert fp.fingerprint(NullTokenizer(64)) == fp.fingerprint(NullTokenizer(64))
    assert fp.differ(fp.fingerprint(NullTokenizer(64)), fp.fingerprint(NullTokenizer(65)))
    assert fp.fingerprint(NullTokenizer(64))["vocab_size"] == 65


def test_old_checkpoints_without_a_fingerprint_do_not_differ():
    current = fp.fingerprint(NullTokenizer(64))
    assert not fp.differ(None, current)
    assert not fp.differ({}, current)
    assert not fp.differ(current, dict(current))


def test_mismatch_warning_names_both_and_the_finetune_case():
    a = {"type": "HuggingFaceTokenizer", "source": "/tok/a", "vocab_size": 300, "sha256": "1" * 64}
    b = {**a, "source": "/tok/b", "sha256": "2" * 64}
    text = fp.mismatch_warning(a, b, "/ckpt/iter_0000002", finetune=True)
    assert text.startswith("warning: the checkpoint /ckpt/iter_0000002 was trained with the "
                           "tokenizer HuggingFaceTokenizer /tok/a (300 tokens, vocabulary "
                           "sha256 111111111111), but this run uses HuggingFaceTokenizer /tok/b")
    assert "--finetune a new tokenizer is legitimate only if the embedding rows" in text
    assert "--finetune" not in fp.mismatch_warning(a, b, "/c", finetune=False)
