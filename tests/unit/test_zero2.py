"""ZeRO-2 (``--shard-gradients``): a bucket's full gradients exist only from its first gradient
to its reduce-scatter into a persistent shard buffer.

Against the distributed optimizer with full gradient buffers, bitwise: the same
reduce-scatter (into another output buffer), then the same elementwise Adam on the same
values; the sequence-parallel and tied-embedding sums over two ranks on this rank's shard
slice only are the same a + b per element. Memory is measured from the storages the buffers
and the optimizer hold.
"""
import copy
import gc
import weakref

import pytest
import torch

from megatron.core import parallel_state as ps
from megatron.core.distributed import (
    DistributedDataParallel,
    DistributedDataParallelConfig,
    ddp_config_for_optimizer,
    finalize_model_grads,
)
from megatron.core.models import GPTModel, LlamaModel
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.pipeline_parallel import build_model_chunks, get_forward_backward_func
from megatron.core.transformer import TransformerConfig
from tests.distributed import RankFailed, run_distributed
from tests.unit.test_arguments import error_of, small
from tests.unit.test_data_parallel import (
    ADAM,
    MBS,
    SEQ,
    VOCAB,
    _assert_params,
    _config,
    _forward_step,
    _global_batches,
)

KINDS = ["distributed", "overlapped"]
BUCKET = 3000  # elements: several buckets for the small model
MICROBATCHES = 8  # per global batch: 4 per rank at DP=2, 2 at DP=4


def _build(kind, shard_gradients, dtype=torch.float32, seed=42, config=None, model=None):
    config = config or _config(params_dtype=dtype)
    opt_config = OptimizerConfig(
        use_distributed_optimizer=kind == "distributed",
        overlapped_distributed_optimizer=kind == "overlapped", clip_grad=1.0,
        bf16=dtype == torch.bfloat16, **ADAM)
    ddp_config = ddp_config_for_optimizer(
        opt_config, grad_reduce_in_fp32=True, bucket_size=BUCKET, reduce_bucket_size=BUCKET,
        shard_gradients=shard_gradients)
    torch.manual_seed(seed)
    chunks = [DistributedDataParallel(config, ddp_config, chunk) for chunk in
              build_model_chunks(model or (lambda **stage: LlamaModel(config, VOCAB, **stage)),
                                 config)]
    config.finalize_model_grads_func = finalize_model_grads
    return chunks, get_megatron_optimizer(opt_config, chunks)


def _buckets(chunks):
    return [bucket for chunk in chunks for bucket in chunk._buckets()]


class FullGradTracker:
    """Watches ZeRO-2's full gradient storages: the most bytes alive at once, and weak
    references to every storage freed (nothing else may keep them)."""

    def __init__(self, chunks):
        self.alive = self.peak = 0
        self.freed = []
        for bucket in _buckets(chunks):
            if bucket.shard_grads:
                self._wrap(bucket)

    def _wrap(self, bucket):
        ensure, release = bucket.ensure_full_grad, bucket.release_full_grad

        def tracked_ensure():
            made = bucket.grad_data is None
            ensure()
            if made:
                self.alive += bucket.grad_data.untyped_storage().nbytes()
                self.peak = max(self.peak, self.alive)

        def tracked_release():
            if bucket.grad_data is not None:
                self.alive -= bucket.grad_data.untyped_storage().nbytes()
                self.freed.append(weakref.ref(bucket.grad_data.untyped_storage()))
            release()
        bucket.ensure_full_grad, bucket.release_full_grad = tracked_ensure, tracked_release


