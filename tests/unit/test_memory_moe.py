"""The memory estimate's MoE terms (memory/moe.py) against real MoE modules.

Activations: the bytes autograd saves for one MoE layer's forward (saved_tensors_hooks,
unique storages, parameters excluded, the layer input included: it is the MLP input term), as
test_theoretical_memory.py measures them, must equal ``moe_layer_terms`` exactly for router
variants, grouped GEMM, aux/z-loss, shared expert (gated), and capacity with and without
padding (the estimate assumes balanced routing: the cases here drop or keep what it assumes).
Parameters: the estimate's shapes of an MoE layer at EP / ETP equal the numel of a real
SwiGLUExperts built with the rank's E/EP experts and f/ETP, plus router and shared expert.
State: expert gradients and optimizer state shard over the expert-DP group (DP x TP / (ETP x
EP)), dense ones over DP, each by the formula of memory_params' docstring.
"""
import dataclasses

import pytest
import torch

from megatron.core import parallel_state as ps
from megatron.core.distributed import DistributedDataParallelConfig
from megatron.core.distributed.fsdp import TorchFSDP2Config
from megatron.core.models import LlamaModel, llama_config
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.tensor_parallel import model_parallel_manual_seed
from megatron.core.transformer.moe import MoEConfig
from megatron.core.transformer.moe.experts import SwiGLUExperts
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.training.memory.activations import ActivationSetup, chunk_bytes, layer_terms
from megatron.training.memory.base import OptimizerSetup
from megatron.training.memory.estimate import estimate_memory, format_report
from megatron.training.memory.modes import rank_state_bytes
from megatron.training.memory.moe import (
    dispatch_buffer_bytes,
    expert_data_parallel_size,
    is_expert_param,
    moe_layer_terms,
    moe_mlp_params,
)
from megatron.training.data.batch import shard_for_context_parallel
from megatron.training.memory.params import chunk_param_shapes
from megatron.training.training import build_model, train_step
from tests.distributed import run_distributed
from tests.unit.test_data_parallel import _forward_step
from tests.unit.test_memory_modes import _measured as _fsdp2_measured
from tests.unit.test_theoretical_memory import _measured_state, _ptrs, _unique_bytes

HIDDEN, SEQ, MBS, VOCAB = 16, 6, 2, 64


def _config(num_layers=2, tp=1, ep=1, etp=None, gpt_oss=False, **moe):
    """gpt_oss: biases everywhere (experts, shared expert, router) and the clamped
    quick-GeGLU."""
    base = dict(num_moe_experts=4, moe_ffn_hidden_size=8, moe_router_topk=2,
                moe_router_bias=gpt_oss)
    activation = dict(activation="quick_geglu", activation_func_clamp_value=7.0,
                      glu_linear_offset=1.0, add_bias_linear=True) if gpt_oss else \
        dict(activation="swiglu", add_bias_linear=False)
    return TransformerConfig(
        num_layers=num_layers, hidden_size=HIDDEN, num_attention_heads=2,
        normalization="RMSNorm", hidden_dropout=0.0,
        attention_dropout=0.0, ffn_hidden_size=24, tensor_model_parallel_size=tp,
        sequence_parallel=tp > 1, expert_model_parallel_size=ep,
        expert_tensor_parallel_size=etp, moe=MoEConfig(**{**base, **moe}), **activation)


CASES = [dict(), dict(moe_grouped_gemm=True),
         dict(moe_aux_loss_coeff=0.01, moe_z_loss_coeff=0.001),
         dict(moe_router_load_balancing_type="seq_aux_loss", moe_aux_loss_coeff=0.01),
         dict(moe_router_pre_softmax=True, moe_router_topk_norm=True),
         dict(moe_router_score_function="sigmoid"),
         dict(moe_shared_expert_intermediate_size=12),
         dict(moe_shared_expert_intermediate_size=12, moe_shared_expert_gate=True),
         dict(moe_expert_capacity_factor=0.5),
         dict(moe_expert_capacity_factor=0.5, moe_pad_expert_input_to_capacity=True,
              moe_grouped_gemm=True),
         dict(gpt_oss=True), dict(gpt_oss=True, moe_grouped_gemm=True),
         dict(gpt_oss=True, moe_grouped_gemm=True, moe_shared_expert_intermediate_size=12)]


