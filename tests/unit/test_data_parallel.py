"""Data parallelism and the optimizer against a single process on the same global batch.

The global batch is MICROBATCHES microbatches; DP rank r takes its contiguous share and divides
its loss by its own microbatch count; DDP averages over DP. Scaling by DP (a power of two) is
exact, so the only difference from one process is the order of summation: one process adds the
microbatch gradients one after another, DP adds each rank's partial sums in the all-reduce.
With one microbatch per rank on DP=2 that is a single addition either way: bitwise. Otherwise
parameters agree to 1e-6 (fp32 rounding of a reassociated sum, passed through Adam).
"""
import pytest
import torch

from megatron.core import parallel_state as ps
from megatron.core.distributed import (
    DistributedDataParallel,
    DistributedDataParallelConfig,
    ddp_config_for_optimizer,
    finalize_model_grads,
)
from megatron.core.models import GPTModel, LlamaModel, llama_config
from megatron.core.models.tp_sharding import merge_state_dicts, select_layers
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer, get_param_groups
from megatron.core.pipeline_parallel import build_model_chunks, get_forward_backward_func
from megatron.core.transformer import TransformerConfig
from tests.collective_counter import count_collectives
from tests.distributed import run_distributed

VOCAB, SEQ, MBS = 64, 16, 2
STEPS = 5
REASSOCIATION_TOL = 1e-6
ADAM = dict(lr=1e-3, weight_decay=0.1, adam_beta1=0.9, adam_beta2=0.95, adam_eps=1e-8)
SGD = dict(optimizer="sgd", lr=0.1, sgd_momentum=0.9, weight_decay=0.1)


def _config(**extra):
    return llama_config(num_layers=2, hidden_size=32, num_attention_heads=8,
                        num_query_groups=4, ffn_hidden_size=48, max_position_embeddings=SEQ,
                        **extra)


def _global_batches(num_microbatches, steps=STEPS):
    g = torch.Generator().manual_seed(11)
    return [[(torch.randint(0, VOCAB, (MBS, SEQ), generator=g),
              torch.randint(0, VOCAB, (MBS, SEQ), generator=g))
             for _ in range(num_microbatches)] for _ in range(steps)]


def _loss_func(per_token_loss):
    loss = per_token_loss.mean()
    return loss, {"lm loss": loss.detach()}


def _forward_step(data_iterator, model):
    tokens, labels = next(data_iterator)
    dev = next(model.parameters()).device  # the GPU tier reuses this on CUDA models
    return model(tokens.to(dev), labels=labels.to(dev)), _loss_func


def _reference(num_microbatches, clip_grad=0.0, sgd=False):
    """Plain torch: the whole global batch, gradient accumulation, torch AdamW (or SGD with
    momentum)."""
    torch.manual_seed(42)
    model = LlamaModel(_config(), VOCAB)
    groups = [{**g, "weight_decay": ADAM["weight_decay"] * g["wd_mult"]}
              for g in get_param_groups([model])]
    if sgd:
        opt = torch.optim.SGD(groups, lr=SGD["lr"], momentum=SGD["sgd_momentum"], fused=True)
    else:
        opt = torch.optim.AdamW(groups, lr=ADAM["lr"], betas=(ADAM["adam_beta1"],
                                ADAM["adam_beta2"]), eps=ADAM["adam_eps"], fused=True)
    history = []
    for batch in _global_batches(num_microbatches):
        opt.zero_grad(set_to_none=True)
        for tokens, labels in batch:
            (model(tokens, labels=labels).mean() / num_microbatches).backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip_grad or float("inf"))
        opt.step()
        history.append(({n: p.detach().clone() for n, p in model.named_parameters()},
                        norm.item()))
    return history


def _data_parallel(num_microbatches, overlap, bucket_size=None, clip_grad=0.0,
                   zero_buffers=True):
    config = _config()
    torch.manual_seed(42)
    model = DistributedDataParallel(
        config, DistributedDataParallelConfig(overlap_grad_reduce=overlap,
                                              bucket_size=bucket_size),
        LlamaModel(config, VOCAB))
    config.finalize_model_grads_func = finalize_model_grads
    optimizer = get_megatron_optimizer(OptimizerConfig(clip_grad=clip_grad, **ADAM), [model])
    dp, rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    local = num_microbatches // dp
    history, counts = [], []
    for batch in _global_batches(num_microbatches):
        if zero_buffers:
            model.zero_grad_buffer()
        optimizer.zero_grad()
        mine = batch[rank * local:(rank + 1) * local]
        seen_before_last = []

        def step(data_iterator, chunk, _seen=seen_before_last):
            if len(_seen) < local:
                _seen.append(dict(totals))
            return _forward_step(data_iterator, chunk)

        with count_collectives() as totals:
            get_forward_backward_func()(forward_step_func=step, data_iterator=iter(mine),
                                        model=[model], num_microbatches=local,
                                        seq_length=SEQ, micro_batch_size=MBS)
        counts.append((seen_before_last[-1].get("all_reduce", 0), totals["all_reduce"]))
        ok, norm, _ = optimizer.step()
        assert ok
        history.append(({n: p.detach().clone() for n, p in model.module.named_parameters()},
                         norm))
    buckets = sum(len(b.buckets) for b in model.buffers)
    return dict(history=history, counts=counts, buckets=buckets)


