"""The sharded checkpoint format (``--ckpt-format torch_dist``) without a training run: the
reshard arithmetic of boxes.py against tp_sharding.shard_tensor, and what a damaged or crafted
checkpoint gets (a CheckpointError naming the problem, never code run).

Reference test of boxes.py: a random global tensor of every partition kind is saved as the
pieces TP=a ranks hold (each cut into DP ranges, as the distributed optimizer's state is),
then read back for TP=b ranks (whole, and in other DP ranges) and compared BITWISE with
``shard_tensor`` of the global tensor (vocabulary: padded with zero rows for TP=b, as the
resharding code always did). Bitwise because reading only copies bytes.
"""
import json
import os
import pickle

import pytest
import torch

from megatron.core.models.tp_sharding import partition_of, shard_tensor
from megatron.training.checkpointing.boxes import placement_of
from megatron.training.checkpointing.checksums import ALGORITHM
from megatron.training.checkpointing.paths import CheckpointError
from megatron.training.checkpointing.shard_file import ShardFile, write_shard_file
from megatron.training.checkpointing.sharded_index import (
    CHECKSUMS,
    FORMAT,
    METADATA_FILE,
    VERSION,
    read_metadata,
    shard_file_name,
)
from megatron.training.checkpointing.sharded_load import ShardedReader, read_rng_state

VOCAB = 20  # padded to a multiple of 8 * TP: 24 (TP=1), 32 (TP=2: 4 real rows on rank 1,
#             TP=4: rank 3 holds padding only)
HIDDEN = 8
# name -> global shape; one name per partition kind (see tp_sharding._PARTITION_DIMS).
GLOBAL_SHAPES = {
    "decoder.layers.0.input_layernorm.weight": (16,),  # replicated
    "decoder.layers.0.self_attention.linear_qkv.weight": (24, HIDDEN),  # rows (dim 0)
    "decoder.layers.0.self_attention.linear_qkv.bias": (24,),  # rows of a vector
    "decoder.layers.0.self_attention.linear_proj.weight": (HIDDEN, 16),  # columns (dim 1)
    "decoder.layers.0.mlp.linear_fc1.weight": (32, HIDDEN),  # SwiGLU [gate; up]: stride 2
    "embedding.word_embeddings.weight": (VOCAB, HIDDEN),  # vocabulary, padding rows
    "output_layer.weight": (VOCAB, HIDDEN),
}
_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16"}


