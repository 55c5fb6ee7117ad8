"""train_step and evaluate against a single process on the same global batch; the reported
loss reduced over DP once per iteration."""
from functools import partial

import torch

from megatron.core import parallel_state as ps
from megatron.core.distributed import DistributedDataParallelConfig
from megatron.core.models import LlamaModel
from megatron.core.optimizer import (
    OptimizerConfig,
    OptimizerParamScheduler,
    get_megatron_optimizer,
)
from megatron.training import gpt_step
from megatron.training.training import build_model, evaluate, train_step
from tests.collective_counter import count_collectives
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


def _gpt_forward_step(data_iterator, model, local_losses, report=True):
    """The scripts' loss_func (gpt_step) on test_data_parallel's batches; keeps local losses."""
    tokens, labels = next(data_iterator)

    def loss(per_token_loss):
        value, reported = gpt_step.loss_func(torch.ones(MBS, SEQ), per_token_loss)
        local_losses.append(float(value))
        return value, (reported if report else {})
    return model(tokens, labels=labels), loss


def _loss_reduction(num_microbatches):
    config = _config()
    model = build_model(lambda **stage: LlamaModel(config, VOCAB, **stage), config,
                        DistributedDataParallelConfig(), seed=42)
    optimizer = get_megatron_optimizer(OptimizerConfig(clip_grad=0.0, **ADAM), model)
    dp, rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    local = num_microbatches // dp
    mine = _global_batches(num_microbatches, 1)[0][rank * local:(rank + 1) * local]
    train_local, eval_local = [], []
    with count_collectives() as reporting:
        reported, _, _, _ = train_step(partial(_gpt_forward_step, local_losses=train_local),
                                       iter(mine), model, optimizer, None, local, SEQ, MBS)
    with count_collectives() as silent:  # the same step with nothing reported
        train_step(partial(_gpt_forward_step, local_losses=[], report=False), iter(mine),
                   model, optimizer, None, local, SEQ, MBS)
    with count_collectives() as evaluating:
        valid = evaluate(partial(_gpt_forward_step, local_losses=eval_local), iter(mine * 2),
                         model, 2, local, SEQ, MBS)
    return dict(reported=reported["lm loss"], train_local=train_local, reporting=reporting,
                silent=silent, evaluating=dict(evaluating), valid=valid["lm loss"],
                eval_local=eval_local)


def _old_logged_value(per_rank_losses):
    """What the per-microbatch reduction logged: each microbatch's loss summed over DP in
    fp32 and divided by DP (the removed average_across_data_parallel), then the float mean
    of those."""
    summed = sum(torch.tensor(losses, dtype=torch.float32) for losses in per_rank_losses)
    per_microbatch = (summed / len(per_rank_losses)).tolist()
    return float(sum(per_microbatch) / len(per_microbatch))


def test_loss_is_reduced_over_dp_once_per_iteration_with_the_old_value():
    ranks = run_distributed(_loss_reduction, world_size=2, tp=1, num_microbatches=4)
    for rank in ranks:
        # Reporting the loss adds exactly one all-reduce to the step (it was one per
        # microbatch); evaluation's two iterations share one.
        assert rank["reporting"]["all_reduce"] - rank["silent"]["all_reduce"] == 1
        others = [{k: v for k, v in counts.items() if k != "all_reduce"}
                  for counts in (rank["reporting"], rank["silent"])]
        assert others[0] == others[1]
        assert rank["evaluating"] == {"all_reduce": 1}
        # Bitwise what the per-microbatch reduction logged (DP=2: one fp32 addition).
        assert rank["reported"] == _old_logged_value([r["train_local"] for r in ranks])
        per_iteration = [_old_logged_value([r["eval_local"][i:i + 2] for r in ranks])
                         for i in (0, 2)]
        assert rank["valid"] == sum(per_iteration) / 2
    assert ranks[0]["train_local"] != ranks[1]["train_local"]  # the ranks do differ
