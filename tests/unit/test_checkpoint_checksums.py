"""Checksums of checkpoint bytes (issue 38): an index edited to point one tensor's piece at
another tensor's bytes, a flipped byte in a shard file or a torch file, partial reads while
resharding, and a checkpoint from before checksums (loads, one warning).

The sharded checkpoints here are written by the offline writer (offline_sharded.py, the
same write_shard_file as training) and read through ShardedReader, as a load reads them."""
import json
import os
import struct

import pytest
import torch

from megatron.training.checkpointing import checksums
from megatron.training.checkpointing.boxes import Placement, placement_of
from megatron.training.checkpointing.offline_sharded import (
    checkpoint_tensors,
    open_checkpoint,
    whole_tensor,
    write_checkpoint,
)
from megatron.training.checkpointing.paths import CheckpointError
from megatron.training.checkpointing.safe_io import atomic_save, safe_load
from megatron.training.checkpointing.shard_file import ShardFile
from megatron.training.checkpointing.sharded_index import CHECKSUMS, METADATA_FILE

BLOCK = checksums.BLOCK_BYTES
QKV0 = "decoder.layers.0.self_attention.linear_qkv.weight"
QKV1 = "decoder.layers.1.self_attention.linear_qkv.weight"
PROJ = "decoder.layers.0.self_attention.linear_proj.weight"  # split by columns over TP
SHARD = "shard_00000.safetensors"


def _model():
    gen = torch.Generator().manual_seed(0)
    return {QKV0: torch.randn(96, 32, generator=gen), QKV1: torch.randn(96, 32, generator=gen),
            PROJ: torch.randn(512, 1536, generator=gen)}  # 3 MiB: 3 blocks


def _saved(tmp_path):
    model = _model()
    return write_checkpoint(str(tmp_path / "ckpt"), model, {}, {}, 1), model


def _meta(directory):
    with open(os.path.join(directory, METADATA_FILE)) as f:
        return json.load(f)


def _write_meta(directory, meta):
    with open(os.path.join(directory, METADATA_FILE), "w") as f:
        json.dump(meta, f)


def _flip(path, at):
    with open(path, "r+b") as f:
        f.seek(at)
        byte = f.read(1)
        f.seek(at)
        f.write(bytes([byte[0] ^ 0x10]))


def _byte_of(directory, key, element):
    """Where element ``element`` of ``key`` lies in the shard file."""
    shard = ShardFile(os.path.join(directory, SHARD))
    dtype, _, begin = shard.entries[key]
    return shard.data_start + begin + element * dtype.itemsize


def test_an_intact_checkpoint_reads_back_exactly(tmp_path):
    directory, model = _saved(tmp_path)
    _, reader = open_checkpoint(directory)
    for name, tensor in model.items():
        assert torch.equal(whole_tensor(reader, f"model/{name}"), tensor)


def test_a_piece_pointed_at_another_tensor_of_the_same_shape_is_refused(tmp_path):
    directory, model = _saved(tmp_path)
    meta = _meta(directory)
    piece = meta["tensors"][f"model/{QKV0}"]["pieces"][0]
    assert piece[1] == f"model/{QKV0}"
    piece[1] = f"model/{QKV1}"  # same shape, same box: only the bytes differ
    _write_meta(directory, meta)
    _, reader = open_checkpoint(directory)
    with pytest.raises(CheckpointError) as info:
        whole_tensor(reader, f"model/{QKV0}")
    message = str(info.value)
    assert os.path.join(directory, SHARD) in message and f"model/{QKV0}" in message
    assert "the checkpoint is damaged" in message and "--ckpt-step" in message
    # The other tensor's own piece is untouched and still reads.
    assert torch.equal(whole_tensor(reader, f"model/{QKV1}"), model[QKV1])


def test_a_flipped_byte_in_a_shard_file_is_refused_naming_the_tensor(tmp_path):
    directory, model = _saved(tmp_path)
    _flip(os.path.join(directory, SHARD), _byte_of(directory, f"model/{QKV1}", 100))
    _, reader = open_checkpoint(directory)
    assert torch.equal(whole_tensor(reader, f"model/{QKV0}"), model[QKV0])
    with pytest.raises(CheckpointError, match="do not match their checksum") as info:
        whole_tensor(reader, f"model/{QKV1}")
    message = str(info.value)
    assert os.path.join(directory, SHARD) in message and f"model/{QKV1}" in message
    assert "the checkpoint is damaged" in message and "--ckpt-step" in message


def test_partial_reads_return_exact_bytes_across_blocks(tmp_path):
    directory, model = _saved(tmp_path)
    _, reader = open_checkpoint(directory)
    full, shape = model[PROJ].reshape(-1), tuple(model[PROJ].shape)
    gen = torch.Generator().manual_seed(1)
    for _ in range(20):  # ranges starting and ending inside blocks, spanning several
        lo, hi = sorted(torch.randint(0, full.numel() + 1, (2,), generator=gen).tolist())
        got = reader.read(f"model/{PROJ}", Placement(shape, shape), lo, hi)
        assert torch.equal(got, full[lo:hi]), (lo, hi)