def _padded_vocab(tp):
    return -(-VOCAB // (8 * tp)) * 8 * tp


def _global_tensors(dtype):
    gen = torch.Generator().manual_seed(0)
    return {name: torch.randn(shape, generator=gen).to(dtype)
            for name, shape in GLOBAL_SHAPES.items()}


def _local(name, full, tp, tp_rank):
    """What TP rank ``tp_rank`` of ``tp`` holds: the reference (shard_tensor)."""
    part = partition_of(name, gated_mlp=True)
    if part is None:
        return full.clone()
    if name.endswith(("word_embeddings.weight", "output_layer.weight")):
        pad = torch.zeros(_padded_vocab(tp) - full.shape[0], *full.shape[1:], dtype=full.dtype)
        full = torch.cat([full, pad])
    return shard_tensor(full, *part, tp, tp_rank)


def _placement(name, local, tp, tp_rank):
    return placement_of(name, local.shape, True, tp, tp_rank, VOCAB)


def _dp_cuts(numel, dp, seed):
    """``dp`` contiguous ranges covering [0, numel), cut at uneven (seeded) points, some
    possibly empty: like the distributed optimizer's ranges of a parameter."""
    gen = torch.Generator().manual_seed(seed)
    inner = sorted(torch.randint(0, numel + 1, (dp - 1,), generator=gen).tolist())
    bounds = [0] + inner + [numel]
    return list(zip(bounds[:-1], bounds[1:]))


def save_as_pieces(directory, tensors, tp, dp):
    """Write ``tensors`` (global) as TP=tp x DP=dp ranks would: each rank's file holds its
    DP range of its TP shard, as 1-D pieces; a replicated tensor by TP rank 0 only. Returns
    the index (metadata.json) it wrote."""
    os.makedirs(directory, exist_ok=True)
    index = {}
    for tp_rank in range(tp):
        for dp_rank in range(dp):
            file = shard_file_name(dp_rank * tp + tp_rank)
            stored, holds = [], {}
            for n, (name, full) in enumerate(tensors.items()):
                local = _local(name, full, tp, tp_rank)
                placement = _placement(name, local, tp, tp_rank)
                local = local.reshape(-1)
                if placement.dim is None and tp_rank != 0:
                    continue
                begin, end = _dp_cuts(local.numel(), dp, seed=n)[dp_rank]
                entry = index.setdefault(f"model/{name}", {
                    "shape": list(full.shape), "dtype": _DTYPE_NAMES[full.dtype],
                    "pieces": []})
                for piece, lo, hi in placement.pieces(begin, end):
                    key = f"{name}@{len(stored)}"
                    stored.append((key, local[lo:hi]))
                    where = [list(piece.box.offset), list(piece.box.shape), piece.start,
                             piece.stop]
                    entry["pieces"].append([file, key, *where])
                    holds[key] = [f"model/{name}", *where]
            write_shard_file(os.path.join(directory, file), stored, holds=holds)
    meta = {"format": FORMAT, "version": VERSION, CHECKSUMS: ALGORITHM, "tensors": index}
    with open(os.path.join(directory, METADATA_FILE), "w") as f:
        json.dump(meta, f)
    return meta


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("saved_tp", [1, 2, 4])
@pytest.mark.parametrize("loaded_tp", [1, 2, 4])
def test_any_tp_and_dp_ranges_read_back_bitwise(tmp_path, saved_tp, loaded_tp, dtype):
    tensors = _global_tensors(dtype)
    save_as_pieces(str(tmp_path), tensors, saved_tp, dp=3)
    reader = ShardedReader(str(tmp_path), read_metadata(str(tmp_path)))
    for n, (name, full) in enumerate(tensors.items()):
        for tp_rank in range(loaded_tp):
            want = _local(name, full, loaded_tp, tp_rank)
            placement = _placement(name, want, loaded_tp, tp_rank)
            got = reader.read(f"model/{name}", placement).view(want.shape)
            assert got.dtype == dtype and torch.equal(got, want), (name, tp_rank)
            # DP ranges other than the saved ones (the distributed optimizer at DP=2).
            for begin, end in _dp_cuts(want.numel(), 2, seed=100 + n):
                got = reader.read(f"model/{name}", placement, begin, end)
                assert torch.equal(got, want.reshape(-1)[begin:end]), (name, tp_rank, begin)


def test_a_column_split_tensor_is_read_element_by_element_in_bounded_blocks(tmp_path,
                                                                             monkeypatch):
    """The general path walks its wanted piece in blocks; blocks far smaller than a piece
    give the same bytes (the block size bounds memory, not the result)."""
    import megatron.training.checkpointing.boxes as boxes

    monkeypatch.setattr(boxes, "_INDEX_BLOCK", 5)
    name = "decoder.layers.0.self_attention.linear_proj.weight"
    full = _global_tensors(torch.float32)[name]
    save_as_pieces(str(tmp_path), {name: full}, 4, dp=3)
    reader = ShardedReader(str(tmp_path), read_metadata(str(tmp_path)))
    for tp_rank in range(2):
        want = _local(name, full, 2, tp_rank)
        got = reader.read(f"model/{name}", _placement(name, want, 2, tp_rank))
        assert torch.equal(got.view(want.shape), want)


def test_a_piece_missing_from_the_index_is_named(tmp_path):
    tensors = _global_tensors(torch.float32)
    meta = save_as_pieces(str(tmp_path), tensors, 2, dp=1)
    name = "model/decoder.layers.0.mlp.linear_fc1.weight"
    meta["tensors"][name]["pieces"].pop()
    _write_meta(tmp_path, meta)
    reader = ShardedReader(str(tmp_path), read_metadata(str(tmp_path)))
    want = _local(name[len("model/"):], tensors[name[len("model/"):]], 1, 0)
    with pytest.raises(CheckpointError, match="cover .* of the .* elements"):
        reader.read(name, _placement(name, want, 1, 0))


# --- damaged and crafted checkpoints ---------------------------------------------------------

def _write_meta(directory, meta):
    with open(os.path.join(str(directory), METADATA_FILE), "w") as f:
        json.dump(meta, f)


def _small_checkpoint(directory):
    return save_as_pieces(str(directory), _global_tensors(torch.float32), 2, dp=2)


def _first_piece(meta):
    return meta["tensors"]["model/decoder.layers.0.self_attention.linear_qkv.weight"]


def _outside(meta):
    _first_piece(meta)["pieces"][0][2] = [20, 0]  # rows 20.. of a 24-row tensor, box of 12
    return "a piece lies outside the tensor"


def _path_separator(meta):
    _first_piece(meta)["pieces"][0][0] = "../x"
    return "piece file '../x' is not a shard file name"


def _absolute_path(meta):
    _first_piece(meta)["pieces"][0][0] = "/etc/passwd"
    return "is not a shard file name"


def _pickle_file(meta):
    _first_piece(meta)["pieces"][0][0] = "model_optim_rng.pt"
    return "'model_optim_rng.pt' is not a shard file name"


def _wrong_version(meta):
    meta["version"] = VERSION + 1
    return f"index version {VERSION + 1}, this code reads {VERSION}"


def _wrong_format(meta):
    meta["format"] = "torch"
    return f"not a {FORMAT} index"


def _bad_dtype(meta):
    _first_piece(meta)["dtype"] = "object"
    return "dtype 'object'"


def _shape_not_a_list(meta):
    _first_piece(meta)["shape"] = "24x8"
    return "a malformed shape"


def _negative_shape(meta):
    _first_piece(meta)["shape"] = [-24, 8]
    return "a malformed shape"


def _range_past_the_box(meta):
    piece = _first_piece(meta)["pieces"][0]
    piece[5] = piece[3][0] * piece[3][1] + 1
    return "a piece's range lies outside its box"


def _piece_too_short(meta):
    _first_piece(meta)["pieces"][0] = ["shard_00000.safetensors", "k", [0, 0]]
    return "a malformed piece"


def _no_tensors(meta):
    meta["tensors"] = []
    return "no tensor index"


@pytest.mark.parametrize("craft", [
    _outside, _path_separator, _absolute_path, _pickle_file, _wrong_version, _wrong_format,
    _bad_dtype, _shape_not_a_list, _negative_shape, _range_past_the_box, _piece_too_short,
    _no_tensors])
def test_a_crafted_index_is_a_clear_error(tmp_path, craft):
    meta = _small_checkpoint(tmp_path)
    message = craft(meta)
    _write_meta(tmp_path, meta)
    with pytest.raises(CheckpointError, match="metadata.json: .*") as info:
        read_metadata(str(tmp_path))
    assert message in str(info.value) and "--ckpt-step" in str(info.value)


def test_an_unreadable_index_is_a_clear_error(tmp_path):
    _small_checkpoint(tmp_path)
    (tmp_path / METADATA_FILE).write_text('{"format": "megatron-sharded", "vers')
    with pytest.raises(CheckpointError, match="metadata.json cannot be read"):
        read_metadata(str(tmp_path))


def _read_everything(directory, tp=2):
    reader = ShardedReader(str(directory), read_metadata(str(directory)))
    for name, full in _global_tensors(torch.float32).items():
        for tp_rank in range(tp):
            want = _local(name, full, tp, tp_rank)
            reader.read(f"model/{name}", _placement(name, want, tp, tp_rank))


@pytest.mark.parametrize("keep,message", [
    (0.5, "lies past the end of the file"),  # the header is whole, the data is not
    (4 / 1e9, "shorter than a header"),
    (None, "is missing"),
], ids=["data", "header", "missing"])
def test_a_truncated_or_missing_shard_file_is_a_clear_error(tmp_path, keep, message):
    _small_checkpoint(tmp_path)
    path = tmp_path / shard_file_name(1)
    if keep is None:
        path.unlink()
    else:
        # ``keep``: the fraction of the data kept (the header is whole, or cut when tiny)
        start = ShardFile(str(path)).data_start if keep > 0.01 else 0
        with open(path, "r+b") as f:
            f.truncate(max(4, int(start + (os.path.getsize(path) - start) * keep)))
    with pytest.raises(CheckpointError, match=message) as info:
        _read_everything(tmp_path)
    assert str(path) in str(info.value)


def test_a_header_past_the_end_of_the_file_is_a_clear_error(tmp_path):
    path = tmp_path / shard_file_name(0)
    write_shard_file(str(path), [("a", torch.ones(4))])
    data = bytearray(path.read_bytes())
    data[:8] = (len(data) * 2).to_bytes(8, "little")
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="header length .* past the end of the file"):
        ShardFile(str(path))


