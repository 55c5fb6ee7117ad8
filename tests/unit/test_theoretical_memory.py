"""The memory estimate against what real CPU runs hold.

Parameters, gradients and optimizer state: measured from the model's, the DDP buffers' and the
optimizer's own tensors (unique storages) after a real training step, on every rank of several
TP/PP/VPP/DP layouts, fp32 and bf16, plain and distributed optimizer: equal to the byte.
Activations: the bytes of the tensors autograd saves for one microbatch (counted with
``torch.autograd.graph.saved_tensors_hooks``, unique storages, parameters excluded) against the
estimate, with and without recomputation; the issue allows 15 %, the terms are this code's
layers, so the tolerance asserted is 1 %.
"""
import dataclasses

import pytest
import torch

from megatron.core import parallel_state as ps
from megatron.core.distributed import DistributedDataParallelConfig
from megatron.core.models import GPTModel, LlamaModel, llama_config
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.pipeline_parallel.model_chunks import unwrap_model
from megatron.core.pipeline_parallel.schedule_order import max_in_flight, schedule_order
from megatron.core.tensor_parallel import model_parallel_manual_seed
from megatron.core.transformer import TransformerConfig
from megatron.training.memory.activations import (
    ActivationSetup,
    chunk_bytes,
    layer_bytes,
    stage_activations,
)
from megatron.training.memory.base import ModelStateBytes, OptimizerSetup, ParamShape
from megatron.training.memory.estimate import (
    estimate_memory,
    format_report,
    optimizer_setup_from,
)
from megatron.training.memory.modes import rank_state_bytes
from megatron.training.memory.params import chunk_state_bytes
from megatron.training.training import build_model, train_step
from tests.distributed import run_distributed
from tests.unit.test_data_parallel import _forward_step

VOCAB, SEQ, MBS = 64, 16, 2
ACTIVATION_TOL = 0.01


def _gpt_config(**extra):
    return TransformerConfig(**{**dict(num_layers=4, hidden_size=32, num_attention_heads=4,
                                       ffn_hidden_size=48, max_position_embeddings=SEQ),
                                **extra})


def _llama_config(**extra):
    return llama_config(num_layers=4, hidden_size=32, num_attention_heads=8,
                        num_query_groups=4, ffn_hidden_size=48, max_position_embeddings=SEQ,
                        **extra)


def _mla_config(**extra):
    """DeepSeek-V3's attention (with both latents and their norms) in a LLaMA."""
    return llama_config(num_layers=4, hidden_size=32, num_attention_heads=4, ffn_hidden_size=48,
                        max_position_embeddings=SEQ, multi_latent_attention=True,
                        q_lora_rank=12, kv_lora_rank=16, qk_head_dim=8, qk_pos_emb_head_dim=4,
                        v_head_dim=6, qk_layernorm=True, rotary_interleaved=True, **extra)


_CONFIGS = {"gpt": _gpt_config, "llama": _llama_config, "mla": _mla_config}


def _unique_bytes(tensors, exclude=()) -> int:
    storages = {}
    for t in tensors:
        storage = t.untyped_storage()
        if storage.data_ptr() not in exclude:
            storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def _ptrs(tensors):
    return {t.untyped_storage().data_ptr() for t in tensors}


def _measured_state(model, optimizer) -> ModelStateBytes:
    params = [p for chunk in model for p in unwrap_model(chunk).parameters()]
    grads = [buffer.grad_data for chunk in model for buffer in chunk.buffers]
    mains = [p for g in optimizer.optimizer.param_groups for p in g["params"]]
    states, steps = [], 0
    for main in mains:
        for key, value in optimizer.optimizer.state.get(main, {}).items():
            if key == "step":
                steps += value.numel() * value.element_size()
            else:
                states.append(value)
    return ModelStateBytes(
        params=_unique_bytes(params), grads=_unique_bytes(grads),
        main_params=_unique_bytes(mains, exclude=_ptrs(params)),
        main_grads=_unique_bytes([m.grad for m in mains if m.grad is not None],
                                 exclude=_ptrs(grads)),
        optimizer_states=_unique_bytes(states), step_counters=steps)


