"""--fp8-param-gather (fp8/param_gather.py) at TP 2 x DP 2 under the distributed optimizer,
against the same run without it: every loss and every weight bitwise equal (DP 2 sums a + b
whatever the buckets' layout, and the gathered FP8 bytes are what each layer quantizes from
its all-gathered weight), the FP8 weights' all-gathers one byte an element, their
high-precision copies not gathered until asked for. Tensorwise on the small model;
blockwise on one whose weights hold several 128 x 128 blocks, partial ones at the edges,
which the DP shards cut through."""
import math

import pytest
import torch

from megatron.core import parallel_state as ps
from megatron.core.distributed import DistributedDataParallelConfig
from megatron.core.fp8.config import Fp8Config
from megatron.core.fp8.quantize import TENSORWISE, quantize
from megatron.core.models import LlamaModel, llama_config
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
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

STEPS, MICROBATCHES = 3, 4


def _record_gathers(module, log):
    """Wrap ``module``'s all_gather_into_tensor: (dtype, elements) of each call."""
    real = module.all_gather_into_tensor

    def gather(output, input_, **kwargs):
        log.append((output.dtype, output.numel()))
        return real(output, input_, **kwargs)
    module.all_gather_into_tensor = gather
    return lambda: setattr(module, "all_gather_into_tensor", real)


def _own_range_equal(bucket, param, stale, fresh):
    """Whether ``stale`` equals ``fresh`` exactly inside this rank's shard of ``param`` and
    not outside it (an Adam step changes nearly every value; a bf16 one may round back)."""
    begin, end = bucket.shard_range()
    p_begin, p_end = bucket.param_ranges[param]
    inside = torch.zeros(param.numel(), dtype=torch.bool)
    inside[max(begin - p_begin, 0):max(min(end, p_end) - p_begin, 0)] = True
    same = (stale.reshape(-1) == fresh.reshape(-1)).cpu()
    outside = same[~inside]  # empty where the whole weight is in this rank's shard
    return bool(same[inside].all()) and (outside.numel() == 0 or not bool(outside.all()))


def _model_config(recipe, dtype, tp, moe):
    from megatron.core.transformer.moe.moe_config import MoEConfig

    fp8 = Fp8Config(format="e4m3" if recipe == "blockwise" else "hybrid", recipe=recipe,
                    amax_history_len=2 if recipe == "delayed" else 1,
                    amax_compute_algo="max")
    parallel = dict(tensor_model_parallel_size=tp, sequence_parallel=tp > 1,
                    params_dtype=dtype, fp8=fp8)
    if moe:  # 4 experts at EP 2 (expert TP 1, expert DP 2): 2 per rank, stacked
        parallel["moe"] = MoEConfig(num_moe_experts=4, moe_router_topk=2,
                                    moe_ffn_hidden_size=32 if recipe == "tensorwise" else 64)
    if recipe != "blockwise":
        return _config(**parallel)
    # TP shards (blocks): fc2 256 x 160 (2 x 2, the last column partial), fc1 320 x 256
    # (3 x 2, the last row partial), proj 256 x 128 (2 x 1), qkv 192 x 256 (2 x 2); the
    # experts' weight1 2 x 128 x 256 (2 x 2), weight2 2 x 256 x 64 (4 x 1)
    return llama_config(num_layers=1, hidden_size=256, num_attention_heads=8,
                        num_query_groups=2, ffn_hidden_size=320, max_position_embeddings=SEQ,
                        **parallel)


def _matrices_of(param):
    """The weight's matrices: itself, or each expert's of a stacked one (with its index)."""
    if param.dim() == 2:
        return [(None, param.detach())]
    return list(enumerate(param.detach()))


