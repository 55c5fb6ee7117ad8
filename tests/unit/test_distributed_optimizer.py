"""The distributed optimizer (ZeRO-1) and its overlapped variant against one process with plain
Adam on the same global batch.

Not bitwise, for the reason given in test_data_parallel: the reduce-scatter adds the DP ranks'
partial gradient sums in another order than one process accumulating microbatch by microbatch
(Adam then passes the rounding on): <= 1e-6 on every parameter.
"""
import contextlib
import copy
import math

import pytest
import torch

from megatron.core import parallel_state as ps
from megatron.core.distributed import (
    DistributedDataParallel,
    DistributedDataParallelConfig,
    ddp_config_for_optimizer,
    finalize_model_grads,
)
from megatron.core.models import LlamaModel
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.pipeline_parallel import get_forward_backward_func
from tests.collective_counter import count_collectives
from tests.distributed import RankFailed, run_distributed
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
    check_tp_pp_dp_against_single_process,
)

KINDS = ["distributed", "overlapped"]


def _optimizer_config(kind, **extra):
    return OptimizerConfig(use_distributed_optimizer=kind == "distributed",
                           overlapped_distributed_optimizer=kind == "overlapped", **ADAM, **extra)


def _build(kind, bucket_size=None, dtype=torch.float32, seed=42):
    config = _config(params_dtype=dtype)
    opt_config = _optimizer_config(kind, clip_grad=0.0, bf16=dtype == torch.bfloat16)
    if kind == "none":
        ddp_config = DistributedDataParallelConfig(bucket_size=bucket_size)
    else:
        ddp_config = ddp_config_for_optimizer(opt_config, bucket_size=bucket_size,
                                              reduce_bucket_size=bucket_size or 500_000_000)
    torch.manual_seed(seed)
    model = DistributedDataParallel(config, ddp_config, LlamaModel(config, VOCAB))
    config.finalize_model_grads_func = finalize_model_grads
    return model, get_megatron_optimizer(opt_config, [model])


def _train(model, optimizer, batches, counts=None, finish=True):
    """Steps on ``batches``; the parameters after each step (``finish=False``: the last step's
    overlapped all-gathers are left in flight and its parameters are not recorded)."""
    dp, rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    history = []
    for batch in batches:
        local = len(batch) // dp
        model.zero_grad_buffer()
        optimizer.zero_grad()
        before_last = []

        def step(data_iterator, chunk):
            if len(before_last) < local:
                before_last.append(dict(totals))
            return _forward_step(data_iterator, chunk)

        with count_collectives() as totals:
            get_forward_backward_func()(
                forward_step_func=step, data_iterator=iter(batch[rank * local:(rank + 1) * local]),
                model=[model], num_microbatches=local, seq_length=SEQ, micro_batch_size=MBS)
            fb = dict(totals)
            if history:  # the previous step's parameters, as this forward waited for them
                history[-1] = _snapshot(model)
            assert optimizer.step()[0]
            pending = [b.param_gather_handle is not None for b in model._buckets()]
        if counts is not None:
            counts.append(dict(before_last=before_last[-1], forward_backward=fb,
                               total=dict(totals), pending_gathers=pending))
        history.append(None)
    if finish:
        model.finish_param_sync()
        history[-1] = _snapshot(model)
    return history


def _snapshot(model):
    return {n: p.detach().clone() for n, p in model.module.named_parameters()}


def _run(kind, num_microbatches, bucket_size=None, dtype=torch.float32):
    model, optimizer = _build(kind, bucket_size, dtype)
    counts = []
    history = _train(model, optimizer, _global_batches(num_microbatches, steps=5), counts)
    return dict(history=history, counts=counts, buckets=len(model._buckets()))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dp", [2, 4])
def test_sharded_steps_equal_single_process(kind, dp):
    reference = run_distributed(_reference, world_size=1, tp=1, num_microbatches=4)[0]
    for rank in run_distributed(_run, world_size=dp, tp=1, kind=kind, num_microbatches=4,
                                bucket_size=3000):
        for params, (want, _) in zip(rank["history"], reference):
            _assert_params(params, want, REASSOCIATION_TOL)