def _assert_params(got, want, tol):
    for name, value in want.items():
        if tol == 0:
            assert torch.equal(got[name], value), name
        else:
            err = (got[name] - value).abs().max().item()
            assert err <= tol, f"{name}: {err:.3g} > {tol}"


@pytest.mark.parametrize("dp,num_microbatches,tol", [(2, 2, 0), (2, 4, REASSOCIATION_TOL),
                                                     (4, 4, REASSOCIATION_TOL)])
def test_data_parallel_steps_equal_single_process(dp, num_microbatches, tol):
    reference = run_distributed(_reference, world_size=1, tp=1,
                                num_microbatches=num_microbatches)[0]
    runs = {}
    for overlap in (False, True):
        runs[overlap] = run_distributed(_data_parallel, world_size=dp, tp=1,
                                        num_microbatches=num_microbatches, overlap=overlap,
                                        bucket_size=1000)
    for overlap, ranks in runs.items():
        for rank in ranks:
            for (params, _), (want, _) in zip(rank["history"], reference):
                _assert_params(params, want, tol)
    # Overlapped and synchronous reduction: the same buckets, the same sums, bit for bit.
    for a, b in zip(runs[False], runs[True]):
        for (pa, _), (pb, _) in zip(a["history"], b["history"]):
            _assert_params(pa, pb, 0)


@pytest.mark.parametrize("overlap,zero_buffers", [(False, True), (True, True), (True, False)])
def test_one_all_reduce_per_bucket_and_none_before_the_last_microbatch(overlap, zero_buffers):
    # Without zeroing the buffers between iterations gradients accumulate, but every
    # iteration still reduces every bucket once.
    for rank in run_distributed(_data_parallel, world_size=2, tp=1, num_microbatches=6,
                                overlap=overlap, bucket_size=1000, zero_buffers=zero_buffers):
        assert rank["buckets"] > 2
        for before_last, total in rank["counts"]:
            assert before_last == 0
            assert total == rank["buckets"]


# --- TP=2 x PP=2 x DP=2: the global norm and clipped steps ----------------------------------

CLIP = 0.05
TP_TOL = 1e-5  # as in the models issue: TP splits the GEMM sums
NORM_RTOL = 1e-6  # sums of squares added in another order


def _model_for(kind, config):
    if kind == "llama":
        return lambda **stage: LlamaModel(config, VOCAB, **stage)
    return lambda **stage: GPTModel(config, VOCAB, **stage)


def _sized_config(kind, **parallel):
    if kind == "llama":
        return _config(**parallel)
    return TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4,
                             max_position_embeddings=SEQ, attention_dropout=0.0,
                             hidden_dropout=0.0, **parallel)


def _reference_clipped(kind, num_microbatches):
    torch.manual_seed(42)
    model = _model_for(kind, _sized_config(kind))()
    groups = [{**g, "weight_decay": ADAM["weight_decay"] * g["wd_mult"]}
              for g in get_param_groups([model])]
    opt = torch.optim.AdamW(groups, lr=ADAM["lr"], betas=(ADAM["adam_beta1"],
                            ADAM["adam_beta2"]), eps=ADAM["adam_eps"], fused=True)
    history = []
    for batch in _global_batches(num_microbatches, steps=3):
        opt.zero_grad(set_to_none=True)
        for tokens, labels in batch:
            (model(tokens, labels=labels).mean() / num_microbatches).backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        history.append(({n: p.detach().clone() for n, p in model.named_parameters()},
                        norm.item()))
    return history