def _train(chunks, optimizer, batches, tracker=None):
    """Steps on ``batches``: the parameters after each, and whether every bucket's full
    gradient storage was freed after each step (nothing left holding it)."""
    dp, rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    history, freed = [], []
    tracker = tracker or FullGradTracker(chunks)
    for batch in batches:
        local = len(batch) // dp
        for chunk in chunks:
            chunk.zero_grad_buffer()
        optimizer.zero_grad()
        tracker.freed = []
        get_forward_backward_func()(
            forward_step_func=_forward_step,
            data_iterator=iter(batch[rank * local:(rank + 1) * local]), model=chunks,
            num_microbatches=local, seq_length=SEQ, micro_batch_size=MBS)
        assert optimizer.step()[0]
        gc.collect()  # nothing else may hold the full buckets: their storages are gone
        buckets = _buckets(chunks)
        freed.append(all(b.grad_data is None for b in buckets) and
                     len(tracker.freed) == len(buckets) and
                     all(ref() is None for ref in tracker.freed) and
                     all(p.main_grad is None for b in buckets for p in b.params))
        for chunk in chunks:
            chunk.finish_param_sync()
        history.append({n: p.detach().clone() for chunk in chunks
                        for n, p in chunk.module.named_parameters()})
    return history, freed


def _history(kind, shard_gradients, dtype=torch.float32):
    chunks, optimizer = _build(kind, shard_gradients, dtype)
    return _train(chunks, optimizer, _global_batches(MICROBATCHES, steps=3))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dp", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_zero2_steps_equal_the_distributed_optimizer_bitwise(kind, dp):
    """Clipping active (clip_grad=1.0: the sharded norm sees the same shards)."""
    zero2 = run_distributed(_history, world_size=dp, tp=1, kind=kind, shard_gradients=True)
    zero1 = run_distributed(_history, world_size=dp, tp=1, kind=kind, shard_gradients=False)
    for (got, freed), (want, kept) in zip(zero2, zero1):
        assert all(freed) and not any(kept)
        for a, b in zip(got, want):
            _assert_params(a, b, 0)


def test_bf16_zero2_equals_the_distributed_optimizer_bitwise():
    """bf16 params, fp32 gradients: the fp32 main params are shard copies here too."""
    zero2 = run_distributed(_history, world_size=2, tp=1, kind="distributed",
                            shard_gradients=True, dtype=torch.bfloat16)
    zero1 = run_distributed(_history, world_size=2, tp=1, kind="distributed",
                            shard_gradients=False, dtype=torch.bfloat16)
    for (got, freed), (want, _) in zip(zero2, zero1):
        assert all(freed)
        for a, b in zip(got, want):
            _assert_params(a, b, 0)


def _three_d_history(kind, shard_gradients):
    """TP x DP with sequence parallelism (LLaMA: norm gradients summed over TP after the
    reduce-scatter) or PP x DP (GPT: the embedding tied across stages, summed likewise)."""
    if kind == "llama":
        config = _config(tensor_model_parallel_size=2, sequence_parallel=True)
        model = None
    else:
        config = TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4,
                                   max_position_embeddings=SEQ, attention_dropout=0.0,
                                   hidden_dropout=0.0, pipeline_model_parallel_size=2)
        model = lambda **stage: GPTModel(config, VOCAB, **stage)  # noqa: E731
    chunks, optimizer = _build("overlapped", shard_gradients, config=config, model=model)
    return _train(chunks, optimizer, _global_batches(4, steps=3))


@pytest.mark.slow  # 4 ranks; ZeRO-2 at DP=2 stays in the quick tier
@pytest.mark.parametrize("kind,layout", [("llama", dict(tp=2)), ("gpt", dict(tp=1, pp=2))])
def test_zero2_with_sequence_parallel_and_tied_embeddings_bitwise(kind, layout):
    zero2 = run_distributed(_three_d_history, world_size=4, kind=kind, shard_gradients=True,
                            **layout)
    zero1 = run_distributed(_three_d_history, world_size=4, kind=kind, shard_gradients=False,
                            **layout)
    for (got, freed), (want, _) in zip(zero2, zero1):
        assert all(freed)
        for a, b in zip(got, want):
            _assert_params(a, b, 0)


# --- the full buckets during backward, the persistent shards ---------------------------------

