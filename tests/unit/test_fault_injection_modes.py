"""``MEGATRON_FAULT_INJECTION=nan:R:I`` must make every memory mode skip the update: the NaN has
to land in what rank R's optimizer reads. A distributed optimizer reads only its shard of the
reduced buffer, ZeRO-2 has freed the full buffer by then (only ``main_grad_shard`` is left) and
FSDP2's gradients are DTensors; poisoning one element of the first ``main_grad`` missed all
three."""
import os

import pytest
import torch
import torch.distributed as dist

from megatron.core.distributed import ddp_config_for_optimizer
from megatron.core.distributed.fsdp import TorchFSDP2Config
from megatron.core.models import LlamaModel
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.training.guards import fault_injection
from megatron.training.training import build_model, train_step
from tests.distributed import run_distributed
from tests.unit.test_data_parallel import (
    ADAM,
    MBS,
    SEQ,
    VOCAB,
    _config,
    _forward_step,
    _global_batches,
)

MODES = {
    "ddp": dict(),
    "distributed": dict(use_distributed_optimizer=True),
    "zero2": dict(use_distributed_optimizer=True, shard_gradients=True),
    "overlapped_zero2": dict(overlapped_distributed_optimizer=True, shard_gradients=True),
    "fsdp2": dict(fsdp2=True),
}


def _local(param):
    return (param.to_local() if hasattr(param, "to_local") else param).detach().clone()


def _poisoned_step(mode, poisoned_rank):
    flags = dict(MODES[mode])
    shard_gradients, fsdp2 = flags.pop("shard_gradients", False), flags.pop("fsdp2", False)
    config = _config()
    opt_config = OptimizerConfig(**flags, **ADAM)
    ddp_config = TorchFSDP2Config() if fsdp2 else ddp_config_for_optimizer(
        opt_config, grad_reduce_in_fp32=True, bucket_size=3000, reduce_bucket_size=3000,
        shard_gradients=shard_gradients)
    model = build_model(lambda **stage: LlamaModel(config, VOCAB, **stage), config,
                        ddp_config, seed=42)
    optimizer = get_megatron_optimizer(opt_config, model)
    rank = dist.get_rank()
    batch = _global_batches(2, 1)[0][rank:rank + 1]
    before = [_local(p) for p in model[0].parameters()]
    # Pool workers outlive tests: set what the injection reads (a first attempt, this rank)
    # and put back what was there.
    wanted = {fault_injection.ENV: f"nan:{poisoned_rank}:1", "RANK": str(rank),
              "TORCHELASTIC_RESTART_COUNT": "0"}
    before_env = {key: os.environ.get(key) for key in wanted}
    os.environ.update(wanted)
    try:
        _, skipped, _, _ = train_step(
            _forward_step, iter(batch), model, optimizer, None, 1, SEQ, MBS,
            before_optimizer_step=lambda chunks: fault_injection.maybe_poison_gradients(
                chunks, iteration=1))
    finally:
        for key, value in before_env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    unchanged = all(torch.equal(b, _local(p)) for b, p in zip(before, model[0].parameters()))
    return skipped, unchanged


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("poisoned_rank", [0, 1])
def test_nan_injection_skips_the_update_in_every_mode(mode, poisoned_rank):
    ranks = run_distributed(_poisoned_step, world_size=2, tp=1, mode=mode,
                            poisoned_rank=poisoned_rank)
    if mode == "ddp":
        # Replicated gradients are checked by each rank alone (a real NaN reaches every rank
        # through the all-reduce; the injection lands after it, on one rank).
        assert ranks[poisoned_rank] == (True, True)
        assert ranks[1 - poisoned_rank] == (False, False)
    else:  # each rank reads its shard: the inf check / norm is reduced over DP
        assert ranks == [(True, True), (True, True)]
