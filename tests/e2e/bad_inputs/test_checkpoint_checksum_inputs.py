"""Bad inputs around checkpoint checksums (issue 38): an index edited to point one tensor's
piece at another tensor's bytes (same shape) and a flipped byte in a shard file are each one
``error:`` line naming the file and the tensor, nothing written; a checkpoint from before
checksums still loads, with exactly one warning line."""
import json
import shutil
import struct

import pytest

from tests.e2e.bad_inputs.harness import assert_clean_error, listing, run
from tests.e2e.runner import LLAMA, TINY, without

CONVERT = "tools/checkpoint/convert.py"

FLAGS = without(TINY, "--train-iters", "--eval-interval") + LLAMA + [
    "--train-iters", "2", "--eval-interval", "100"]
SHARD = "shard_00000.safetensors"
QKV = "model/decoder.layers.{}.self_attention.linear_qkv.weight"


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A tiny LLaMA checkpoint of iteration 2 (weights only, the sharded default format)."""
    root = tmp_path_factory.mktemp("ckpt") / "ckpt"
    proc = run("pretrain_llama.py", FLAGS + ["--save", root, "--no-save-optim"])
    assert proc.returncode == 0, proc.stderr[-2000:]
    return root


def _copy(saved, tmp_path):
    shutil.copytree(saved, tmp_path / "ckpt")
    return tmp_path / "ckpt", tmp_path / "ckpt" / "iter_0000002"


def _edit_index(iteration_dir, edit):
    path = iteration_dir / "metadata.json"
    meta = json.loads(path.read_text())
    edit(meta)
    path.write_text(json.dumps(meta))


def _piece_points_at_another_tensor(iteration_dir):
    def edit(meta):
        pieces = [meta["tensors"][QKV.format(layer)]["pieces"][0] for layer in (0, 1)]
        assert pieces[0][2:] == pieces[1][2:]  # the same shape and box: only the bytes differ
        pieces[0][1], pieces[1][1] = pieces[1][1], pieces[0][1]
    _edit_index(iteration_dir, edit)
    return (str(iteration_dir / SHARD), QKV.format(0), "the checkpoint is damaged",
            "--ckpt-step")


def _flipped_byte(iteration_dir):
    from megatron.training.checkpointing.shard_file import ShardFile

    path = iteration_dir / SHARD
    meta = json.loads((iteration_dir / "metadata.json").read_text())
    key = meta["tensors"][QKV.format(1)]["pieces"][0][1]
    shard = ShardFile(str(path))
    at = shard.data_start + shard.entries[key][2] + 41
    data = bytearray(path.read_bytes())
    data[at] ^= 0x01
    path.write_bytes(bytes(data))
    return (str(path), QKV.format(1), "do not match their checksum",
            "the checkpoint is damaged", "--ckpt-step")


DAMAGE = {"index-piece-points-at-another-tensor": _piece_points_at_another_tensor,
          "flipped-byte-in-a-shard-file": _flipped_byte}


@pytest.mark.parametrize("damage", DAMAGE.values(), ids=DAMAGE.keys())
def test_damaged_checkpoint_bytes_are_one_line(tmp_path, saved, damage):
    ckpt, iteration_dir = _copy(saved, tmp_path)
    fragments = damage(iteration_dir)
    before = listing(ckpt)
    proc = run("pretrain_llama.py", FLAGS + ["--load", ckpt, "--no-load-optim"])
    assert_clean_error(proc, 1, *fragments)
    assert listing(ckpt) == before


def test_a_flipped_byte_in_a_torch_format_file_is_one_line(tmp_path, saved):
    """The torch format: torch.save stored each zip record's CRC-32; the load checks them."""
    import zipfile

    ckpt = tmp_path / "torch"
    proc = run(CONVERT, ["megatron-to-megatron", "--load", saved, "--save", ckpt,
                         "--tensor-model-parallel-size", "1",
                         "--pipeline-model-parallel-size", "1", "--ckpt-format", "torch"])
    assert proc.returncode == 0, proc.stderr[-2000:]
    path = ckpt / "iter_0000002" / "mp_rank_00" / "model_optim_rng.pt"
    with zipfile.ZipFile(path) as archive:
        record = max(archive.infolist(), key=lambda info: info.file_size)  # a tensor's bytes
    data = bytearray(path.read_bytes())
    name_length, extra_length = struct.unpack("<HH", data[record.header_offset + 26:
                                                          record.header_offset + 30])
    data[record.header_offset + 30 + name_length + extra_length + 7] ^= 0x01
    path.write_bytes(bytes(data))
    before = listing(ckpt)
    proc = run("pretrain_llama.py", FLAGS + ["--load", ckpt, "--no-load-optim"])
    assert_clean_error(proc, 1, str(path), record.filename, "does not match its checksum",
                       "the checkpoint is damaged", "--ckpt-step")
    assert listing(ckpt) == before


def _strip_checksums(iteration_dir):
    """As a checkpoint written before checksums looks: no ``checksums`` in the index, none in
    the shard headers (the data bytes unchanged)."""
    _edit_index(iteration_dir, lambda meta: meta.pop("checksums"))
    for path in iteration_dir.glob("shard_*.safetensors"):
        with open(path, "rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(length))
            data = f.read()
        del header["__metadata__"]["checksums"]
        text = json.dumps(header, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)
        path.write_bytes(struct.pack("<Q", len(text)) + text + data)


def test_a_checkpoint_from_before_checksums_loads_with_one_warning(tmp_path, saved):
    ckpt, iteration_dir = _copy(saved, tmp_path)
    _strip_checksums(iteration_dir)
    proc = run("pretrain_llama.py", without(FLAGS, "--train-iters") + [
        "--train-iters", "3", "--load", ckpt, "--no-load-optim"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    warnings = [line for line in proc.stderr.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and "carries no checksums" in warnings[0], proc.stderr[-3000:]
    assert str(iteration_dir) in warnings[0]
    assert f"loaded checkpoint from {iteration_dir} at iteration 2" in proc.stdout
    assert "iteration        3/       3" in proc.stdout, proc.stdout[-2000:]