def _full_bucket_peak(kind, microbatches):
    chunks, optimizer = _build(kind, True)
    tracker = FullGradTracker(chunks)
    shards = [b.grad_shard for b in _buckets(chunks)]
    _train(chunks, optimizer, _global_batches(microbatches, steps=2), tracker)
    for chunk in chunks:
        chunk.zero_grad_buffer()
    buckets = _buckets(chunks)
    return dict(peak=tracker.peak, total=sum(b.numel for b in buckets) * 4,
                largest=max(b.numel for b in buckets) * 4, buckets=len(buckets),
                absent_after_zeroing=all(b.grad_data is None for b in buckets),
                same_shards=all(a is b.grad_shard for a, b in zip(shards, buckets)))


@pytest.mark.parametrize("kind", ["distributed",
                                  pytest.param("overlapped", marks=pytest.mark.slow)])
def test_full_buckets_do_not_all_coexist_with_one_microbatch(kind):
    """One microbatch per rank: each bucket is freed once reduced (synchronously in the hook,
    or overlapped: at most two in flight), so the peak of full gradient bytes is below all
    buckets'; with accumulation all of them live (exact: the estimate's transient). The
    shard buffers are the same tensors every step; zero_grad_buffer allocates nothing."""
    for one, many in zip(run_distributed(_full_bucket_peak, world_size=2, tp=1, kind=kind,
                                         microbatches=2),
                         run_distributed(_full_bucket_peak, world_size=2, tp=1, kind=kind,
                                         microbatches=MICROBATCHES)):
        assert one["buckets"] >= 4
        assert one["largest"] <= one["peak"] <= 3 * one["largest"] < one["total"], one
        assert many["peak"] == many["total"]
        for r in (one, many):
            assert r["absent_after_zeroing"] and r["same_shards"]


# --- memory held per rank after the step --------------------------------------------------

def _held_bytes(chunks, optimizer):
    """Bytes of the distinct storages the buffers and the optimizer hold."""
    tensors = [p for chunk in chunks for p in chunk.module.parameters()]
    for bucket in _buckets(chunks):
        tensors.append(bucket.grad_shard if bucket.full_grad_released else bucket.grad_data)
    tensors += [p for g in optimizer.param_groups for p in g["params"]]
    tensors += [v for s in optimizer.optimizer.state.values() for v in s.values()
                if torch.is_tensor(v)]
    tensors.append(optimizer._step_slot)
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values())


