"""train_step and evaluate against a single process on the same global batch."""
import torch

from megatron.core import parallel_state as ps
from megatron.core.distributed import DistributedDataParallelConfig
from megatron.core.models import LlamaModel
from megatron.core.optimizer import (
    OptimizerConfig,
    OptimizerParamScheduler,
    get_megatron_optimizer,
)
from megatron.training.training import build_model, evaluate, train_step
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


def _train(num_microbatches, steps=5):
    config = _config()
    model = build_model(lambda **stage: LlamaModel(config, VOCAB, **stage), config,
                        DistributedDataParallelConfig(), seed=42)
    optimizer = get_megatron_optimizer(OptimizerConfig(clip_grad=0.0, **ADAM), model)
    scheduler = OptimizerParamScheduler(optimizer, init_lr=ADAM["lr"], max_lr=ADAM["lr"],
                                        min_lr=0.0, lr_warmup_steps=0, lr_decay_steps=10**6,
                                        lr_decay_style="constant", start_wd=0.1, end_wd=0.1,
                                        wd_incr_steps=10**6, wd_incr_style="constant")
    dp, rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    local = num_microbatches // dp
    history, losses = [], []
    for batch in _global_batches(num_microbatches, steps):
        mine = batch[rank * local:(rank + 1) * local]
        reported, skipped, _, _ = train_step(_forward_step, iter(mine), model, optimizer,
                                             scheduler, local, SEQ, MBS)
        assert not skipped
        losses.append(reported["lm loss"])
        history.append({n: p.detach().clone() for n, p in model[0].module.named_parameters()})
    held_out = _global_batches(num_microbatches, 1)[0]
    valid = evaluate(_forward_step, iter(held_out), model, 1, num_microbatches, SEQ, MBS)
    with torch.no_grad():  # the same mean of per-microbatch losses, computed directly
        direct = [float(model[0].module(t, labels=lab).mean()) for t, lab in held_out]
    return dict(history=history, losses=losses, samples=scheduler.num_steps,
                valid=valid["lm loss"], direct=sum(direct) / len(direct),
                training=model[0].training)


def test_train_step_equals_single_process_and_counts_samples():
    reference = run_distributed(_reference, world_size=1, tp=1, num_microbatches=4)[0]
    for rank in run_distributed(_train, world_size=2, tp=1, num_microbatches=4):
        for params, (want, _) in zip(rank["history"], reference):
            _assert_params(params, want, REASSOCIATION_TOL)
        assert rank["samples"] == 5 * 4 * MBS  # the schedule advanced by samples
        assert rank["training"], "evaluate() puts the model back in training mode"
        assert rank["valid"] == rank["direct"]