@pytest.mark.parametrize("kind", KINDS)
def test_collectives_per_bucket_and_none_before_the_last_microbatch(kind):
    for rank in run_distributed(_run, world_size=2, tp=1, kind=kind, num_microbatches=6,
                                bucket_size=3000):
        n = rank["buckets"]
        assert n > 2
        for i, counts in enumerate(rank["counts"]):
            assert counts["forward_backward"].get("reduce_scatter") == n
            assert counts["total"]["reduce_scatter"] == n
            if kind == "distributed":  # the step gathers every bucket
                assert counts["before_last"] == {}
                assert counts["forward_backward"].get("all_gather", 0) == 0
                assert counts["total"]["all_gather"] == n
                assert not any(counts["pending_gathers"])
            else:
                # The step issues the first bucket's all-gather (in forward order) and leaves
                # it running; the first microbatch's forward issues the others, one ahead.
                in_forward = 0 if i == 0 else n - 1
                assert counts["before_last"] == ({"all_gather": n - 1} if i else {})
                assert counts["forward_backward"].get("all_gather", 0) == in_forward
                assert counts["total"]["all_gather"] == in_forward + 1
                assert sum(counts["pending_gathers"]) == 1


def _optimizer_elements(kind):
    model, optimizer = _build(kind)
    _train(model, optimizer, _global_batches(4, steps=1))
    params = [p for g in optimizer.param_groups for p in g["params"]]
    state = [v for s in optimizer.optimizer.state.values() for v in s.values()
             if torch.is_tensor(v) and v.dim() > 0]
    total = sum(p.numel() for p in model.module.parameters())
    return sum(p.numel() for p in params) + sum(v.numel() for v in state), total


def test_sharded_optimizer_holds_a_dp_share_of_main_params_and_state():
    # One bucket (the default size is far larger than the model): DP ranks 0..DP-2 own
    # ceil(N / DP) elements each, the last the rest (its shard ends in padding).
    for dp in (2, 4):
        results = run_distributed(_optimizer_elements, world_size=dp, tp=1, kind="distributed")
        n = results[0][1]
        share = math.ceil(n / dp)
        assert [r[0] for r in results] == [3 * share] * (dp - 1) + [3 * (n - (dp - 1) * share)]
    unsharded, n = run_distributed(_optimizer_elements, world_size=2, tp=1, kind="none")[0]
    assert unsharded == 3 * n


def _save_then_continue(kind, total_steps, save_after):
    model, optimizer = _build(kind, bucket_size=3000)
    batches = _global_batches(4, steps=total_steps)
    _train(model, optimizer, batches[:save_after])
    # A snapshot, as a checkpoint file is (state_dict() tensors are live views).
    optimizer_state = optimizer.state_dict()
    saved = dict(model={k: v.clone() for k, v in model.state_dict().items()},
                 optimizer=None if optimizer_state is None else copy.deepcopy(optimizer_state))
    after = _train(model, optimizer, batches[save_after:])
    return saved, after


def _resume(kind, checkpoint, total_steps, save_after):
    model, optimizer = _build(kind, bucket_size=3000, seed=7)  # other initial weights
    model.load_state_dict(checkpoint["model"])
    optimizer.load_state_dict(checkpoint["optimizer"])
    return _train(model, optimizer, _global_batches(4, steps=total_steps)[save_after:])


@pytest.mark.parametrize("kind", KINDS)
def test_checkpoint_at_dp4_resumes_at_dp2_and_dp1(kind):
    runs = run_distributed(_save_then_continue, world_size=4, tp=1, kind=kind, total_steps=4,
                           save_after=2)
    checkpoint, want = runs[0]
    assert all(r[0]["optimizer"] is None for r in runs[1:]), "gathered on DP rank 0 only"
    for dp in (2, 1):
        for got in run_distributed(_resume, world_size=dp, tp=1, kind=kind,
                                   checkpoint=checkpoint, total_steps=4, save_after=2):
            for params, want_params in zip(got, want):
                _assert_params(params, want_params, REASSOCIATION_TOL)


def _bf16_history(kind):
    model, optimizer = _build(kind, bucket_size=3000, dtype=torch.bfloat16)
    return _train(model, optimizer, _global_batches(2, steps=3))


def test_bf16_sharded_equals_bf16_unsharded_bitwise():
    # DP=2: reduce-scatter and all-reduce add the same two bf16 values; Adam is elementwise.
    sharded = run_distributed(_bf16_history, world_size=2, tp=1, kind="distributed")[0]
    plain = run_distributed(_bf16_history, world_size=2, tp=1, kind="none")[0]
    for a, b in zip(sharded, plain):
        _assert_params(a, b, 0)