class _Payload:
    """Unpickling this calls ``open(marker, 'w')``: proof that code ran."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_a_pickle_in_a_sharded_checkpoint_is_refused_and_its_payload_never_runs(tmp_path):
    """As test_checkpointing's crafted-pickle test, for the sharded format: nothing in it is
    ever unpickled, so a pickle posing as a shard file or as the index, or an index pointing
    at a pickle, is an error and its payload does not run."""
    marker = tmp_path / "pwned"
    ckpt = tmp_path / "iter_0000002"
    meta = _small_checkpoint(ckpt)
    shard = ckpt / shard_file_name(0)
    payloads = {
        "torch.save": lambda path: torch.save({"w": torch.ones(2), "x": _Payload(str(marker))},
                                              path),
        "pickle": lambda path: path.write_bytes(pickle.dumps(_Payload(str(marker)))),
    }
    for write in payloads.values():
        write(shard)  # a pickle named like a shard file
        with pytest.raises(CheckpointError, match="not a readable shard file") as info:
            _read_everything(ckpt)
        assert str(shard) in str(info.value)
        assert not marker.exists()
        write(ckpt / METADATA_FILE)  # a pickle as the index
        with pytest.raises(CheckpointError, match="metadata.json cannot be read"):
            read_metadata(str(ckpt))
        assert not marker.exists()
        _write_meta(ckpt, meta)
    # An index naming a pickle beside the shards (the torch format's file name).
    payloads["torch.save"](ckpt / "model_optim_rng.pt")
    meta["tensors"]["model/output_layer.weight"]["pieces"][0][0] = "model_optim_rng.pt"
    _write_meta(ckpt, meta)
    with pytest.raises(CheckpointError, match="not a shard file name"):
        read_metadata(str(ckpt))
    assert not marker.exists()


def test_a_crafted_rng_state_is_a_clear_error(tmp_path):
    """The RNG state is JSON in the shard's header; a dtype naming a torch function instead
    of a dtype is refused, nothing called."""
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    state = {"torch": {"__tensor__": "rng/state.torch", "dtype": "torch.load", "shape": [4]}}
    write_shard_file(str(ckpt / shard_file_name(0)), [("rng/state.torch", torch.ones(4))],
                     {"rng_state": json.dumps(state)})
    meta = {"format": FORMAT, "version": VERSION, "tensors": {}}
    _write_meta(ckpt, meta)
    reader = ShardedReader(str(ckpt), read_metadata(str(ckpt)))
    with pytest.raises(CheckpointError, match="its RNG state is damaged"):
        read_rng_state(reader, 0)


# --- bytes and memory per rank (gloo ranks, the real save and load) --------------------------

def _entry_bytes(shard):
    """{kind: bytes} of one shard file's tensors, kind = model | optim | rng."""
    out = {"model": 0, "optim": 0, "rng": 0}
    for key, (dtype, shape, _) in shard.entries.items():
        numel = 1
        for s in shape:
            numel *= s
        out[key.split("/", 1)[0]] += numel * dtype.itemsize
    return out