def _train(fp8_gather, overlap, dtype, recipe, tp=2, moe=False):
    """Three steps at TP ``tp`` x DP (the rest of the world); (also the GPU tier's, at TP 1 x
    DP 2 on the one GPU: tests/gpu/test_fp8_gpu.py)."""
    from megatron.core.distributed import param_and_grad_buffer
    from megatron.core.fp8 import param_gather

    experts = dict(expert_model_parallel_size=2, expert_tensor_parallel_size=1) if moe else {}
    ps.initialize_model_parallel(tp, 1, **experts)
    config = _model_config(recipe, dtype, tp, moe)
    ddp = DistributedDataParallelConfig(use_distributed_optimizer=True,
                                        grad_reduce_in_fp32=True,
                                        overlap_param_gather=overlap,
                                        fp8_param_gather=fp8_gather)
    model = build_model(lambda **stage: LlamaModel(config, VOCAB, **stage), config, ddp,
                        seed=42)
    optimizer = get_megatron_optimizer(OptimizerConfig(
        clip_grad=0.0, use_distributed_optimizer=True, bf16=dtype == torch.bfloat16, **ADAM),
        model)
    (chunk,) = model
    fp8_buckets = [b for b in chunk._buckets() if b.fp8_gather is not None]
    log = {"high": [], "fp8": []}
    restore = [_record_gathers(param_and_grad_buffer, log["high"]),
               _record_gathers(param_gather, log["fp8"])]
    dp, rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    local = MICROBATCHES // dp
    losses, checks = [], []
    try:
        for batch in _global_batches(MICROBATCHES, STEPS):
            report, skipped, _, _ = train_step(_forward_step, iter(batch[rank * local:][:local]),
                                               model, optimizer, None, local, SEQ, MBS)
            assert not skipped
            losses.append(float(report["lm loss"]))
            chunk.finish_param_sync()
            installed = {}
            for bucket in fp8_buckets:
                for param in bucket.params:
                    cache = param._fp8_cache[1]
                    installed[param] = (bucket, param.detach().clone(), [
                        cache[param.fp8_gemms._key("forward", e)] for e, _ in
                        _matrices_of(param)])
            chunk.gather_high_precision_params()
            for param, (bucket, stale, qs) in installed.items():
                gemms = param.fp8_gemms
                fine = True
                for q, (_, matrix) in zip(qs, _matrices_of(param), strict=True):
                    # what the layer quantizes from the whole high-precision weight (its TP
                    # amax all-reduce included)
                    want = gemms._quantize(matrix, gemms.config.forward_dtype, gemms.weight,
                                           sharded=True, operand="weight")
                    # ... and a view of the gathered bytes, no copy of its own (the memory
                    # estimate's forward FP8 copy is that buffer)
                    in_buffer = q.data.untyped_storage().data_ptr() == \
                        bucket.fp8_gather.data.untyped_storage().data_ptr()
                    fine &= torch.equal(q.data.view(torch.uint8), want.data.view(
                        torch.uint8)) and torch.equal(q.scale, want.scale) and in_buffer
                checks.append((fine, _own_range_equal(bucket, param, stale, param.detach())))
    finally:
        for undo in restore:
            undo()
    params = {n: p.detach().cpu().clone() for n, p in chunk.module.named_parameters()}
    fp8_numel = sum(b.numel for b in fp8_buckets)
    high_numel = sum(b.numel for b in chunk._buckets()) - fp8_numel
    blocks = [math.prod(g) for b in fp8_buckets for g in b.fp8_gather.grids]
    return dict(losses=losses, params=params, checks=checks, log=log, fp8_numel=fp8_numel,
                high_numel=high_numel, fp8_weights=len(blocks), blocks=blocks)


# Per case: the scaling groups of each FP8 weight (tensorwise 1, or one an expert; blockwise
# its 128 x 128 blocks). The overlapped gathers (forward pre-hooks), bf16 weights (fp32 main
# copies: the FP8 bytes cast from the bf16 shard) and the experts in the full suite only.
CASES = {
    "tensorwise": (("tensorwise", False, torch.float32, False), [1] * 8),
    "blockwise": (("blockwise", False, torch.float32, False), [2, 4, 4, 6]),
    "overlapped": (("tensorwise", True, torch.float32, False), [1] * 8),
    "blockwise-bf16": (("blockwise", False, torch.bfloat16, False), [2, 4, 4, 6]),
    "experts": (("tensorwise", False, torch.float32, True), [1, 1, 1, 1, 2, 2, 2, 2]),
    "experts-blockwise": (("blockwise", False, torch.float32, True), [2, 4, 4, 4]),
    "delayed": (("delayed", True, torch.float32, False), [1] * 8),
}
QUICK = ("tensorwise",)


@pytest.mark.parametrize("case,groups", [
    pytest.param(*CASES[name], marks=() if name in QUICK else pytest.mark.slow, id=name)
    for name in CASES])