def _memory(dtype, shard_gradients):
    chunks, optimizer = _build("distributed", shard_gradients, dtype)
    _train(chunks, optimizer, _global_batches(MICROBATCHES // 2, steps=1))
    dp = ps.get_data_parallel_world_size()
    buckets = _buckets(chunks)
    padded = sum(b.numel for b in buckets)  # P: buckets padded to DP multiples
    pieces = [piece for shard in optimizer.shards for piece, *_ in shard.pieces]
    param_bytes = torch.tensor([], dtype=dtype).element_size()
    # The unsharded remainder: the full model parameters, one 4-byte Adam step counter per
    # optimizer piece, the 8-byte step slot used at saves.
    remainder = padded * param_bytes + 4 * len(pieces) + 8
    grads = (padded // dp if shard_gradients else padded) * 4  # fp32 gradients
    main_copies = padded // dp * 4 if dtype != torch.float32 else 0  # fp32 masters, sharded
    adam = 2 * 4 * sum(p.numel() for p in pieces)  # exp_avg, exp_avg_sq
    return dict(held=_held_bytes(chunks, optimizer), remainder=remainder,
                formula=remainder + grads + main_copies + adam,
                model=sum(p.numel() for p in chunks[0].module.parameters()),
                padding=padded - sum(p.numel() for p in chunks[0].module.parameters()))


@pytest.mark.parametrize("dtype", [torch.float32,
                                   pytest.param(torch.bfloat16, marks=pytest.mark.slow)],
                         ids=["fp32", "bf16"])
def test_memory_after_the_step_is_the_shard_plus_the_unsharded_remainder(dtype):
    """Measured bytes equal the formula on every rank; at DP=4 the sharded part (gradients,
    main params, Adam moments) is at most 1/4 of DP=1's plus the padding of the buckets."""
    one = run_distributed(_memory, world_size=1, tp=1, dtype=dtype, shard_gradients=True)[0]
    four = run_distributed(_memory, world_size=4, tp=1, dtype=dtype, shard_gradients=True)
    full = run_distributed(_memory, world_size=4, tp=1, dtype=dtype, shard_gradients=False)
    for r in [one] + four + full:
        assert r["held"] == r["formula"], r
    per_element = 4 + 8 + (4 if dtype != torch.float32 else 0)
    sharded_one = one["held"] - one["remainder"]
    assert one["padding"] == 0
    for r in four:
        assert r["held"] - r["remainder"] <= sharded_one / 4 + r["padding"] * per_element / 4
    for zero2, zero1 in zip(four, full):  # only the gradients differ: 3/4 of them freed
        assert zero1["held"] - zero2["held"] == 3 * (zero1["model"] + zero1["padding"])


# --- checkpoints, errors ---------------------------------------------------------------------

def _save_then_continue():
    chunks, optimizer = _build("overlapped", True)
    batches = _global_batches(MICROBATCHES, steps=4)
    _train(chunks, optimizer, batches[:2])
    state = optimizer.state_dict()
    saved = dict(model={k: v.clone() for k, v in chunks[0].state_dict().items()},
                 optimizer=copy.deepcopy(state))
    return saved, _train(chunks, optimizer, batches[2:])[0]


def _resume(checkpoint):
    chunks, optimizer = _build("overlapped", True, seed=7)  # other initial weights
    chunks[0].load_state_dict(checkpoint["model"])
    optimizer.load_state_dict(checkpoint["optimizer"])
    return _train(chunks, optimizer, _global_batches(MICROBATCHES, steps=4)[2:])[0]


def test_checkpoint_save_and_resume_with_sharded_gradients_bitwise():
    runs = run_distributed(_save_then_continue, world_size=2, tp=1)
    checkpoint, want = runs[0]
    for got in run_distributed(_resume, world_size=2, tp=1, checkpoint=checkpoint):
        for a, b in zip(got, want):
            _assert_params(a, b, 0)


def _backward_after_the_step_without_zeroing():
    chunks, optimizer = _build("distributed", True)
    batch = _global_batches(1, steps=1)[0]
    _train(chunks, optimizer, [batch])
    get_forward_backward_func()(forward_step_func=_forward_step, data_iterator=iter(batch),
                                model=chunks, num_microbatches=1, seq_length=SEQ,
                                micro_batch_size=MBS)


def test_a_backward_without_zero_grad_buffer_after_the_step_fails_clearly():
    with pytest.raises(RankFailed, match="call zero_grad_buffer"):
        run_distributed(_backward_after_the_step_without_zeroing, world_size=1, tp=1)


def test_the_flag_needs_a_distributed_optimizer():
    with pytest.raises(ValueError, match="--shard-gradients needs"):
        DistributedDataParallelConfig(shard_gradients=True)
    assert "--shard-gradients has no effect without --use-distributed-optimizer" in error_of(
        small("--shard-gradients"))


@pytest.mark.parametrize("flag", ["--use-distributed-optimizer",
                                  "--overlapped-distributed-optimizer"])
def test_the_flag_maps_to_the_ddp_config(flag):
    from megatron.training.arguments import build_configs, parse_args
    ddp = build_configs(parse_args(small("--shard-gradients", flag)), world_size=1).ddp
    assert ddp.shard_gradients and ddp.use_distributed_optimizer
    assert not build_configs(parse_args(small(flag)), world_size=1).ddp.shard_gradients