def _save_and_load(tmp_path, kind):
    """A save of a trained model at this DP size, then a load into a fresh model and
    optimizer (other initial weights): the files' bytes per rank and the peak extra memory
    of each (tests/allocation_tracker.py)."""
    import torch.distributed as dist

    from megatron.core import parallel_state as ps
    from megatron.training.checkpointing import load_checkpoint
    from megatron.training.checkpointing.writer import CheckpointWriter
    from tests.allocation_tracker import track_allocations
    from tests.unit.test_checkpoint_save import _configs, _save, _scheduler
    from tests.unit.test_data_parallel import _global_batches
    from tests.unit.test_distributed_optimizer import _build, _train

    model, optimizer = _build(kind, bucket_size=3000)
    _train(model, optimizer, _global_batches(4, steps=2))
    configs = _configs(model, kind, save=str(tmp_path), ckpt_format="torch_dist")
    scheduler = _scheduler(optimizer)
    with track_allocations() as saving:
        _save(tmp_path, 2, model, optimizer, scheduler, configs, CheckpointWriter(False))
    saving.finish()
    dist.barrier()
    owned = sum(end - begin for shard in getattr(optimizer, "shards", [])
                for _, _, begin, end, _ in shard.pieces)
    fresh_model, fresh = _build(kind, bucket_size=3000, seed=7)
    configs = _configs(fresh_model, kind, load=str(tmp_path), ckpt_format="torch_dist")
    with track_allocations() as loading:
        load_checkpoint([fresh_model], fresh, _scheduler(fresh), configs)
    loading.finish()
    # The optimizer's part alone, installed again: one range of one key at a time.
    from megatron.training.checkpointing.layout import current_layout
    from megatron.training.checkpointing.sharded_load import read_optimizer

    iteration_dir = str(tmp_path / "iter_0000002")
    reader = ShardedReader(iteration_dir, read_metadata(iteration_dir))
    state = read_optimizer(reader, [fresh_model], current_layout([fresh_model], configs))
    with track_allocations() as installing:
        fresh.load_state_dict(state)
    installing.finish()
    params = list(model.module.parameters())
    state_keys = {k for s in optimizer.optimizer.state.values() for k, v in s.items()
                  if torch.is_tensor(v) and v.dim() > 0}
    return dict(dp_rank=ps.get_data_parallel_rank(), owned=owned, state_keys=len(state_keys),
                model_bytes=sum(p.numel() * p.element_size() for p in params),
                largest_param=max(p.numel() * p.element_size() for p in params),
                largest_bucket=max(b.grad_data.numel() for b in model._buckets()),
                buckets=len(model._buckets()), save_peak=saving.peak_temporary,
                load_peak=loading.peak_temporary, install_peak=installing.peak_temporary,
                loaded=all(torch.equal(a, b) for a, b in zip(
                    fresh_model.module.parameters(), params)))


