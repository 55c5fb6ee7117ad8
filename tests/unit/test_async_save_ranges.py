"""--async-save in the sharded format copies only the bytes each rank writes: with the
distributed optimizer a DP rank's model weights are views of one parameter buffer, and its
snapshot holds about its 1/DP share of that buffer (it used to copy the whole storage), while
the checkpoint stays bitwise the synchronous save's."""
import torch

from megatron.training.checkpointing.writer import CheckpointWriter, HostBuffers
from tests.distributed import run_distributed
from tests.unit.test_checkpoint_save import _configs, _files, _save, _scheduler
from tests.unit.test_data_parallel import _global_batches
from tests.unit.test_distributed_optimizer import _build, _train


def test_ranges_of_one_storage_are_packed_and_read_back_equal():
    base = torch.arange(1000, dtype=torch.float32)
    tree = {"head": base[:10], "gap": base[500:520],
            "overlap": base[505:530].view(5, 5).t(),  # overlaps "gap", non-contiguous
            "as_int": base[900:904].view(torch.int32),  # the same storage as another dtype
            "empty": base[700:700], "other": torch.ones(3, dtype=torch.bfloat16)}
    host = HostBuffers()
    copies = host.snapshot(tree, "t", whole_storages=False)
    for key, value in tree.items():
        assert copies[key].dtype == value.dtype and copies[key].shape == value.shape
        assert torch.equal(copies[key], value), key
    # 10 + (500..530) + 4 floats of the big storage, each range at its address modulo 16
    big = host.buffers["t/head"].numel()
    assert (10 + 30 + 4) * 4 <= big <= (10 + 30 + 4) * 4 + 3 * 16
    assert host.buffers["t/other"].numel() == 6
    base += 1  # the copies are copies
    assert torch.equal(copies["head"], torch.arange(10, dtype=torch.float32))
    whole = HostBuffers().snapshot(tree, "t")  # torch.save's way: whole storages
    assert whole["gap"].untyped_storage().nbytes() == 4000


def _async_share_and_files(tmp_path):
    model, optimizer = _build("distributed", bucket_size=3000)
    scheduler = _scheduler(optimizer)
    _train(model, optimizer, _global_batches(2, steps=1))
    configs = _configs(model, "distributed", ckpt_format="torch_dist")
    writer = CheckpointWriter(async_save=True)
    _save(tmp_path / "async", 1, model, optimizer, scheduler, configs, writer)
    _save(tmp_path / "sync", 1, model, optimizer, scheduler, configs, CheckpointWriter())
    writer.wait()
    weights = {name: b.numel() for name, b in writer.host.buffers.items()
               if name.startswith("sharded/model/")}
    param_buffer = sum(b.param_data.untyped_storage().nbytes() for b in model.buffers)
    views = all(p.untyped_storage().data_ptr() in
                {b.param_data.untyped_storage().data_ptr() for b in model.buffers}
                for p in model.module.parameters())
    return sum(weights.values()), len(weights), param_buffer, views


def test_async_sharded_save_copies_this_ranks_share_and_writes_sync_bytes(tmp_path):
    ranks = run_distributed(_async_share_and_files, world_size=2, tp=1, tmp_path=tmp_path)
    for copied, buffers, param_buffer, views in ranks:
        assert views  # every weight is a view of the parameter buffer
        assert buffers == 1  # one storage: one packed buffer
        assert 0.3 * param_buffer < copied < 0.7 * param_buffer, (copied, param_buffer)
    total = sum(copied for copied, *_ in ranks)
    assert 0.9 * ranks[0][2] < total <= ranks[0][2] + 2 * 16 * 64, (total, ranks[0][2])
    name = "iter_0000001"
    want = _files(tmp_path / "sync" / name)
    assert want and _files(tmp_path / "async" / name) == want
