"""save_checkpoint in process at DP=2: a save never reads parameters an overlapped all-gather
is still writing, and --async-save snapshots into reused host buffers, writes the same bytes
as a synchronous save of the same state and resumes bitwise.

Bitwise everywhere: the resumed run repeats the same arithmetic on the same data (one layout,
no dropout), and the files hold the same tensors in the same order."""
import os

import pytest
import torch

from megatron.core.optimizer.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.training.checkpointing import load_checkpoint, save_checkpoint
from megatron.training.checkpointing.writer import CheckpointWriter
from megatron.training.training_config import MegatronConfigs, TrainingConfig
from tests.distributed import run_distributed
from tests.unit.test_data_parallel import ADAM, _assert_params, _global_batches
from tests.unit.test_distributed_optimizer import (
    _build,
    _optimizer_config,
    _snapshot,
    _train,
    recorded_param_gathers,
)


def _configs(model, kind, **training):
    return MegatronConfigs(transformer=model.config, optimizer=_optimizer_config(kind),
                           ddp=model.ddp_config, scheduler_kwargs={}, dataset=None,
                           training=TrainingConfig(**training))


def _scheduler(optimizer):
    return OptimizerParamScheduler(
        optimizer, init_lr=0.0, max_lr=ADAM["lr"], min_lr=0.0, lr_warmup_steps=0,
        lr_decay_steps=100, lr_decay_style="constant", start_wd=ADAM["weight_decay"],
        end_wd=ADAM["weight_decay"], wd_incr_steps=100, wd_incr_style="constant")


def _save(root, iteration, model, optimizer, scheduler, configs, writer):
    save_checkpoint(str(root), iteration, [model], optimizer, scheduler, configs, {},
                    iteration, 0, writer)


def _files(root):
    """{relative path: bytes} of every file under root."""
    out = {}
    for dirpath, _, names in os.walk(root):
        for name in names:
            path = os.path.join(dirpath, name)
            with open(path, "rb") as f:
                out[os.path.relpath(path, root)] = f.read()
    return out


# --- a save waits for the overlapped parameter all-gather ---------------------------------

def _saved_weights(iteration_dir):
    """The model's tensors a checkpoint of one chunk at TP=PP=1 holds, in either format."""
    from megatron.training.checkpointing.boxes import Placement
    from megatron.training.checkpointing.sharded_index import is_sharded_checkpoint, \
        read_metadata
    from megatron.training.checkpointing.sharded_load import ShardedReader

    if not is_sharded_checkpoint(str(iteration_dir)):
        path = iteration_dir / "mp_rank_00" / "model_optim_rng.pt"
        return torch.load(path, weights_only=True)["model"]
    meta = read_metadata(str(iteration_dir))
    reader = ShardedReader(str(iteration_dir), meta)
    out = {}
    for name, entry in meta["tensors"].items():
        if name.startswith("model/"):
            shape = tuple(entry["shape"])
            out[name[len("model/"):]] = reader.read(name, Placement(shape, shape)).view(shape)
    return out


def _save_right_after_an_overlapped_step(tmp_path, no_save_optim, ckpt_format):
    import torch.distributed as dist

    model, optimizer = _build("overlapped", bucket_size=3000)
    configs = _configs(model, "overlapped", no_save_optim=no_save_optim,
                       ckpt_format=ckpt_format)
    with recorded_param_gathers(model, defer=True):
        _train(model, optimizer, _global_batches(2, steps=1), finish=False)
        pending = sum(b.param_gather_handle is not None for b in model._buckets())
        _save(tmp_path, 1, model, optimizer, _scheduler(optimizer), configs,
              CheckpointWriter())
        model.finish_param_sync()
    saved = _saved_weights(tmp_path / "iter_0000001") if dist.get_rank() == 0 else None
    return pending, saved, _snapshot(model)