def _three_d(kind, num_microbatches, sharded="none", bucket_size=500):
    config = _sized_config(kind, tensor_model_parallel_size=2, pipeline_model_parallel_size=2,
                           sequence_parallel=kind == "llama")
    opt_config = OptimizerConfig(clip_grad=CLIP, use_distributed_optimizer=sharded == "distributed",
                                 overlapped_distributed_optimizer=sharded == "overlapped", **ADAM)
    torch.manual_seed(42)
    chunks = [DistributedDataParallel(config, ddp_config_for_optimizer(
        opt_config, overlap_grad_reduce=True, bucket_size=bucket_size,
        reduce_bucket_size=bucket_size), chunk)
        for chunk in build_model_chunks(_model_for(kind, config), config)]
    config.finalize_model_grads_func = finalize_model_grads
    optimizer = get_megatron_optimizer(opt_config, chunks)
    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    local = num_microbatches // dp
    (chunk,) = chunks
    history = []
    for batch in _global_batches(num_microbatches, steps=3):
        chunk.zero_grad_buffer()
        optimizer.zero_grad()
        get_forward_backward_func()(
            forward_step_func=_forward_step,
            data_iterator=iter(batch[dp_rank * local:(dp_rank + 1) * local]), model=chunks,
            num_microbatches=local, seq_length=SEQ, micro_batch_size=MBS)
        ok, norm, _ = optimizer.step()
        chunk.finish_param_sync()  # an overlapped all-gather may still be writing them
        history.append(({n: p.detach().clone() for n, p in chunk.module.named_parameters()},
                        norm))
    inner = chunk.module
    return dict(history=history, tp=ps.get_tensor_model_parallel_rank(),
                pp=ps.get_pipeline_model_parallel_rank(), dp=dp_rank,
                layer_range=(inner.decoder.layer_offset,
                             inner.decoder.layer_offset + len(inner.decoder.layers)),
                pre=inner.pre_process, post=inner.post_process,
                tied=inner.share_embeddings_and_output_weights)


@pytest.mark.parametrize("kind", ["llama", "gpt"])
def test_global_norm_and_clipped_steps_on_tp_pp_dp(kind):
    """LLaMA under sequence parallelism (norm grads summed over TP); GPT with its embedding
    tied across the first and last stage (counted once in the norm)."""
    check_tp_pp_dp_against_single_process(kind)


def check_tp_pp_dp_against_single_process(kind, sharded="none", bucket_size=500):
    reference = run_distributed(_reference_clipped, world_size=1, tp=1, kind=kind,
                                num_microbatches=4)[0]
    assert all(norm > CLIP for _, norm in reference), "clipping must be active"
    ranks = run_distributed(_three_d, world_size=8, tp=2, pp=2, kind=kind, num_microbatches=4,
                            sharded=sharded, bucket_size=bucket_size)
    gated = kind == "llama"
    for step, (want_params, want_norm) in enumerate(reference):
        for rank in ranks:
            assert rank["history"][step][1] == pytest.approx(want_norm, rel=NORM_RTOL)
        for pp in (0, 1):
            for dp in (0, 1):
                shards = sorted((r for r in ranks if r["pp"] == pp and r["dp"] == dp),
                                key=lambda r: r["tp"])
                merged = merge_state_dicts([r["history"][step][0] for r in shards], gated)
                r = shards[0]
                want = select_layers(want_params, r["layer_range"], r["pre"], r["post"],
                                     r["tied"])
                assert merged.keys() == want.keys()
                _assert_params(merged, want, TP_TOL)


def _accumulate_small_after_large(grad_reduce_in_fp32):
    """bf16 params; two microbatches whose gradients are 1 and 2**-10 (below bf16's
    resolution at 1). ``main_grad`` keeps the small one only when it is fp32."""
    module = torch.nn.Linear(1, 1, bias=False).to(torch.bfloat16)
    model = DistributedDataParallel(
        _config(), DistributedDataParallelConfig(grad_reduce_in_fp32=grad_reduce_in_fp32),
        module)
    with model.no_sync():
        (module.weight * 1.0).sum().backward()
    (module.weight * 2.0 ** -10).sum().backward()
    model.finish_grad_sync()
    return module.weight.main_grad.dtype, module.weight.main_grad.float().item()


def test_accumulate_allreduce_grads_in_fp32():
    dtype, value = run_distributed(_accumulate_small_after_large, world_size=1, tp=1,
                                   grad_reduce_in_fp32=True)[0]
    assert dtype == torch.float32 and value == 1.0 + 2.0 ** -10
    dtype, value = run_distributed(_accumulate_small_after_large, world_size=1, tp=1,
                                   grad_reduce_in_fp32=False)[0]
    assert dtype == torch.bfloat16 and value == 1.0


def _dropped_model_is_freed():
    """A model wrapped in DDP, trained a step, then dropped: its parameters are freed (the
    gradient hooks autograd keeps in C++ must not hold the wrapper; they did, and a benchmark
    that built one model after another ran out of GPU memory)."""
    import gc
    import weakref
    module = torch.nn.Linear(4, 4, bias=False)
    model = DistributedDataParallel(_config(), DistributedDataParallelConfig(), module)
    model(torch.ones(2, 4)).sum().backward()
    model.finish_grad_sync()
    weight = weakref.ref(module.weight)
    del model, module
    gc.collect()
    return weight() is None


def test_a_dropped_ddp_model_is_freed():
    assert run_distributed(_dropped_model_is_freed, world_size=1, tp=1) == [True]