def _state_after_a_step(arch, dtype, distributed, grad_fp32, bucket_size, num_microbatches,
                        optimizer="adam"):
    config = _CONFIGS[arch](
        tensor_model_parallel_size=ps.get_tensor_model_parallel_world_size(),
        pipeline_model_parallel_size=ps.get_pipeline_model_parallel_world_size(),
        virtual_pipeline_model_parallel_size=ps.get_virtual_pipeline_model_parallel_world_size(),
        context_parallel_size=ps.get_context_parallel_world_size(),
        params_dtype=dtype, hidden_dropout=0.0, attention_dropout=0.0)
    model_class = GPTModel if arch == "gpt" else LlamaModel
    ddp = DistributedDataParallelConfig(grad_reduce_in_fp32=grad_fp32, bucket_size=bucket_size,
                                        use_distributed_optimizer=distributed)
    model = build_model(lambda **stage: model_class(config, VOCAB, **stage), config, ddp, 42)
    bf16 = dtype == torch.bfloat16
    kind = optimizer
    optimizer = get_megatron_optimizer(OptimizerConfig(
        optimizer=kind, lr=1e-3, bf16=bf16, params_dtype=dtype,
        use_distributed_optimizer=distributed), model)
    g = torch.Generator().manual_seed(3)
    batch = [(torch.randint(0, VOCAB, (MBS, SEQ), generator=g),
              torch.randint(0, VOCAB, (MBS, SEQ), generator=g)) for _ in range(num_microbatches)]
    iterators = [iter(batch) for _ in model] if len(model) > 1 else iter(batch)
    _, skipped, _, _ = train_step(_forward_step, iterators, model, optimizer, None,
                                  num_microbatches, SEQ, MBS)
    assert not skipped
    # Gradients are reduced, and the optimizer sharded, over DP x CP.
    setup = OptimizerSetup(data_parallel_size=ps.get_data_parallel_world_size(True),
                           use_distributed_optimizer=distributed, grad_reduce_in_fp32=grad_fp32,
                           bucket_size=bucket_size, optimizer=kind)
    estimate = rank_state_bytes(config, VOCAB, setup, ps.get_pipeline_model_parallel_rank(),
                                torch.empty((), dtype=dtype).element_size(),
                                ps.get_data_parallel_rank(True),
                                share_embeddings_and_output_weights=arch == "gpt")
    return dataclasses.asdict(_measured_state(model, optimizer)), dataclasses.asdict(estimate)


STATE_CASES = [
    # world, tp, pp, vpp, arch, dtype, distributed optimizer, fp32 grads, bucket size, cp
    (8, 2, 2, None, "gpt", torch.float32, False, False, None),
    (8, 2, 2, None, "gpt", torch.float32, True, False, 1000),
    (8, 1, 2, 2, "llama", torch.float32, True, False, None),
    (4, 1, 1, None, "llama", torch.bfloat16, True, False, 700),
    (4, 2, 2, None, "gpt", torch.bfloat16, False, False, None),
    (4, 1, 2, None, "llama", torch.bfloat16, True, True, 1500),
    (2, 1, 1, None, "gpt", torch.bfloat16, False, True, None),
    (4, 1, 1, None, "llama", torch.bfloat16, True, False, 700, 2),  # sharded over DP 2 x CP 2
    (8, 2, 2, None, "mla", torch.float32, True, False, 1000),  # multi-latent attention
]


@pytest.mark.parametrize("world,tp,pp,vpp,arch,dtype,distributed,grad_fp32,bucket,cp",
                         [case + (1,) * (10 - len(case)) for case in STATE_CASES])
def test_state_estimate_equals_the_tensors_of_a_real_step(world, tp, pp, vpp, arch, dtype,
                                                          distributed, grad_fp32, bucket, cp):
    results = run_distributed(_state_after_a_step, world_size=world, tp=tp, pp=pp, vpp=vpp, cp=cp,
                              arch=arch, dtype=dtype, distributed=distributed,
                              grad_fp32=grad_fp32, bucket_size=bucket, num_microbatches=4)
    for rank, (measured, estimate) in enumerate(results):
        assert measured == estimate, f"rank {rank}"
        assert measured["params"] > 0 and measured["optimizer_states"] > 0


