"""Checkpoint building blocks without a training run: safe loading (a crafted pickle does not
run), corrupt files, the tracker file, the fault-injection switch, the async writer, and the
resharding arithmetic against the unsharded tensors."""
import os
import pickle

import pytest
import torch

from megatron.core.models.tp_sharding import shard_tensor
from megatron.training.checkpointing.paths import (
    CheckpointError,
    complete_iterations,
    read_tracker,
    write_tracker,
)
from megatron.training.checkpointing.reshard import (
    join_optimizer_params,
    merge_tensor_parallel,
    renumber_layers,
    shard_for_rank,
    split_optimizer_params,
)
from megatron.training.checkpointing.safe_io import atomic_save, safe_load
from megatron.training.checkpointing.writer import CheckpointWriter
from megatron.training.guards import fault_injection
from tests.distributed import run_distributed


class _Payload:
    """Unpickling this calls ``open(marker, 'w')``: proof that code ran."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_crafted_pickle_is_refused_and_its_payload_never_runs(tmp_path):
    marker = tmp_path / "pwned"
    path = tmp_path / "model_optim_rng.pt"
    torch.save({"model": {"w": torch.ones(2)}, "evil": _Payload(str(marker))}, path)
    with pytest.raises(CheckpointError, match="refusing to load"):
        safe_load(str(path))
    assert not marker.exists()
    # A plain pickle (not torch's zip format) is refused the same way.
    with open(path, "wb") as f:
        pickle.dump(_Payload(str(marker)), f)
    with pytest.raises(CheckpointError):
        safe_load(str(path))
    assert not marker.exists()


def test_corrupt_and_missing_files_name_the_file(tmp_path):
    path = tmp_path / "model_optim_rng.pt"
    atomic_save({"w": torch.arange(1000.0)}, str(path))
    assert torch.equal(safe_load(str(path))["w"], torch.arange(1000.0))
    assert not os.path.exists(str(path) + ".tmp")
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)
    with pytest.raises(CheckpointError, match="corrupt or truncated") as info:
        safe_load(str(path))
    assert str(path) in str(info.value)
    with pytest.raises(CheckpointError, match="does not exist"):
        safe_load(str(tmp_path / "nope.pt"))


def test_tracker_file(tmp_path):
    assert read_tracker(str(tmp_path)) is None
    write_tracker(str(tmp_path), 100)
    assert read_tracker(str(tmp_path)) == (100, False)
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("release\n")
    assert read_tracker(str(tmp_path)) == (0, True)
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("garbage")
    with pytest.raises(CheckpointError, match="iteration number or 'release'"):
        read_tracker(str(tmp_path))
    for name in ("iter_0000002", "iter_0000010", "iter_0000012.partial", "release"):
        (tmp_path / name).mkdir()
    assert complete_iterations(str(tmp_path)) == [2, 10]


def test_fault_injection_switch(monkeypatch, tmp_path):
    monkeypatch.setenv(fault_injection.ENV, "nan:0:3-5")
    assert fault_injection.planned_fault() == ("nan", 0, range(3, 6))
    monkeypatch.setenv(fault_injection.ENV, "save:1:4")
    assert fault_injection.planned_fault() == ("save", 1, range(4, 5))
    monkeypatch.setenv("RANK", "0")  # another rank: nothing happens
    path = tmp_path / "f"
    path.write_bytes(b"x" * 100)
    fault_injection.maybe_crash_while_writing(str(path), 4)
    assert path.stat().st_size == 100
    # A list plans one fault per attempt; a restarted attempt beyond it runs clean.
    monkeypatch.setenv(fault_injection.ENV, "kill:1:7,save:0:10")
    assert fault_injection.planned_fault() == ("kill", 1, range(7, 8))
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    assert fault_injection.planned_fault() == ("save", 0, range(10, 11))
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "2")
    assert fault_injection.planned_fault() is None
    monkeypatch.setenv(fault_injection.ENV, "save:1:4")
    assert fault_injection.planned_fault() is None  # one fault: the first attempt only
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    monkeypatch.setenv(fault_injection.ENV, "save:one:4")
    with pytest.raises(ValueError, match="KIND:RANK:ITERATION"):
        fault_injection.planned_fault()
    monkeypatch.setenv(fault_injection.ENV, "boom:0:4")
    with pytest.raises(ValueError, match="KIND one of save, nan, kill"):
        fault_injection.planned_fault()


def _writer_protocol(async_save, tmp_path):
    """A save published only after both ranks wrote; then a save whose rank-1 write fails:
    every rank raises and nothing is published."""
    import torch.distributed as dist

    rank = dist.get_rank()
    writer = CheckpointWriter(async_save)
    published = []
    writer.submit(lambda: (tmp_path / f"part{rank}").write_text("x"),
                  lambda: published.append(sorted(os.listdir(tmp_path))))
    while writer.pending:
        writer.poll()

    def failing_write():
        if rank == 1:
            raise OSError("disk full")
    error = None
    try:
        writer.submit(failing_write, lambda: published.append("published anyway"))
        writer.wait()
    except CheckpointError as exc:
        error = str(exc)
    return published, error


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_writer_publishes_only_when_every_rank_wrote(tmp_path, async_save):
    for published, error in run_distributed(_writer_protocol, world_size=2,
                                            async_save=async_save, tmp_path=tmp_path):
        assert published == [["part0", "part1"]]  # once, after both writes, never after the failure
        assert error is not None and "rank 1" in error and "disk full" in error


def _full_model(num_layers=4, vocab=50, hidden=8, ffn=12):
    gen = torch.Generator().manual_seed(0)
    full = {"embedding.word_embeddings.weight": torch.randn(vocab, hidden, generator=gen),
            "decoder.final_layernorm.weight": torch.randn(hidden, generator=gen),
            "output_layer.weight": torch.randn(vocab, hidden, generator=gen)}
    for i in range(num_layers):
        full[f"decoder.layers.{i}.self_attention.linear_qkv.weight"] = torch.randn(
            3 * hidden, hidden, generator=gen)
        full[f"decoder.layers.{i}.self_attention.linear_proj.weight"] = torch.randn(
            hidden, hidden, generator=gen)
        full[f"decoder.layers.{i}.mlp.linear_fc1.weight"] = torch.randn(2 * ffn, hidden,
                                                                         generator=gen)
        full[f"decoder.layers.{i}.mlp.linear_fc2.weight"] = torch.randn(hidden, ffn,
                                                                         generator=gen)
        full[f"decoder.layers.{i}.input_layernorm.weight"] = torch.randn(hidden, generator=gen)
    return full


def _padded(tensor, rows):
    return torch.cat([tensor, torch.zeros(rows - tensor.shape[0], *tensor.shape[1:])])


def test_reshard_tp2_pp2_to_tp1_pp1_and_tp4_equals_the_unsharded_model():
    full = _full_model()
    vocab = 50
    # Saved at TP=2 x PP=2 with the vocabulary padded to 64; each stage holds 2 layers.
    saved = {}
    for pp, (start, end) in enumerate([(0, 2), (2, 4)]):
        for tp in range(2):
            chunk = shard_for_rank(full, (start, end), pp == 0, pp == 1, False, True, 64, 2, tp)
            saved[(tp, pp)] = (start, chunk)
    assert saved[(1, 0)][1]["embedding.word_embeddings.weight"].shape == (32, 8)
    merged = {}
    for pp in range(2):
        start = saved[(0, pp)][0]
        merged.update(renumber_layers(merge_tensor_parallel(
            [saved[(tp, pp)][1] for tp in range(2)], True, vocab), start))
    assert merged.keys() == full.keys()
    for name in full:
        assert torch.equal(merged[name], full[name]), name
    # Loaded at TP=4, one stage, vocabulary padded to 52: rank 3's shard of the padded model.
    got = shard_for_rank(merged, (0, 4), True, True, False, True, 52, 4, 3)
    want_fc1 = shard_tensor(full["decoder.layers.3.mlp.linear_fc1.weight"], 0, 2, 4, 3)
    assert torch.equal(got["decoder.layers.3.mlp.linear_fc1.weight"], want_fc1)
    want_out = shard_tensor(_padded(full["output_layer.weight"], 52), 0, 1, 4, 3)
    assert torch.equal(got["output_layer.weight"], want_out)


def test_tied_output_on_a_later_stage_comes_from_the_embedding():
    full = _full_model()
    full.pop("output_layer.weight")
    last = shard_for_rank(full, (2, 4), False, True, True, True, 50, 1, 0)
    assert torch.equal(last["output_layer.weight"], full["embedding.word_embeddings.weight"])
    assert sorted(k for k in last if k.startswith("decoder.layers.")) == sorted(
        k.replace("layers.2.", "layers.0.").replace("layers.3.", "layers.1.")
        for k in full if k.startswith(("decoder.layers.2.", "decoder.layers.3.")))


def test_untied_mtp_copy_on_a_later_stage_comes_from_the_embedding():
    """Multi-token prediction's copy of an untied embedding on the last stage (TP=2 here: the
    vocabulary padded and cut like the embedding's); none without MTP or on the first stage."""
    full = _full_model()
    full["mtp.depths.0.eh_proj"] = torch.randn(8, 16)
    last = shard_for_rank(full, (2, 4), False, True, False, True, 52, 2, 1)
    want = shard_tensor(_padded(full["embedding.word_embeddings.weight"], 52), 0, 1, 2, 1)
    assert torch.equal(last["mtp.word_embeddings.weight"], want)
    assert torch.equal(last["output_layer.weight"],
                       shard_tensor(_padded(full["output_layer.weight"], 52), 0, 1, 2, 1))
    assert "mtp.word_embeddings.weight" not in shard_for_rank(
        full, (0, 4), True, True, False, True, 52, 2, 1)
    full.pop("mtp.depths.0.eh_proj")
    assert "mtp.word_embeddings.weight" not in shard_for_rank(
        full, (2, 4), False, True, False, True, 52, 2, 1)


def test_optimizer_params_split_and_join_by_chunk():
    params = {"0/a.weight": {"exp_avg": torch.ones(2), "param": torch.zeros(2)},
              "1/a.weight": {"exp_avg": torch.full((2,), 3.0)}}
    per_key = split_optimizer_params(params, 1)
    assert list(per_key) == ["exp_avg"] and torch.equal(per_key["exp_avg"]["a.weight"],
                                                         torch.full((2,), 3.0))
    assert join_optimizer_params(per_key, 1).keys() == {"1/a.weight"}