def test_a_partial_read_verifies_the_whole_blocks_it_overlaps(tmp_path):
    directory, model = _saved(tmp_path)
    per_block = BLOCK // 4  # fp32 elements
    _flip(os.path.join(directory, SHARD), _byte_of(directory, f"model/{PROJ}", per_block + 10))
    full, shape = model[PROJ].reshape(-1), tuple(model[PROJ].shape)
    _, reader = open_checkpoint(directory)
    # Inside block 0 only: read and correct.
    got = reader.read(f"model/{PROJ}", Placement(shape, shape), 5, per_block - 5)
    assert torch.equal(got, full[5:per_block - 5])
    # Inside block 1 but not over the flipped element: still refused (the block is checked).
    with pytest.raises(CheckpointError, match="block 1 of"):
        reader.read(f"model/{PROJ}", Placement(shape, shape), per_block + 100, per_block + 200)


def test_a_resharding_read_verifies_its_blocks(tmp_path):
    """TP=2 column halves of a tensor saved whole: read element by element through global
    coordinates (the general path), in ranges; a flipped byte in the last block is found."""
    directory, model = _saved(tmp_path)
    local = (512, 768)
    placements = [placement_of(PROJ, local, True, 2, rank, 64) for rank in range(2)]
    assert placements[0].dim == 1
    _, reader = open_checkpoint(directory)
    for rank, placement in enumerate(placements):
        want = model[PROJ][:, rank * 768:(rank + 1) * 768]
        assert torch.equal(reader.read(f"model/{PROJ}", placement).view(local), want)
    _flip(os.path.join(directory, SHARD),
          _byte_of(directory, f"model/{PROJ}", model[PROJ].numel() - 3))
    _, reader = open_checkpoint(directory)
    with pytest.raises(CheckpointError, match=f"model/{PROJ}.*block 2 of"):
        reader.read(f"model/{PROJ}", placements[1])


def test_a_torch_file_with_a_flipped_byte_is_refused(tmp_path):
    path = str(tmp_path / "model_optim_rng.pt")
    atomic_save({"w": torch.arange(100_000.0), "iteration": 3}, path)
    assert torch.equal(safe_load(path)["w"], torch.arange(100_000.0))
    with open(path, "rb") as f:
        at = f.read().index(torch.tensor([5000.0]).numpy().tobytes())
    _flip(path, at)
    # torch.load alone loads the wrong value silently: the check is what refuses it.
    assert torch.load(path, weights_only=True)["w"][5000] != 5000.0
    with pytest.raises(CheckpointError, match="does not match its checksum") as info:
        safe_load(path)
    assert path in str(info.value) and "the checkpoint is damaged" in str(info.value)
    assert "--ckpt-step" in str(info.value)


def _strip_checksums(directory):
    """Make a checkpoint look as one written before checksums: no ``checksums`` field in
    the index, no checksums in the shard files' headers (the data bytes unchanged)."""
    meta = _meta(directory)
    del meta[CHECKSUMS]
    _write_meta(directory, meta)
    for name in os.listdir(directory):
        if name.startswith("shard_"):
            path = os.path.join(directory, name)
            with open(path, "rb") as f:
                (length,) = struct.unpack("<Q", f.read(8))
                header = json.loads(f.read(length))
                data = f.read()
            del header["__metadata__"]["checksums"]
            if not header["__metadata__"]:
                del header["__metadata__"]
            text = json.dumps(header, separators=(",", ":")).encode()
            text += b" " * (-len(text) % 8)
            with open(path, "wb") as f:
                f.write(struct.pack("<Q", len(text)) + text + data)


def test_an_old_checkpoint_loads_with_one_warning(tmp_path, capsys):
    directory, model = _saved(tmp_path)
    _strip_checksums(directory)
    assert ShardFile(os.path.join(directory, SHARD)).sums is None
    capsys.readouterr()
    loaded = checkpoint_tensors(directory)  # one load: every tensor read
    err = capsys.readouterr().err
    for name, tensor in model.items():
        assert torch.equal(loaded[f"model/{name}"], tensor)
    warnings = [line for line in err.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and "carries no checksums" in warnings[0], err
    assert directory in warnings[0]


def test_a_new_checkpoint_loads_without_a_warning(tmp_path, capsys):
    directory, _ = _saved(tmp_path)
    capsys.readouterr()
    checkpoint_tensors(directory)
    assert "warning" not in capsys.readouterr().err


def test_shard_checksums_stripped_under_an_index_that_has_them_are_refused(tmp_path):
    directory, _ = _saved(tmp_path)
    meta = _meta(directory)
    _strip_checksums(directory)
    _write_meta(directory, meta)  # the index still says the shards carry checksums
    _, reader = open_checkpoint(directory)
    with pytest.raises(CheckpointError, match="carries no checksums although its index"):
        whole_tensor(reader, f"model/{QKV0}")


def test_the_save_does_not_read_its_file_back(tmp_path, monkeypatch):
    """The checksums come from the bytes as they are written: the shard file is opened once,
    write-only."""
    import builtins

    modes = []
    real_open = builtins.open

    def spy(path, mode="r", *args, **kwargs):
        if str(path).endswith(".safetensors.tmp"):
            modes.append(mode)
        return real_open(path, mode, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", spy)
    write_checkpoint(str(tmp_path / "ckpt"), _model(), {}, {}, 1)
    assert modes == ["wb"]