def _saved_by_moe_layer(config):
    torch.manual_seed(0)
    layer = MoELayer(config)
    x = torch.randn(SEQ, MBS, HIDDEN, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out, aux = layer.forward_with_aux(x)
    (out.square().sum() + sum(aux.get(n, 0) for n in ("aux_loss", "z_loss"))).backward()
    return _unique_bytes(saved, exclude=_ptrs(layer.parameters())), aux


def _measure_moe_layer(moe):
    measured, aux = _saved_by_moe_layer(_config(**moe))
    return measured, aux["num_dropped"]


@pytest.mark.parametrize("moe", CASES, ids=lambda c: ",".join(c) or "default")
def test_moe_layer_activations_equal_saved_bytes(moe):
    config = _config(**moe)
    # one process with its groups: the shared expert is a tensor-parallel MLP
    measured, dropped = run_distributed(_measure_moe_layer, 1, tp=1, moe=moe)[0]
    tokens = SEQ * MBS
    if config.moe.moe_expert_capacity_factor is not None:
        assert dropped == tokens  # capacity 0.5: half of the k T = 2 T choices
    assert measured == sum(moe_layer_terms(config, tokens, 4, MBS).values())


def test_layer_terms_swap_the_mlp_for_the_moe_terms():
    config = _config(moe_grouped_gemm=True)
    setup = ActivationSetup(SEQ, MBS, 4, 64, device="cpu")
    dense, moe = layer_terms(config, setup), layer_terms(config, setup, moe=True)
    assert "MLP intermediate" in dense and "MLP intermediate" not in moe
    attention = {k: v for k, v in dense.items() if not k.startswith("MLP")}
    mlp = moe_layer_terms(config, SEQ * MBS, 4, MBS)
    assert sum(moe.values()) == sum(attention.values()) + sum(mlp.values())


@pytest.mark.parametrize("ep,etp", [(1, 1), (2, 1), (4, 1), (2, 2)])
def test_moe_params_per_rank_equal_a_built_layer(ep, etp):
    config = _config(tp=etp, ep=ep, etp=etp, moe_shared_expert_intermediate_size=12,
                     moe_shared_expert_gate=True)
    moe, h = config.moe, HIDDEN
    experts = SwiGLUExperts(moe.num_moe_experts // ep, h, moe.moe_ffn_hidden_size // etp)
    shapes = {s.name.split("mlp.")[1]: s.numel for s in moe_mlp_params(config, "x.mlp.")}
    assert shapes["experts.weight1"] == experts.weight1.numel()
    assert shapes["experts.weight2"] == experts.weight2.numel()
    assert shapes["router.weight"] == moe.num_moe_experts * h
    shared = 12 // etp  # the shared expert splits over TP (= ETP here) like a dense MLP
    assert shapes["shared_experts.linear_fc1.weight"] == 2 * shared * h
    assert shapes["shared_experts.linear_fc2.weight"] == h * shared
    assert shapes["shared_experts.gate_weight"] == h


def _real_params(config):
    return {name: p.numel() for name, p in MoELayer(config).named_parameters()}


@pytest.mark.parametrize("gpt_oss", [False, True])
def test_moe_layer_params_at_ep1_equal_the_real_layer(gpt_oss):
    config = _config(moe_shared_expert_intermediate_size=12, moe_shared_expert_gate=True,
                     gpt_oss=gpt_oss)
    real = run_distributed(_real_params, 1, tp=1, config=config)[0]
    estimated = {s.name.split("mlp.")[1]: s.numel for s in moe_mlp_params(config, "x.mlp.")}
    assert estimated == real
    assert gpt_oss == all(name in real for name in (
        "router.bias", "experts.bias1", "experts.bias2", "shared_experts.linear_fc1.bias",
        "shared_experts.linear_fc2.bias"))


def test_moe_layer_freq_picks_which_layers_have_experts():
    config = _config(num_layers=4, moe_layer_freq=2)
    names = [s.name for s in chunk_param_shapes(config, 64, 0)]
    assert any(n.startswith("decoder.layers.0.mlp.experts") for n in names)
    assert any(n.startswith("decoder.layers.1.mlp.linear_fc1") for n in names)
    assert any(n.startswith("decoder.layers.2.mlp.router") for n in names)
    assert not any(n.startswith("decoder.layers.3.mlp.router") for n in names)


@pytest.mark.parametrize("ep", [1, 2, 4])
def test_expert_state_shards_over_expert_data_parallel(ep):
    """fp32 params, Adam, distributed optimizer: 8 + 8/d bytes a parameter with d = DP for
    dense and EDP = DP x TP / (ETP x EP) for experts (no padding: sizes divide)."""
    dp = 8
    config = _config(ep=ep)
    setup = OptimizerSetup(data_parallel_size=dp, use_distributed_optimizer=True)
    state = rank_state_bytes(config, 64, setup, 0, 4)
    shapes = chunk_param_shapes(config, 64, 0)
    dense = sum(s.numel for s in shapes if not is_expert_param(s))
    expert = sum(s.numel for s in shapes if is_expert_param(s))
    edp = expert_data_parallel_size(config, dp)
    assert edp == dp // ep
    assert state.params + state.grads == 8 * (dense + expert)
    assert state.optimizer_states == 8 * dense // dp + 8 * expert // edp


def test_dispatch_buffers():
    tokens, e = 12, 4
    assert dispatch_buffer_bytes(_config(), tokens, e) == 0
    alltoall = _config(ep=2)
    assert dispatch_buffer_bytes(alltoall, tokens, e) == 2 * 2 * tokens * HIDDEN * e
    allgather = _config(ep=2, moe_token_dispatcher_type="allgather")
    assert dispatch_buffer_bytes(allgather, tokens, e) == 2 * 2 * tokens * HIDDEN * e


# --- whole models: a real step's tensors against the estimate ----------------------------------

def _llama_moe(**extra):
    return llama_config(num_layers=4, hidden_size=HIDDEN, num_attention_heads=4,
                        num_query_groups=2, ffn_hidden_size=24, max_position_embeddings=SEQ,
                        moe=MoEConfig(num_moe_experts=4, moe_ffn_hidden_size=8,
                                      moe_router_topk=2, moe_layer_freq=2,
                                      moe_grouped_gemm=True), **extra)


def _model_saved_bytes():
    config = _llama_moe()
    model_parallel_manual_seed(7)
    model = LlamaModel(config, VOCAB)
    tokens = torch.randint(0, VOCAB, (MBS, SEQ), generator=torch.Generator().manual_seed(5))
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        loss = model(tokens, labels=tokens).mean()
    loss.backward()
    measured = _unique_bytes(saved, exclude=_ptrs(model.parameters()))
    return measured, chunk_bytes(config, ActivationSetup(SEQ, MBS, 4, VOCAB, device="cpu"), 0)


def test_whole_model_activations_equal_saved_bytes():
    """Layers 0 and 2 MoE, 1 and 3 dense (moe_layer_freq 2), one process."""
    measured, estimate = run_distributed(_model_saved_bytes, 1, tp=1)[0]
    assert measured == estimate


def _context_parallel_forward_step(data_iterator, model):
    tokens, labels = (t[:, :4].contiguous() for t in next(data_iterator))  # 2 x CP chunks
    positions = torch.arange(4).expand_as(tokens)
    tokens, labels, positions = shard_for_context_parallel(tokens, labels, positions)
    per_token_loss = model(tokens, position_ids=positions, labels=labels)
    return per_token_loss, lambda out: (out.mean(), {"lm loss": out.mean().detach()})


def _state_after_a_step(ep, distributed, context_parallel=1, fsdp2=False):
    cp = context_parallel  # not "cp": run_distributed would initialise the groups itself
    ps.initialize_model_parallel(1, 1, context_parallel_size=cp,
                                 expert_model_parallel_size=ep)
    try:
        config = _llama_moe(expert_model_parallel_size=ep, context_parallel_size=cp)
        ddp = TorchFSDP2Config() if fsdp2 else \
            DistributedDataParallelConfig(use_distributed_optimizer=distributed)
        model = build_model(lambda **stage: LlamaModel(config, VOCAB, **stage), config, ddp, 42)
        optimizer = get_megatron_optimizer(OptimizerConfig(
            lr=1e-3, use_distributed_optimizer=distributed), model)
        g = torch.Generator().manual_seed(3)
        batch = [(torch.randint(0, VOCAB, (MBS, SEQ), generator=g),
                  torch.randint(0, VOCAB, (MBS, SEQ), generator=g)) for _ in range(2)]
        step = _forward_step if cp == 1 else _context_parallel_forward_step
        _, skipped, _, _ = train_step(step, iter(batch), model, optimizer, None, 2, SEQ, MBS)
        assert not skipped
        # the estimate's DP size is DP x CP (estimate.optimizer_setup_from)
        setup = OptimizerSetup(data_parallel_size=ps.get_data_parallel_world_size(
            with_context_parallel=True), use_distributed_optimizer=distributed, fsdp2=fsdp2)
        estimate = rank_state_bytes(config, VOCAB, setup, 0, 4, ps.get_data_parallel_rank(
            with_context_parallel=True), share_embeddings_and_output_weights=False)
        if fsdp2:  # no DDP buffers: each DTensor's local shard and its gradient
            params = list(model[0].module.parameters())
            measured = _fsdp2_measured(params, [p.grad for p in params], optimizer)
        else:
            measured = _measured_state(model, optimizer)
        return dataclasses.asdict(measured), dataclasses.asdict(estimate)
    finally:
        ps.destroy_model_parallel()


@pytest.mark.parametrize("ep,distributed,cp,fsdp2", [
    (2, True, 1, False), (4, False, 1, False), (2, True, 2, False),
    (2, False, 1, True), (2, False, 2, True)])  # FSDP2: experts sharded over expert-DP
def test_whole_model_state_equals_a_real_step(ep, distributed, cp, fsdp2):
    """4 ranks: dense state over DP x CP 4, experts over expert-DP 4 / EP (CP ranks hold
    the same weights: the expert-DP group spans them too), under DDP, the distributed
    optimizer and FSDP2."""
    for rank, (measured, estimate) in enumerate(run_distributed(
            _state_after_a_step, 4, ep=ep, distributed=distributed, context_parallel=cp,
            fsdp2=fsdp2)):
        assert measured == estimate, f"rank {rank}"


def test_report_shows_the_dispatch_buffers():
    config = _llama_moe(expert_model_parallel_size=2)
    estimate = estimate_memory(config, padded_vocab_size=VOCAB, seq_length=SEQ,
                               micro_batch_size=MBS, num_microbatches=1,
                               setup=OptimizerSetup(data_parallel_size=2), device="cpu")
    dispatch = dispatch_buffer_bytes(config, SEQ * MBS, 4)
    assert estimate.stages[0].activations.moe_dispatch_bytes == dispatch > 0
    assert "moe dispatch buffers" in format_report(estimate)