@pytest.mark.parametrize("kind,dp", [("distributed", 2),
                                     pytest.param("distributed", 4, marks=pytest.mark.slow),
                                     ("none", 2)])
def test_each_rank_writes_its_share_and_saves_and_loads_in_bounded_memory(tmp_path, kind, dp):
    """Measured from the files: with the distributed optimizer each DP rank's file holds
    exactly its own optimizer shard (1/DP of the state, the shards differing only by the
    padding of each bucket's split), with the plain one the replicated state is spread; the
    weights are spread over the DP ranks (each tensor once; no rank more than 1/DP plus one
    tensor); a file holds nothing else than its RNG state; rank 0 alone writes the index.
    Memory (tests/allocation_tracker.py): a save allocates no more than one bucket's fp32
    elements (nothing is gathered); a load no more than one copy of the rank's own weights
    (read whole, as the torch format does, so that every rank checks them before any is
    applied) plus one parameter's range of one optimizer key at a time."""
    from tests.distributed import run_distributed

    ranks = run_distributed(_save_and_load, world_size=dp, tp=1, tmp_path=tmp_path, kind=kind)
    iteration_dir = tmp_path / "iter_0000002"
    assert sorted(os.listdir(iteration_dir)) == sorted(
        [METADATA_FILE] + [shard_file_name(r) for r in range(dp)])
    r0 = ranks[0]
    total_optim = r0["model_bytes"] * r0["state_keys"]  # fp32 model: the params are the mains
    index_bytes = os.path.getsize(iteration_dir / METADATA_FILE)
    bucket_bytes = r0["largest_bucket"] * 4
    files = [ShardFile(str(iteration_dir / shard_file_name(r))) for r in range(dp)]
    written = [_entry_bytes(f) for f in files]
    assert sum(w["model"] for w in written) == r0["model_bytes"]
    assert sum(w["optim"] for w in written) == total_optim
    for rank, (r, w, f) in enumerate(zip(ranks, written, files)):
        assert r["loaded"], rank
        assert w["model"] <= r0["model_bytes"] / dp + r0["largest_param"], (rank, w)
        if kind == "distributed":
            assert w["optim"] == r["owned"] * 4 * r0["state_keys"], (rank, w)
            padding = r0["buckets"] * dp * 4 * r0["state_keys"]
            assert abs(w["optim"] - total_optim / dp) <= padding, (rank, w, total_optim)
        else:
            assert w["optim"] <= total_optim / dp + r0["largest_param"] * r0["state_keys"]
        data = w["model"] + w["optim"] + w["rng"]
        assert os.path.getsize(f.path) == f.data_start + data  # nothing else in the file
        # The RNG state: the CPU generator and the model-parallel tracker's, 5 KB each.
        assert w["rng"] <= 4 * torch.get_rng_state().numel(), w
        # A save copies and gathers no tensor state: it allocates the index entries (plain
        # data gathered to rank 0 as pickles, about the size of metadata.json) and the RNG
        # state's copies.
        assert r["save_peak"] <= 2 * index_bytes + w["rng"], (rank, r, index_bytes)
        # A load: the weights checked and then read one tensor at a time (one parameter's
        # buffers: values, the piece read, the covered mask), then the optimizer state one
        # range of one key at a time: within one bucket with the distributed optimizer, one
        # parameter's buffers with the plain one (it holds whole parameters). Never the
        # rank's weights at once (the sharded load held them all before).
        install_bound = bucket_bytes if kind == "distributed" else 3 * r0["largest_param"]
        assert r["load_peak"] <= max(install_bound, 3 * r0["largest_param"]) < \
            r0["model_bytes"], (rank, r)
        assert 0 < r["install_peak"] <= install_bound, (rank, r)
    print({"optim_bytes_per_rank": [w["optim"] for w in written], "total_optim": total_optim,
           "model_bytes_per_rank": [w["model"] for w in written],
           "index_bytes": index_bytes, "save_peak": [r["save_peak"] for r in ranks],
           "load_peak": [r["load_peak"] for r in ranks],
           "install_peak": [r["install_peak"] for r in ranks], "bucket_bytes": bucket_bytes})