@pytest.mark.parametrize("ckpt_format", ["torch_dist", "torch"])
@pytest.mark.parametrize("no_save_optim", [True, False], ids=["no_save_optim", "with_optim"])
def test_save_finishes_the_overlapped_param_gather_first(tmp_path, no_save_optim, ckpt_format):
    """The all-gathers are deferred until waited (tests/unit/test_distributed_optimizer.py's
    recorder), so a save that read parameters without waiting would write rank 1's shard of
    them as it was before the step."""
    (pending, saved, params), (_, _, params1) = run_distributed(
        _save_right_after_an_overlapped_step, world_size=2, tp=1, tmp_path=tmp_path,
        no_save_optim=no_save_optim, ckpt_format=ckpt_format)
    assert pending == 1  # the step left the first bucket's all-gather to the next forward
    _assert_params(params, params1, 0)
    assert saved.keys() >= params.keys()
    _assert_params({k: saved[k] for k in params}, params, 0)


# --- --async-save: reused host buffers, same bytes, bitwise resume ---------------------------

def _async_and_sync_saves(tmp_path, kind, ckpt_format):
    model, optimizer = _build(kind, bucket_size=3000)
    scheduler = _scheduler(optimizer)
    batches = _global_batches(2, steps=3)
    writer = CheckpointWriter(async_save=True)
    pointers = []
    for iteration in (1, 2):
        _train(model, optimizer, batches[iteration - 1:iteration])
        configs = _configs(model, kind, save=str(tmp_path / "async"), ckpt_format=ckpt_format)
        _save(tmp_path / "async", iteration, model, optimizer, scheduler, configs, writer)
        pointers.append({k: b.data_ptr() for k, b in writer.host.buffers.items()})
        # The same state, saved synchronously (the async write may still be running).
        _save(tmp_path / f"sync{iteration}", iteration, model, optimizer, scheduler, configs,
              CheckpointWriter())
    after_save = _train(model, optimizer, batches[2:])  # while the last write may run
    writer.wait()
    pinned = [b.is_pinned() for b in writer.host.buffers.values()]
    return pointers, after_save, pinned, next(model.parameters()).device.type


def _resume(tmp_path, kind):
    model, optimizer = _build(kind, bucket_size=3000, seed=7)  # other initial weights
    scheduler = _scheduler(optimizer)
    configs = _configs(model, kind, load=str(tmp_path / "async"))
    loaded = load_checkpoint([model], optimizer, scheduler, configs)
    return loaded.iteration, _train(model, optimizer, _global_batches(2, steps=3)[2:])


@pytest.mark.parametrize("ckpt_format", ["torch_dist", "torch"])
@pytest.mark.parametrize("kind", ["none", "distributed"], ids=["plain", "distributed"])
def test_async_save_reuses_host_buffers_writes_sync_bytes_and_resumes(tmp_path, kind,
                                                                       ckpt_format):
    ranks = run_distributed(_async_and_sync_saves, world_size=2, tp=1, tmp_path=tmp_path,
                            kind=kind, ckpt_format=ckpt_format)
    for (first, second), _, pinned, where in ranks:
        assert first and first == second  # the second save filled the first one's buffers
        assert where == "cpu" and not any(pinned)  # pinned on CUDA: tests/gpu
    for iteration in (1, 2):
        name = f"iter_{iteration:07d}"
        want = _files(tmp_path / f"sync{iteration}" / name)
        assert want and _files(tmp_path / "async" / name) == want
        if ckpt_format == "torch_dist":  # every rank wrote its own part
            assert {"shard_00000.safetensors", "shard_00001.safetensors"} <= set(want)
        elif kind == "distributed":
            assert any(path.endswith("distrib_optim.pt") for path in want)
    for (iteration, got), (_, want, _, _) in zip(
            run_distributed(_resume, world_size=2, tp=1, tmp_path=tmp_path, kind=kind), ranks):
        assert iteration == 2
        for a, b in zip(got, want):
            _assert_params(a, b, 0)
