"""--use-torch-fsdp2: torch's fully_shard over DP, against one process on the same global batch.

The reference is test_data_parallel's: plain torch, the whole global batch with gradient
accumulation, fused torch AdamW. FSDP2 reduce-scatters each rank's accumulated gradient
(averaged over DP: a power of two, exact), so as with DDP the only difference is the order of
the sums (microbatch gradients summed per rank, then over ranks) and, with clipping, the
global norm summed shard by shard: parameters agree to 1e-6 after Adam (REASSOCIATION_TOL,
the DDP tests' bound).
"""

import pytest
import torch

from megatron.core import parallel_state as ps
from megatron.core.distributed.fsdp import TorchFSDP2Config
from megatron.core.models import LlamaModel
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.training.arguments import ConfigError, build_configs, parse_args
from megatron.training.training import build_model, train_step
from tests.distributed import run_distributed
from tests.unit.test_data_parallel import (
    ADAM,
    MBS,
    REASSOCIATION_TOL,
    SEQ,
    SGD,
    VOCAB,
    _assert_params,
    _config,
    _forward_step,
    _global_batches,
    _reference,
)

STEPS = 3


def _fsdp_train(num_microbatches, reshard, clip_grad=0.0, sgd=False, reduce_once=False):
    config = _config()
    model = build_model(lambda **stage: LlamaModel(config, VOCAB, **stage), config,
                        TorchFSDP2Config(reshard_after_forward=reshard,
                                         reduce_gradients_once=reduce_once), seed=42)
    optimizer = get_megatron_optimizer(
        OptimizerConfig(clip_grad=clip_grad, **(SGD if sgd else ADAM)), model)
    dp, rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    local = num_microbatches // dp
    shards, history = {}, []
    for batch in _global_batches(num_microbatches, STEPS):
        mine = batch[rank * local:(rank + 1) * local]
        _, skipped, norm, _ = train_step(_forward_step, iter(mine), model, optimizer, None,
                                         local, SEQ, MBS)
        assert not skipped
        # full_tensor() all-gathers: every rank calls it in the same order
        history.append(({n: p.full_tensor().detach().clone()
                         for n, p in model[0].module.named_parameters()}, norm))
    for name, param in model[0].module.named_parameters():
        shards[name] = (tuple(param.to_local().shape), tuple(param.shape))
    return dict(history=history, shards=shards)


def _check_against_reference(ranks, reference, dp):
    for rank in ranks:
        for (params, norm), (want, want_norm) in zip(rank["history"], reference):
            _assert_params(params, want, REASSOCIATION_TOL)
            assert norm == pytest.approx(want_norm, rel=1e-5)
        for name, (local, full) in rank["shards"].items():
            # sharded on dim 0: this rank holds ceil(rows / DP) rows or fewer
            assert local[1:] == full[1:] and local[0] <= -(-full[0] // dp), name


@pytest.mark.parametrize("reshard,reduce_once", [(True, False), (False, False), (True, True)],
                         ids=["zero3", "zero2", "zero3-reduce-once"])
def test_fsdp2_dp2_steps_equal_single_process(reshard, reduce_once):
    """reduce_once: two microbatches per rank accumulated unsharded, reduce-scattered once
    after the last backward (finish_grad_sync)."""
    reference = run_distributed(_reference, world_size=1, tp=1, num_microbatches=4)[0]
    ranks = run_distributed(_fsdp_train, world_size=2, tp=1, num_microbatches=4,
                            reshard=reshard, reduce_once=reduce_once)
    _check_against_reference(ranks, reference, dp=2)


def test_fsdp2_with_sgd_equals_single_process():
    """SGD with momentum over FSDP2's DTensor shards (torch's fused SGD has no DTensor rule:
    the step takes foreach there) against torch's fused SGD on one process."""
    reference = run_distributed(_reference, world_size=1, tp=1, num_microbatches=4,
                                sgd=True)[0]
    ranks = run_distributed(_fsdp_train, world_size=2, tp=1, num_microbatches=4,
                            reshard=True, sgd=True)
    _check_against_reference(ranks, reference, dp=2)


def test_fsdp2_clips_by_the_global_norm():
    """clip_grad small enough to clip every step: the norm summed over shards must be the
    whole model's (no double counting over DP)."""
    reference = run_distributed(_reference, world_size=1, tp=1, num_microbatches=4,
                                clip_grad=0.05)[0]
    ranks = run_distributed(_fsdp_train, world_size=2, tp=1, num_microbatches=4,
                            reshard=True, clip_grad=0.05)
    assert all(norm > 0.05 for _, norm in reference)
    _check_against_reference(ranks, reference, dp=2)


def test_fsdp2_config_refuses_ddp_only_settings():
    with pytest.raises(ValueError, match="drop --use-distributed-optimizer"):
        TorchFSDP2Config(use_distributed_optimizer=True)
    with pytest.raises(ValueError, match="--overlap-grad-reduce"):
        TorchFSDP2Config(overlap_grad_reduce=True)


SMALL = ("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 "
         "--max-position-embeddings 16 --micro-batch-size 1 --train-iters 2 --lr 1e-3 "
         "--mock-data --tokenizer-type NullTokenizer --vocab-size 64 --use-torch-fsdp2").split()


@pytest.mark.parametrize("extra,reshard,reduce_fp32", [  # fp32 runs reduce in their dtype
    ([], True, False), (["--no-reshard-after-forward"], False, False),
    (["--bf16"], True, True), (["--bf16", "--grad-reduce-in-bf16"], True, False),
    (["--context-parallel-size", "2"], True, False),  # sharded over DP x CP
    (["--pipeline-model-parallel-size", "2"], True, False),  # each stage over its DP
    (["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1",
      "--no-reshard-after-forward"], False, False)])
def test_fsdp2_flags_map_to_the_config(extra, reshard, reduce_fp32):
    ddp = build_configs(parse_args(SMALL + extra), world_size=2).ddp
    assert isinstance(ddp, TorchFSDP2Config)
    assert (ddp.reshard_after_forward, ddp.grad_reduce_in_fp32) == (reshard, reduce_fp32)
    assert not ddp.reduce_gradients_once and not ddp.cpu_offload


def test_fsdp2_reduce_once_and_offload_flags_map_to_the_config():
    ddp = build_configs(parse_args(SMALL + ["--fsdp2-reduce-gradients-once",
                                            "--optimizer-cpu-offload"]), world_size=2).ddp
    assert ddp.reduce_gradients_once and ddp.cpu_offload


@pytest.mark.parametrize("extra,words", [
    (["--use-distributed-optimizer"], "drop --use-distributed-optimizer"),
    (["--overlap-grad-reduce"], "drop --overlap-grad-reduce"),
    (["--load", "ckpt", "--ckpt-format", "torch"], "sharded checkpoint format only"),
])
def test_fsdp2_refuses_what_does_not_compose_yet(extra, words):
    with pytest.raises(ConfigError, match="--use-torch-fsdp2") as info:
        build_configs(parse_args(SMALL + extra), world_size=4)
    assert words in str(info.value)