@pytest.mark.parametrize("model,bucket_size", [("llama", 500), ("gpt", 500), ("gpt", 10**6)])
@pytest.mark.parametrize("kind", KINDS)
def test_tp_pp_dp_sharded_steps_equal_single_process(kind, model, bucket_size):
    """Also checks the sharded global norm and clipping (clipping is active there), and GPT's
    embedding tied across the first and last stage: its two copies must be sharded alike,
    whatever else shares their bucket (one bucket for everything: 10**6)."""
    check_tp_pp_dp_against_single_process(model, sharded=kind, bucket_size=bucket_size)


def test_the_two_flags_are_exclusive():
    with pytest.raises(ValueError, match="mutually exclusive"):
        OptimizerConfig(use_distributed_optimizer=True, overlapped_distributed_optimizer=True)


def _sharded_optimizer_on_plain_ddp():
    config = _config()
    model = DistributedDataParallel(config, DistributedDataParallelConfig(),
                                    LlamaModel(config, VOCAB))
    get_megatron_optimizer(_optimizer_config("distributed"), [model])


def test_distributed_optimizer_needs_sharded_ddp():
    with pytest.raises(RankFailed, match="use_distributed_optimizer=True"):
        run_distributed(_sharded_optimizer_on_plain_ddp, world_size=1, tp=1)


def _overflow_on_one_rank():
    """fp16 with dynamic loss scaling: an inf in DP rank 1's shard only must skip the step on
    every rank (each rank sees only its own shard)."""
    config = _config(params_dtype=torch.float16)
    opt_config = OptimizerConfig(use_distributed_optimizer=True, fp16=True, clip_grad=1.0,
                                 initial_loss_scale=2.0 ** 8, hysteresis=1, **ADAM)
    torch.manual_seed(42)
    model = DistributedDataParallel(config, ddp_config_for_optimizer(opt_config),
                                    LlamaModel(config, VOCAB))
    config.finalize_model_grads_func = finalize_model_grads
    optimizer = get_megatron_optimizer(opt_config, [model])
    config.grad_scale_func = optimizer.scale_loss
    before = _snapshot(model)
    model.zero_grad_buffer()
    rank = ps.get_data_parallel_rank()
    batch = _global_batches(2, steps=1)[0]
    get_forward_backward_func()(forward_step_func=_forward_step,
                                data_iterator=iter(batch[rank:rank + 1]), model=[model],
                                num_microbatches=1, seq_length=SEQ, micro_batch_size=MBS)
    if rank == 1:
        shard = optimizer.shards[0]
        shard.bucket.grad_data[shard.begin] = float("inf")
    result = optimizer.step()
    unchanged = all(torch.equal(p, before[n]) for n, p in _snapshot(model).items())
    return result, unchanged, optimizer.get_loss_scale(), optimizer.num_skipped_steps


def test_an_overflow_in_one_shard_skips_the_step_everywhere():
    for result, unchanged, scale, skipped in run_distributed(_overflow_on_one_rank,
                                                             world_size=2, tp=1):
        assert result == (False, None, None) and unchanged
        assert scale == 2.0 ** 7 and skipped == 1


# --- checkpoint memory: one bucket of one state key at a time --------------------------------

def _checkpoint_allocations(dtype):
    import torch.distributed as dist

    from tests.allocation_tracker import track_allocations

    model, optimizer = _build("distributed", bucket_size=3000, dtype=dtype)
    _train(model, optimizer, _global_batches(2, steps=1))
    largest = max(b.grad_data.numel() for b in model._buckets())
    with track_allocations() as saving:
        state = optimizer.state_dict()
    saving.finish()
    result = [] if state is None else [v for entry in state["params"].values()
                                       for v in entry.values()]
    # Every rank loads DP rank 0's dict into a fresh optimizer (other initial weights).
    shared = [state]
    dist.broadcast_object_list(shared, src=0)
    fresh_model, fresh = _build("distributed", bucket_size=3000, dtype=dtype, seed=7)
    fresh_model.load_state_dict(model.state_dict())
    fresh.reload_model_params()
    with track_allocations() as loading:
        fresh.load_state_dict(shared[0])
    loading.finish()
    installed = [v for s in fresh.optimizer.state.values() for v in s.values()
                 if torch.is_tensor(v)]
    return dict(buckets=len(model._buckets()), largest=largest,
                save_peak=saving.peak_temporary, save_kept=saving.kept,
                result_bytes=sum(v.numel() * v.element_size() for v in result),
                compact=all(v.untyped_storage().nbytes() == v.numel() * v.element_size()
                            for v in result),
                load_peak=loading.peak_temporary, load_kept=loading.kept,
                installed_bytes=sum(v.untyped_storage().nbytes() for v in installed))


