"""Split backward (B now, W at ``store.flush()``) against the whole backward of the same inputs.

B and W run the whole backward's kernels on the same tensors, and W delivers its gradient
through the same autograd accumulation, so every comparison is bitwise (torch.equal): the
input gradient from B alone, the weight gradient after the flush, DDP's main_grad buffers, and
every parameter of a LlamaModel chunk.
"""
import pytest
import torch

from megatron.core import parallel_state as ps
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.model_parallel_config import ModelParallelConfig
from megatron.core.models import GPTModel, LlamaModel, llama_config
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
    """A post-accumulate hook: how often autograd delivered a gradient to each param. (Autograd
    also runs these hooks with .grad None where a backward returned None for the leaf: B of a
    deferred weight. Those visits are counted apart, in calls["empty"].)"""
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


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("kind", ["column", "row"])
@pytest.mark.parametrize("tp,sequence_parallel", [(1, False), (2, False), (2, True)])
def test_linear_split_equals_whole_backward(kind, tp, sequence_parallel, bias):
    assert all(run_distributed(_layer_case, world_size=tp, tp=tp, kind=kind,
                               sequence_parallel=sequence_parallel, bias=bias))


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
