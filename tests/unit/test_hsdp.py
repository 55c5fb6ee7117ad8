"""HSDP (--num-distributed-optimizer-instances): the DP ranks cut into instances that each shard
the optimizer (the distributed optimizer's buckets, or FSDP2's 2-D mesh), all-reduced across
instances, against one process on the same global batch.

The reference is test_data_parallel's (plain torch AdamW on the whole global batch). As with
the flat distributed optimizer only the order of the sums differs (within an instance, then
across), so parameters agree to REASSOCIATION_TOL. Clipping at 0.05 clips every step: a norm
that counted the second instance's copies of the shards would be sqrt(2) too large and the
parameters would move differently; a missing all-reduce across instances would halve every
gradient. The groups themselves are checked too (a flat layout passes the numbers).
"""
import pytest
import torch

from megatron.core import optimizer_instances
from megatron.core import parallel_state as ps
from megatron.core.distributed import DistributedDataParallelConfig
from megatron.core.distributed.fsdp import TorchFSDP2Config
from megatron.core.models import LlamaModel
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer_instances import instance_layout
from megatron.training.training import build_model, train_step
from tests.distributed import run_distributed
from tests.unit.test_data_parallel import (
    ADAM,
    MBS,
    REASSOCIATION_TOL,
    SEQ,
    VOCAB,
    _assert_params,
    _config,
    _forward_step,
    _global_batches,
    _reference,
)

STEPS, CLIP, MICROBATCHES = 3, 0.05, 8


def test_instances_are_consecutive_blocks_and_replicas_the_same_position():
    layout = instance_layout([[0, 2, 4, 6, 8, 10], [1, 3, 5, 7, 9, 11]], 3, "shard", "replica")
    assert layout["shard"] == [[0, 2], [4, 6], [8, 10], [1, 3], [5, 7], [9, 11]]
    assert layout["replica"] == [[0, 4, 8], [2, 6, 10], [1, 5, 9], [3, 7, 11]]
    with pytest.raises(ValueError, match="does not divide"):
        instance_layout([[0, 1, 2, 3]], 3, "shard", "replica")


def _groups_of_this_rank():
    """(instance, shard ranks, replica ranks) dense and expert, with EP 2 over 8 ranks."""
    ps.initialize_model_parallel(1, 1, expert_model_parallel_size=2,
                                 num_distributed_optimizer_instances=2)
    return (optimizer_instances.instance_rank(),
            [optimizer_instances.shard_ranks(e) for e in (False, True)],
            [optimizer_instances.replica_ranks(e) for e in (False, True)])


def test_dense_and_expert_instances_are_the_same_ranks():
    """Instance 0 is ranks 0-3 for both (its ranks alone write checkpoints and count norms)."""
    for rank, (instance, shard, replica) in enumerate(
            run_distributed(_groups_of_this_rank, world_size=8)):
        assert instance == rank // 4
        assert shard[0] == list(range(instance * 4, instance * 4 + 4))
        assert replica[0] == [rank % 4, rank % 4 + 4]
        # expert-DP of EP rank e: e, e+2, e+4, e+6; instance 0 holds e and e+2
        assert shard[1] == [r for r in range(rank % 2, 8, 2) if r // 4 == instance]
        assert replica[1] == [rank % 4, rank % 4 + 4]


def _hsdp_train(kind):
    ps.initialize_model_parallel(1, 1, num_distributed_optimizer_instances=2)
    config = _config()
    if kind == "fsdp2":
        ddp = TorchFSDP2Config(num_distributed_optimizer_instances=2)
    else:
        ddp = DistributedDataParallelConfig(use_distributed_optimizer=True,
                                            shard_gradients=kind == "zero2",
                                            num_distributed_optimizer_instances=2)
    model = build_model(lambda **stage: LlamaModel(config, VOCAB, **stage), config, ddp,
                        seed=42)
    optimizer = get_megatron_optimizer(OptimizerConfig(
        clip_grad=CLIP, use_distributed_optimizer=kind != "fsdp2", **ADAM), model)
    dp, rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    local = MICROBATCHES // dp
    history = []
    for batch in _global_batches(MICROBATCHES, STEPS):
        _, skipped, norm, _ = train_step(_forward_step, iter(batch[rank * local:][:local]),
                                         model, optimizer, None, local, SEQ, MBS)
        assert not skipped
        params = model[0].module.named_parameters()
        history.append(({n: (p.full_tensor() if kind == "fsdp2" else p).detach().clone()
                         for n, p in params}, norm))
    if kind == "fsdp2":
        weight = next(model[0].module.parameters())
        from torch.distributed.tensor import Replicate, Shard

        groups = (tuple(weight.device_mesh.mesh.shape),
                  tuple(weight.placements) == (Replicate(), Shard(0)))
    else:
        buckets = model[0]._buckets()
        groups = ([torch.distributed.get_world_size(b.group) for b in buckets],
                  [torch.distributed.get_process_group_ranks(b.replica_group) for b in buckets])
    return history, groups


@pytest.mark.parametrize("kind", ["distributed", "zero2", "fsdp2"])
def test_hsdp_dp4_two_instances_equals_one_process(kind):
    reference = run_distributed(_reference_clipped, world_size=1, tp=1)[0]
    assert all(norm > CLIP for _, norm in reference[:STEPS])  # every step clips
    for rank, (history, groups) in enumerate(run_distributed(_hsdp_train, world_size=4,
                                                             kind=kind)):
        for (params, norm), (want, want_norm) in zip(history, reference[:STEPS], strict=True):
            _assert_params(params, want, REASSOCIATION_TOL)
            assert float(norm) == pytest.approx(want_norm, rel=1e-5)
        if kind == "fsdp2":  # (instances, ranks per instance); replicated, split on dim 0
            assert groups == ((2, 2), True)
        else:  # each bucket shards over 2 ranks and is all-reduced with the other instance
            sizes, replicas = groups
            assert set(sizes) == {2} and all(r == [rank % 2, rank % 2 + 2] for r in replicas)


def _reference_clipped():
    return _reference(MICROBATCHES, clip_grad=CLIP)


def test_instances_must_divide_the_expert_data_parallel_ranks():
    """EP 4 over 4 ranks leaves one expert-DP rank: two instances cannot cut it, though they
    cut the 4 DP ranks (a start-time refusal, before any group is made)."""
    from megatron.training.arguments import ConfigError, build_configs, parse_args
    from tests.e2e.runner import LLAMA, TINY

    args = parse_args(TINY + LLAMA + [
        "--num-experts", "4", "--expert-model-parallel-size", "4", "--use-distributed-optimizer",
        "--num-distributed-optimizer-instances", "2"])
    with pytest.raises(ConfigError, match="does not divide the 1 expert-data-parallel ranks"):
        build_configs(args, world_size=4)
    args = parse_args(TINY + LLAMA + [
        "--num-experts", "4", "--expert-model-parallel-size", "2", "--use-distributed-optimizer",
        "--num-distributed-optimizer-instances", "2"])
    assert build_configs(args, world_size=4).ddp.num_distributed_optimizer_instances == 2