@pytest.mark.parametrize("dtype", [torch.float32,
                                   pytest.param(torch.bfloat16, marks=pytest.mark.slow)],
                         ids=["fp32", "bf16"])
def test_checkpoint_state_uses_one_bucket_of_one_key_at_a_time(dtype):
    """state_dict(): the extra memory (what it allocates and frees again) is at most one
    bucket's fp32 elements (numel * 4 bytes) on DP rank 0 (the bucket gathered for one state
    key) and one shard of it on the other ranks; what it keeps is exactly the host copies it
    returns. load_state_dict(): no more than that either; it keeps only the installed state.
    Before, every rank held every key of a bucket gathered at once (4.5 buckets at bf16)."""
    ranks = run_distributed(_checkpoint_allocations, world_size=2, tp=1, dtype=dtype)
    for dp_rank, r in enumerate(ranks):
        assert r["buckets"] > 2
        bound = r["largest"] * 4 if dp_rank == 0 else r["largest"] * 4 // 2
        assert 0 < r["save_peak"] <= bound, (dp_rank, r)
        assert r["save_kept"] == r["result_bytes"] and r["compact"], (dp_rank, r)
        assert r["load_peak"] <= r["largest"] * 4, (dp_rank, r)
        assert r["load_kept"] == r["installed_bytes"], (dp_rank, r)
    assert ranks[1]["result_bytes"] == 0 < ranks[0]["result_bytes"]


# --- --overlap-param-gather: forward order, one bucket ahead ----------------------------------

def _forward_order(model):
    """The sharded buckets ordered by their first parameter in registration (forward) order."""
    position = {p: i for i, p in enumerate(model.module.parameters())}
    return sorted(model._buckets(), key=lambda b: min(position[p] for p in b.params))


@contextlib.contextmanager
def recorded_param_gathers(model, defer=False):
    """Records ("launch" | "wait", forward position of the bucket) for every parameter
    all-gather. ``defer``: an asynchronous all-gather does nothing until its handle is waited
    (a legal schedule for an async collective, and the slowest), so reading a parameter
    before its wait sees the stale value on gloo too."""
    import megatron.core.distributed.param_and_grad_buffer as buffers

    real = buffers.all_gather_into_tensor
    index = {b.param_data.data_ptr(): i for i, b in enumerate(_forward_order(model))}
    events = []

    class Handle:
        def __init__(self, i, finish):
            self.i, self.finish = i, finish

        def wait(self):
            events.append(("wait", self.i))
            self.finish()

    def all_gather(output, input_, group=None, async_op=False):
        i = index[output.data_ptr()]
        events.append(("launch", i))
        if not async_op:
            return real(output, input_, group=group)
        if defer:
            return Handle(i, lambda: real(output, input_, group=group))
        return Handle(i, real(output, input_, group=group, async_op=True).wait)

    buffers.all_gather_into_tensor = all_gather
    try:
        yield events
    finally:
        buffers.all_gather_into_tensor = real


def _param_gather_order(kind):
    model, optimizer = _build(kind, bucket_size=3000)
    first = _forward_order(model)[0]
    with recorded_param_gathers(model) as events:
        history = _train(model, optimizer, _global_batches(2, steps=3))
    embedding = model.module.embedding.word_embeddings.weight
    return dict(events=events, history=history, buckets=len(model._buckets()),
                embedding_first=any(p is embedding for p in first.params))


def test_overlapped_param_gathers_run_in_forward_order_one_bucket_ahead():
    ranks = run_distributed(_param_gather_order, world_size=2, tp=1, kind="overlapped")
    plain = run_distributed(_param_gather_order, world_size=2, tp=1, kind="distributed")
    for rank, sync in zip(ranks, plain):
        n, events = rank["buckets"], rank["events"]
        assert n > 2 and rank["embedding_first"]
        launches = [i for what, i in events if what == "launch"]
        assert launches == list(range(n)) * 3  # each step's round, the first layer's first
        for at, (what, i) in enumerate(events):
            if what == "wait" and i + 1 < n:  # the next bucket is already on its way
                assert ("launch", i + 1) in events[:at][-(n + 1):], (at, events)
        assert [e for e in events if e[0] == "wait"] == [("wait", i) for i in range(n)] * 3
        # Only the timing of the all-gathers differs: bitwise equal to gathering at once.
        for a, b in zip(rank["history"], sync["history"]):
            _assert_params(a, b, 0)