@pytest.mark.parametrize("pp,distributed,bucket", [(2, False, None), (1, True, 700)])
def test_muon_state_estimate_equals_the_tensors_of_a_real_step(pp, distributed, bucket):
    """Muon: one momentum per layer matrix and no step counter for it; AdamW's two moments
    and a step for the rest (embeddings, output layer, norms). Distributed (DP 2): per piece
    of each rank's shards."""
    kw = dict(world_size=4, tp=2, pp=pp, arch="llama", dtype=torch.bfloat16,
              distributed=distributed, grad_fp32=True, bucket_size=bucket, num_microbatches=2)
    results = run_distributed(_state_after_a_step, optimizer="muon", **kw)
    adam = run_distributed(_state_after_a_step, **kw)
    for rank, ((measured, estimate), (adam_measured, _)) in enumerate(zip(results, adam)):
        assert measured == estimate, f"rank {rank}"
        assert 0 < measured["optimizer_states"] < adam_measured["optimizer_states"]


def test_state_per_parameter_matches_megatrons_table():
    """Without padding the totals are the bytes/param of Megatron's distributed-optimizer
    documentation (step counters aside)."""
    shapes = [ParamShape("weight", 1000), ParamShape("bias", 24)]  # 1024: no DP padding
    cases = [  # (param bytes, fp32 grad buffers, distributed, dp, bytes per param)
        (2, False, False, 1, 20), (2, True, False, 1, 18), (4, True, False, 1, 16),
        (2, False, True, 4, 4 + 16 / 4), (2, True, True, 4, 6 + 12 / 4),
        (4, True, True, 4, 8 + 8 / 4)]
    for param_bytes, grad_fp32, distributed, dp, per_param in cases:
        setup = OptimizerSetup(data_parallel_size=dp, use_distributed_optimizer=distributed,
                               grad_reduce_in_fp32=grad_fp32)
        state = chunk_state_bytes(shapes, setup, param_bytes)
        assert state.total - state.step_counters == per_param * 1024


# --- activations ------------------------------------------------------------------------------

def _saved_bytes(config, model_class, micro_batch_size):
    """Bytes autograd saves for one microbatch through the whole model on this rank."""
    model_parallel_manual_seed(7)
    model = model_class(config, VOCAB)
    g = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, VOCAB, (micro_batch_size, SEQ), generator=g)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        loss = model(tokens, labels=tokens).mean()
    loss.backward()  # the saved tensors were all usable
    return _unique_bytes(saved, exclude=_ptrs(model.parameters()))


def _activation_case(arch, recompute, sequence_parallel, dropout, micro_batch_size):
    tp = ps.get_tensor_model_parallel_world_size()
    extra = dict(tensor_model_parallel_size=tp, sequence_parallel=sequence_parallel,
                 hidden_dropout=dropout, attention_dropout=dropout)
    if recompute == "selective":
        extra.update(recompute_granularity="selective")
    elif recompute is not None:
        extra.update(recompute_granularity="full", recompute_method=recompute,
                     recompute_num_layers=2 if recompute == "uniform" else 3)
    config = _CONFIGS[arch](**extra)
    measured = _saved_bytes(config, GPTModel if arch == "gpt" else LlamaModel,
                            micro_batch_size)
    setup = ActivationSetup(SEQ, micro_batch_size, 4, VOCAB, device="cpu")
    return measured, chunk_bytes(config, setup, 0)