def test_fp8_param_gather_trains_bitwise_like_the_high_precision_gather(case, groups):
    recipe, overlap, dtype, moe = case
    plain = run_distributed(_train, world_size=4, fp8_gather=False, overlap=False,
                            dtype=dtype, recipe=recipe, moe=moe)
    for result in plain:  # the reference: every weight gathered at its dtype, no FP8 bucket
        assert result["fp8_numel"] == 0 and not result["log"]["fp8"]
        assert {kind for kind, _ in result["log"]["high"]} == {dtype}
    fp8 = run_distributed(_train, world_size=4, fp8_gather=True, overlap=overlap, dtype=dtype,
                          recipe=recipe, moe=moe)
    for want, got in zip(plain, fp8, strict=True):
        assert got["losses"] == want["losses"]
        for name, value in want["params"].items():
            assert torch.equal(got["params"][name], value), name
        # every FP8 weight checked after each step: the installed FP8 matrices (data and
        # scales) are bitwise the layer's own quantization; the high-precision copy was
        # current only in this rank's shard until gather_high_precision_params
        assert sorted(got["blocks"]) == groups
        assert len(got["checks"]) == len(groups) * STEPS
        assert all(bytes_equal and own_only for bytes_equal, own_only in got["checks"])
        # per step: the FP8 buckets once as bytes (1 each), the rest once in the weights'
        # dtype; gather_high_precision_params adds one such gather of the FP8 buckets
        assert {kind for kind, _ in got["log"]["fp8"]} == {torch.uint8}
        assert sum(n for _, n in got["log"]["fp8"]) == STEPS * got["fp8_numel"]
        high = sum(n for kind, n in got["log"]["high"] if kind == dtype)
        assert high == STEPS * (got["high_numel"] + got["fp8_numel"])
        assert 0 < got["fp8_numel"] and 0 < got["high_numel"]


def _gather_unaligned():
    """A bucket of two weights, the second at byte offset 15 (as no real model's sizes put
    it): its installed FP8 weight is an aligned copy, the first one a view of the buffer;
    both the layer's own quantization."""
    from megatron.core.fp8.linear import Fp8Gemms
    from megatron.core.fp8.param_gather import Fp8ShardGather

    gemms = Fp8Gemms(Fp8Config())
    weights = [torch.nn.Parameter(torch.randn(3, 5)), torch.nn.Parameter(torch.randn(16, 16))]
    for weight in weights:
        weight.fp8_gemms = gemms
    gather = Fp8ShardGather({weights[0]: (0, 15), weights[1]: (15, 271)}, 272,
                            torch.distributed.group.WORLD)
    values = torch.cat([w.detach().reshape(-1) for w in weights] + [torch.zeros(1)])
    gather.start(values, 0, 272, async_op=False)
    out = []
    for weight in weights:
        q = weight._fp8_cache[1][gemms._key("forward")]
        want = quantize(weight.detach(), torch.float8_e4m3fn, TENSORWISE)
        out.append((torch.equal(q.data.view(torch.uint8), want.data.view(torch.uint8))
                    and torch.equal(q.scale, want.scale), q.data.data_ptr() % 16 == 0,
                    q.data.untyped_storage().data_ptr()
                    == gather.data.untyped_storage().data_ptr()))
    return out


def test_a_weight_at_an_unaligned_offset_gets_an_aligned_copy():
    (first, second), = run_distributed(_gather_unaligned, world_size=1)
    assert first == (True, True, True) and second == (True, True, False)


def _forward_after_the_fp8_copies_are_dropped():
    """A step with the flag, then every cached FP8 weight dropped (as an unexpected
    weights_changed() would): the next forward refuses the stale high-precision weights; after
    gather_high_precision_params() it runs, with the loss of a model whose weights are
    current (the same forward without the flag)."""
    from megatron.core.fp8.linear import weights_changed

    losses = {}
    for gather in (False, True):
        ps.initialize_model_parallel(1, 1)
        config = _model_config("tensorwise", torch.float32, 1, False)
        ddp = DistributedDataParallelConfig(use_distributed_optimizer=True,
                                            fp8_param_gather=gather)
        model = build_model(lambda **stage: LlamaModel(config, VOCAB, **stage), config, ddp,
                            seed=42)
        optimizer = get_megatron_optimizer(OptimizerConfig(
            clip_grad=0.0, use_distributed_optimizer=True, **ADAM), model)
        batch, = _global_batches(2, 1)
        rank = ps.get_data_parallel_rank()
        train_step(_forward_step, iter(batch[rank:rank + 1]), model, optimizer, None, 1, SEQ,
                   MBS)
        weights_changed()
        tokens, labels = batch[rank]
        if gather:
            try:
                model[0](tokens, labels=labels)
                losses["refused"] = False
            except RuntimeError as error:
                losses["refused"] = "gather_high_precision_params()" in str(error)
            model[0].gather_high_precision_params()
        with torch.no_grad():
            losses[gather] = model[0](tokens, labels=labels).mean().item()
        ps.destroy_model_parallel()
    return losses


def test_stale_high_precision_weights_are_never_quantized():
    for losses in run_distributed(_forward_after_the_fp8_copies_are_dropped, world_size=2):
        assert losses["refused"] and losses[True] == losses[False]
