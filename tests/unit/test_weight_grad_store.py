"""Split backward (B now, W at ``store.flush()``) against the whole backward of the same inputs.

B and W run the whole backward's kernels on the same tensors, and W delivers its gradient
through the same autograd accumulation, so every comparison is bitwise (torch.equal): the
input gradient from B alone, the weight gradient after the flush, DDP's main_grad buffers, and
every parameter of a LlamaModel chunk.
"""
import contextlib

import pytest
import torch

from megatron.core import parallel_state as ps
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.model_parallel_config import ModelParallelConfig
from megatron.core.models import LlamaModel, llama_config
from megatron.core.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    WeightGradStore,
    current_weight_grad_store,
    deferring_weight_grads,
)
from megatron.core.utils import init_method_normal
from tests.distributed import run_distributed

SEQ, BATCH, HIDDEN, FFN, VOCAB = 8, 2, 12, 16, 64


def _count_hook_calls(params):
    """A post-accumulate hook (register it before DDP's): how often autograd delivered a
    gradient to each param. (Autograd also runs these hooks with .grad None where a backward
    returned None for the leaf: B of a deferred weight. Those are counted in calls["empty"].)"""
    calls = {p: 0 for p in params}
    calls["empty"] = 0

    def hook(p):
        calls[p if p.grad is not None else "empty"] += 1
    for p in params:
        p.register_post_accumulate_grad_hook(hook)
    return calls


# ---------------------------------------------------------------- one layer, TP = 1 and 2

def _layer(kind, sequence_parallel, bias):
    config = ModelParallelConfig(sequence_parallel=sequence_parallel)
    init = init_method_normal(0.2)
    if kind == "column":
        return ColumnParallelLinear(HIDDEN, FFN, config=config, init_method=init, bias=bias)
    return RowParallelLinear(FFN, HIDDEN, config=config, init_method=init, bias=bias)