ACTIVATION_CASES = [
    # world (= TP), arch, recompute, sequence parallel, dropout, micro batch
    (1, "llama", None, False, 0.0, MBS),
    (1, "llama", None, False, 0.0, 1),
    (1, "llama", "selective", False, 0.0, MBS),
    (1, "llama", "uniform", False, 0.0, MBS),
    (1, "gpt", None, False, 0.1, MBS),
    (1, "gpt", "selective", False, 0.1, MBS),
    (1, "gpt", "block", False, 0.1, MBS),
    (1, "gpt", None, False, 0.0, 1),
    (2, "llama", None, True, 0.0, MBS),
    (2, "llama", "selective", True, 0.0, MBS),
    (2, "gpt", None, False, 0.1, MBS),
    (2, "gpt", "uniform", True, 0.1, MBS),
    # multi-latent attention: fused kernels (V padded), the math kernel (CPU with dropout)
    (1, "mla", None, False, 0.0, MBS),
    (1, "mla", None, False, 0.1, MBS),
    (1, "mla", "selective", False, 0.1, MBS),
    (2, "mla", None, True, 0.0, MBS),
]


@pytest.mark.parametrize("world,arch,recompute,sequence_parallel,dropout,micro_batch",
                         ACTIVATION_CASES)
def test_activation_estimate_matches_saved_tensors(world, arch, recompute, sequence_parallel,
                                                   dropout, micro_batch):
    for measured, estimate in run_distributed(
            _activation_case, world_size=world, tp=world, arch=arch, recompute=recompute,
            sequence_parallel=sequence_parallel, dropout=dropout, micro_batch_size=micro_batch):
        if arch == "mla":  # its terms are its saved tensors: to the byte
            assert estimate == measured, (estimate, measured)
        assert abs(estimate - measured) <= ACTIVATION_TOL * measured, (estimate, measured)


def _compiled_activation_case(dtype):
    config = _llama_config(torch_compile=True, params_dtype=dtype)
    measured = _saved_bytes(config, LlamaModel, MBS)
    setup = ActivationSetup(SEQ, MBS, dtype.itemsize, VOCAB, device="cpu")
    return measured, chunk_bytes(config, setup, 0)


def test_compiled_path_estimate_matches_saved_tensors():
    """CUDA's default path (compiled regions, the fused cross entropy that keeps the logits in
    their own dtype, not an fp32 copy; bf16, where that differs from the eager path's fp32
    copy): the estimate is what autograd keeps, to the byte."""
    (result,) = run_distributed(_compiled_activation_case, world_size=1, tp=1,
                                dtype=torch.bfloat16)
    measured, estimate = result
    assert estimate == measured, (estimate, measured)


def test_sequence_parallel_divides_every_term_by_tp():
    """Korthikanti et al.: with TP t and SP a layer keeps exactly 1/t of the unsharded one."""
    setup = ActivationSetup(seq_length=4096, micro_batch_size=1, activation_bytes=2,
                            padded_vocab_size=32000, device="cuda")
    base = dict(num_layers=32, hidden_size=4096, num_attention_heads=32,
                ffn_hidden_size=11008)
    one = layer_bytes(llama_config(**base), setup)
    for tp in (2, 4, 8):
        sharded = llama_config(**base, tensor_model_parallel_size=tp, sequence_parallel=True)
        assert layer_bytes(sharded, setup) * tp == one
        for granularity in ("selective",):
            assert layer_bytes(sharded, setup, granularity) * tp == \
                layer_bytes(llama_config(**base), setup, granularity)
    # Selective recomputation is a no-op where the kernel is fused (flash keeps only Q, K, V,
    # output and log-sum-exp): nothing is recomputed, nothing saved.
    config = llama_config(**base)
    assert layer_bytes(config, setup, "selective") == layer_bytes(config, setup)


def test_in_flight_microbatches_follow_the_schedule():
    for pp, vpp, m in ((4, None, 8), (4, None, 2), (4, 2, 8), (2, 2, 4)):
        config = _gpt_config(num_layers=8, pipeline_model_parallel_size=pp,
                             virtual_pipeline_model_parallel_size=vpp)
        setup = ActivationSetup(SEQ, MBS, 2, VOCAB)
        for rank in range(pp):
            stage = stage_activations(config, setup, rank, m)
            costs = [chunk_bytes(config, setup, rank, c) for c in range(vpp or 1)]
            if vpp is None:
                assert stage.in_flight == min(pp - rank, m)
                assert stage.stored_bytes == stage.in_flight * costs[0]
            elif len(set(costs)) == 1:  # middle ranks: every chunk costs the same
                assert stage.in_flight == max_in_flight(schedule_order(pp, rank, m, vpp))
                assert stage.stored_bytes == stage.in_flight * costs[0]
            else:  # the embedding or the loss makes one chunk dearer: the peak is by bytes
                assert stage.in_flight <= max_in_flight(schedule_order(pp, rank, m, vpp))
                assert stage.stored_bytes >= stage.in_flight * min(costs)


def test_report_names_every_part():
    config = _llama_config(pipeline_model_parallel_size=2)
    estimate = estimate_memory(config, padded_vocab_size=VOCAB, seq_length=SEQ,
                               micro_batch_size=MBS, num_microbatches=4,
                               setup=OptimizerSetup(data_parallel_size=2,
                                                    use_distributed_optimizer=True))
    report = format_report(estimate)
    for word in ("pipeline rank 0", "pipeline rank 1", "params", "grads", "optimizer",
                 "activations", "in flight", "peak"):
        assert word in report
    assert estimate.max_total == max(s.total for s in estimate.stages)


# --- context parallelism ----------------------------------------------------------------------

def with_cp(config, cp: int, comm: str = "p2p"):
    """``config`` at context-parallel size ``cp`` with ``comm`` (``--cp-comm-type``)."""
    return dataclasses.replace(config, context_parallel_size=cp, cp_comm_type=comm)


LLAMA_7B_GQA = dict(num_layers=32, hidden_size=4096, num_attention_heads=32, num_query_groups=8,
                    ffn_hidden_size=11008, params_dtype=torch.bfloat16)


def _llama_layer_by_hand(s: int, b: int, tp: int, cp: int) -> dict:
    """One LLaMA layer's saved bytes on one rank (bf16, CUDA flash path, SP when TP > 1), term
    by term from the shapes: every term is per token, so CP divides each by ``cp``; at CP > 1
    the CP attention also keeps its own [b, heads, s/CP, d] output (attention.py hands the
    output projection a re-laid-out copy)."""
    h, f, d, e = 4096, 11008, 128, 2
    heads, groups = 32 // tp, 8 // tp
    tokens = s // cp * b  # this rank's tokens (head-tail chunks r and 2CP-1-r)
    sharded = tokens // tp  # sequence parallelism shards the norms and linear inputs
    return {"norms (input, rstd) x 2": 2 * (e * sharded * h + 4 * sharded),
            "QKV input": e * sharded * h, "QKV output": e * tokens * (heads + 2 * groups) * d,
            "Q after RoPE": e * tokens * heads * d, "K after RoPE": e * tokens * groups * d,
            "log-sum-exp (fp32)": 4 * b * heads * (s // cp),
            "projection input": e * tokens * heads * d,
            "MLP input": e * sharded * h, "SwiGLU fc1 out and product": e * tokens * 3 * f // tp,
            "CP attention output": e * tokens * heads * d if cp > 1 else 0}


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("cp", [2, 4])
def test_context_parallel_divides_every_activation_term(tp, cp):
    """At CP c a layer, the embedding, the loss and cos/sin keep 1/c of the CP=1 bytes
    (each term recomputed by hand at s/c), plus the CP attention's own output; the ring adds
    K/V and dK/dV blocks in flight, send and receive, once to the peak; all_gather saves the
    whole sequence's K and V per layer instead of the local ones."""
    s, b, vocab = 8192, 2, 32000
    setup = ActivationSetup(s, b, 2, vocab, device="cuda")
    base = llama_config(**LLAMA_7B_GQA, tensor_model_parallel_size=tp, sequence_parallel=tp > 1)
    assert layer_bytes(base, setup) == sum(_llama_layer_by_hand(s, b, tp, 1).values())
    ring = with_cp(base, cp)
    by_hand = _llama_layer_by_hand(s, b, tp, cp)
    assert layer_bytes(ring, setup) == sum(by_hand.values())
    one = _llama_layer_by_hand(s, b, tp, 1)
    assert all(by_hand[k] * cp == one[k] for k in one if k != "CP attention output")
    # Embedding ids (+ the TP range mask), output norm/input, fp32 logits and loss, cos/sin.
    tokens = s // cp * b
    embedding = 8 * tokens + (tokens if tp > 1 else 0)
    output = (2 * tokens // tp * 4096 + 4 * tokens // tp) + 2 * tokens // tp * 4096 + \
        4 * tokens * vocab // tp + 2 * 4 * tokens + tokens + 8 * tokens
    rotary = 2 * 4 * (s // cp) * 128
    whole = ring.num_layers * sum(by_hand.values()) + embedding + output + rotary
    assert chunk_bytes(ring, setup, 0) == whole
    assert chunk_bytes(ring, setup, 0) * cp == chunk_bytes(base, setup, 0) + \
        cp * ring.num_layers * by_hand["CP attention output"]
    # K/V blocks (bf16) and dK/dV blocks (fp32) of the ring, each a send and a receive buffer
    in_flight = 2 * 2 * b * (8 // tp) * (s // cp) * 128 * (2 + 4)
    stage = stage_activations(ring, setup, 0, 4)
    assert (stage.cp_kv_in_flight_bytes, stage.peak_bytes) == (in_flight, whole + in_flight)
    assert stage_activations(base, setup, 0, 4).cp_kv_in_flight_bytes == 0
    gather = with_cp(base, cp, "all_gather")
    gathered = 2 * 2 * b * (8 // tp) * s * 128  # K and V of all s tokens, bf16
    # Nothing keeps the local K (after RoPE) or the QKV output (V's storage; Q is RoPE's copy).
    local_kv = by_hand["K after RoPE"] + by_hand["QKV output"]
    assert layer_bytes(gather, setup) == sum(by_hand.values()) - local_kv + gathered
    # dK and dV of all s tokens in fp32, and their copy for the reduce-scatter
    assert stage_activations(gather, setup, 0, 4).cp_kv_in_flight_bytes == 2 * gathered * 2
    # At CP > 1 attention is never the math kernel: selective recomputation saves nothing.
    cpu = ActivationSetup(s, b, 4, vocab, device="cpu")
    dropout = with_cp(dataclasses.replace(base, attention_dropout=0.1), cp)
    assert layer_bytes(dropout, cpu, "selective") == layer_bytes(dropout, cpu)


def test_distributed_optimizer_shards_over_data_and_context_parallel():
    """Params and gradient buffers do not change with CP; the distributed optimizer's fp32
    main params, Adam m and v (and only those) divide by DP x CP, by hand for one bucket."""
    shapes = [ParamShape("weight", 4000), ParamShape("bias", 96)]  # 4096: no padding at 16
    for dp, cp in ((2, 1), (2, 2), (2, 4), (4, 4)):
        ddp = DistributedDataParallelConfig(use_distributed_optimizer=True,
                                            grad_reduce_in_fp32=True)
        optimizer = OptimizerConfig(lr=1e-3, bf16=True, use_distributed_optimizer=True)
        setup = optimizer_setup_from(ddp, optimizer, dp, cp)
        assert setup.data_parallel_size == dp * cp
        state = chunk_state_bytes(shapes, setup, 2)
        shard = 4096 // (dp * cp)
        assert dataclasses.astuple(state) == (
            2 * 4096, 4 * 4096, 4 * shard, 0, 2 * 4 * shard, 4 * 2, 0)  # rank 0: bias, weight
        # (the last: no FP8 weights)


def test_report_shows_the_rings_kv_in_flight():
    config = with_cp(_llama_config(), 2)
    report = format_report(estimate_memory(
        config, padded_vocab_size=VOCAB, seq_length=SEQ, micro_batch_size=MBS,
        num_microbatches=4, setup=OptimizerSetup(data_parallel_size=2)))
    in_flight = 2 * 2 * MBS * 4 * (SEQ // 2) * 4 * (4 + 4)  # fp32: 4 groups of head dim 4
    assert f"{in_flight / 2 ** 10:.3f} KiB cp kv in flight" in report