def _layer_case(kind, sequence_parallel, bias):
    torch.manual_seed(5 + ps.get_tensor_model_parallel_rank())  # different data per TP rank
    tp = ps.get_tensor_model_parallel_world_size()
    sp = sequence_parallel and tp > 1
    layer = _layer(kind, sequence_parallel, bias)
    if kind == "column":
        x_shape = (SEQ // tp if sp else SEQ, BATCH, HIDDEN)
        dy_shape = (SEQ, BATCH, FFN // tp)
        held = [dy_shape, x_shape]  # the output gradient, the input shard as saved
    else:
        x_shape = (SEQ, BATCH, FFN // tp)
        dy_shape = (SEQ // tp if sp else SEQ, BATCH, HIDDEN)
        held = [(SEQ, BATCH, HIDDEN), x_shape]  # the gradient before the reduce-scatter
    x, dy = torch.randn(x_shape), torch.randn(dy_shape)

    def backward(store=None):
        layer.zero_grad(set_to_none=True)
        x_leaf = x.clone().requires_grad_()
        with deferring_weight_grads(store):
            layer(x_leaf)[0].backward(dy)
        return x_leaf

    x_whole = backward()
    whole = {n: p.grad.clone() for n, p in layer.named_parameters()}
    calls = _count_hook_calls([layer.weight])
    store = WeightGradStore()
    x_split = backward(store)
    assert torch.equal(x_split.grad, x_whole.grad)  # B alone: the input gradient
    assert layer.weight.grad is None and calls[layer.weight] == 0
    if bias:  # the bias gradient stays in B
        assert torch.equal(layer.bias.grad, whole["bias"])
    assert store.pending() == 1
    assert store.bytes_held() == sum(torch.Size(s).numel() * 4 for s in held)
    store.flush()
    assert store.pending() == 0 and store.bytes_held() == 0
    assert calls[layer.weight] == 1
    for name, p in layer.named_parameters():
        assert torch.equal(p.grad, whole[name]), name
    return True


def _autocast_case(kind):
    """fp32 weights, forward under bf16 autocast: backward's GEMMs run in bf16 and the weight
    gradient is cast to fp32 on delivery (autograd's cast in a whole backward, ours in W).
    The row layer's output (bias added outside) is bf16, so its backward takes the cast path;
    the column layer adds its fp32 bias inside, so its output gradient is fp32."""
    layer = _layer(kind, False, bias=True)
    x = torch.randn(SEQ, BATCH, HIDDEN if kind == "column" else FFN)

    def backward(store=None):
        layer.zero_grad(set_to_none=True)
        x_leaf = x.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = layer(x_leaf)[0]
        with deferring_weight_grads(store):
            y.float().square().sum().backward()
        return x_leaf.grad

    x_grad = backward()
    whole = {n: p.grad.clone() for n, p in layer.named_parameters()}
    store = WeightGradStore()
    assert torch.equal(backward(store), x_grad)
    store.flush()
    for name, p in layer.named_parameters():
        assert p.grad.dtype == torch.float32 and torch.equal(p.grad, whole[name]), name


def _layer_cases(sequence_parallel):
    for kind in ("column", "row"):
        for bias in (False, True):
            _layer_case(kind, sequence_parallel, bias)
        if ps.get_tensor_model_parallel_world_size() == 1:
            _autocast_case(kind)
    return True


@pytest.mark.parametrize("tp,sequence_parallel", [(1, False), (2, False), (2, True)])
def test_linear_split_equals_whole_backward(tp, sequence_parallel):
    """Column and row parallel, with and without bias (one task per layout: ranks are slow
    to reach)."""
    assert all(run_distributed(_layer_cases, world_size=tp, tp=tp,
                               sequence_parallel=sequence_parallel))


# ---------------------------------------------------------------- the store's context

def test_deferring_context_nests_and_restores_on_exceptions():
    outer, inner = WeightGradStore(), WeightGradStore()
    assert current_weight_grad_store() is None
    with deferring_weight_grads(outer):
        with pytest.raises(ValueError):
            with deferring_weight_grads(inner):
                assert current_weight_grad_store() is inner
                raise ValueError("boom")
        assert current_weight_grad_store() is outer
        with deferring_weight_grads(None):  # a whole backward inside a deferring region
            assert current_weight_grad_store() is None
        assert current_weight_grad_store() is outer
    assert current_weight_grad_store() is None


# ---------------------------------------------------------------- with our DDP, DP = 2

class _Block(torch.nn.Module):
    """column (with bias) -> gelu -> row, then a LayerNorm: deferred weights and whole-B ones."""

    def __init__(self, config):
        super().__init__()
        init = init_method_normal(0.2)
        self.fc1 = ColumnParallelLinear(HIDDEN, FFN, config=config, init_method=init)
        self.fc2 = RowParallelLinear(FFN, HIDDEN, config=config, init_method=init, bias=False)
        self.norm = torch.nn.LayerNorm(HIDDEN)

    def forward(self, x):
        return self.norm(self.fc2(torch.nn.functional.gelu(self.fc1(x)[0]))[0])


def _ddp_run(order, fusion, ddp_config):
    """``order``: None (whole backwards) or steps ("B"/"W", microbatch). DDP is in no_sync for
    every step but the last B and the last W, as the pipeline executor does."""
    torch.manual_seed(3)
    config = ModelParallelConfig(gradient_accumulation_fusion=fusion)
    block = _Block(config)
    weights = [block.fc1.weight, block.fc2.weight]
    calls = _count_hook_calls(weights)  # before DDP's hook, which takes .grad
    model = DistributedDataParallel(config, ddp_config, block)
    torch.manual_seed(10 + ps.get_data_parallel_rank())
    batches = [(torch.randn(SEQ, BATCH, HIDDEN), torch.randn(SEQ, BATCH, HIDDEN))
               for _ in range(2)]
    order = order or [("whole", 0), ("whole", 1)]
    last = {kind: max(i for i, (k, _) in enumerate(order) if k == kind)
            for kind, _ in order}
    stores = [WeightGradStore() for _ in batches]
    model.zero_grad_buffer()
    for i, (kind, mb) in enumerate(order):
        sync = i == last[kind]
        with (contextlib.nullcontext() if sync else model.no_sync()):
            if kind == "W":
                stores[mb].flush()
                continue
            x, dy = batches[mb]
            with deferring_weight_grads(stores[mb] if kind == "B" else None):
                model(x).backward(dy)
    model.finish_grad_sync()
    field = "main_grad_shard" if ddp_config.shard_gradients else "main_grad"
    grads = {n: getattr(p, field).clone() for n, p in model.module.named_parameters()}
    return grads, [calls[w] for w in weights], calls["empty"]


def _ddp_cases(fusion, ddp_config):
    whole, whole_calls, _ = _ddp_run(None, fusion, ddp_config)
    assert whole_calls == [2, 2]
    for order in ([("B", 0), ("B", 1), ("W", 0), ("W", 1)],
                  [("B", 0), ("W", 0), ("B", 1), ("W", 1)]):
        grads, calls, empty_visits = _ddp_run(order, fusion, ddp_config)
        assert calls == [2, 2], (order, calls)  # one delivery per deferred gradient
        assert empty_visits == 4  # B's visits without a gradient, ignored by the guard
        for name, value in whole.items():
            assert torch.equal(grads[name], value), (order, name)
    return True


@pytest.mark.parametrize("fusion", [False, True])
@pytest.mark.parametrize("ddp_config", [
    DistributedDataParallelConfig(overlap_grad_reduce=True, bucket_size=200),
    DistributedDataParallelConfig(use_distributed_optimizer=True, shard_gradients=True,
                                  overlap_grad_reduce=True, bucket_size=200),
], ids=["overlap", "zero2"])
def test_ddp_main_grads_equal_whole_backward(fusion, ddp_config):
    assert all(run_distributed(_ddp_cases, world_size=2, tp=1, fusion=fusion,
                               ddp_config=ddp_config))


def _real_ddp_visit():
    config = ModelParallelConfig()
    model = DistributedDataParallel(config, DistributedDataParallelConfig(), _Block(config))
    store = WeightGradStore()
    with deferring_weight_grads(store):
        model(torch.randn(SEQ, BATCH, HIDDEN)).sum().backward()
    weight = model.module.fc1.weight
    untouched = not weight.main_grad.any().item()  # B left the deferred weight alone
    store.flush()
    return untouched, bool(weight.main_grad.any().item())


def test_ddp_ignores_a_deferred_weight_in_b():
    """Autograd runs the post-accumulate hook of a deferred weight in B with no gradient: DDP
    must ignore that visit (before the guard it added None to main_grad)."""
    assert run_distributed(_real_ddp_visit, world_size=1, tp=1) == [(True, True)]


# ---------------------------------------------------------------- a LlamaModel chunk

def _llama_case(sequence_parallel=False, tied=False, recompute=False):
    tp = ps.get_tensor_model_parallel_world_size()
    extra = dict(recompute_granularity="full", recompute_method="uniform",
                 recompute_num_layers=1) if recompute else {}
    config = llama_config(num_layers=2, hidden_size=32, num_attention_heads=8,
                          num_query_groups=4, ffn_hidden_size=48, max_position_embeddings=SEQ,
                          tensor_model_parallel_size=tp, sequence_parallel=sequence_parallel,
                          **extra)
    torch.manual_seed(42)
    model = LlamaModel(config, VOCAB, share_embeddings_and_output_weights=tied)
    tokens, labels = (torch.randint(0, VOCAB, (BATCH, SEQ)) for _ in range(2))
    linear = {f"{name}.weight" for name, m in model.named_modules()
              if isinstance(m, (ColumnParallelLinear, RowParallelLinear)) and
              m.weight is not None}  # a tied output layer uses the embedding's (in B)

    def backward(store=None):
        model.zero_grad(set_to_none=True)
        with deferring_weight_grads(store):
            model(tokens, labels=labels).mean().backward()

    backward()
    whole = {n: p.grad.clone() for n, p in model.named_parameters()}
    store = WeightGradStore()
    backward(store)
    assert store.pending() == len(linear) > 0
    for name, p in model.named_parameters():
        if name in linear:
            assert p.grad is None, name
        else:  # norms, the embedding (with a tied output layer: both its parts)
            assert torch.equal(p.grad, whole[name]), name
    store.flush()
    for name, p in model.named_parameters():
        assert torch.equal(p.grad, whole[name]), name
    return sorted(linear)


def _llama_cases(cases):
    return [_llama_case(**case) for case in cases]


def test_llama_chunk_split_equals_whole_backward():
    (plain, tied, recompute), = run_distributed(
        _llama_cases, world_size=1, tp=1,
        cases=[{}, {"tied": True}, {"recompute": True}])
    assert "output_layer.weight" in plain and "output_layer.weight" not in tied
    assert recompute == plain


def test_llama_chunk_split_equals_whole_backward_tp2_sp():
    assert all(run_distributed(_llama_cases, world_size=2, tp=2,
                               cases=[{"sequence_parallel": True}]))
