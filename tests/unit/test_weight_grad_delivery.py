"""The W step delivers each deferred weight gradient without autograd's engine: no
``torch.autograd.backward`` call (a spy counts them), and the gradients (``.grad``, DDP's
``main_grad`` with and without gradient-accumulation fusion, ZeRO-2's shards) and the
post-accumulate-hook calls are bitwise those of the old delivery,
``torch.autograd.backward(param, grad)`` per weight."""
import contextlib

import pytest
import torch

from megatron.core import parallel_state as ps
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.model_parallel_config import ModelParallelConfig
from megatron.core.tensor_parallel import WeightGradStore, deferring_weight_grads
from megatron.core.tensor_parallel import weight_grad_store
from tests.distributed import run_distributed
from tests.unit.test_weight_grad_store import BATCH, HIDDEN, SEQ, _Block, _count_hook_calls


def _old_deliver(param, grad):
    """The delivery before: autograd's engine, started once per weight."""
    if grad.dtype != param.dtype:
        grad = grad.to(param.dtype)
    torch.autograd.backward(param, grad)


@contextlib.contextmanager
def _counting_autograd_backward():
    calls = []
    original = torch.autograd.backward

    def spy(*args, **kwargs):
        calls.append(args)
        return original(*args, **kwargs)
    torch.autograd.backward = spy
    try:
        yield calls
    finally:
        torch.autograd.backward = original


def _split_run(fusion, ddp_config, deliver):
    """Two microbatches, B then W each (DDP syncs on the last W); the gradients, the hook
    calls per weight and the autograd.backward calls made by the W steps."""
    torch.manual_seed(3)
    config = ModelParallelConfig(gradient_accumulation_fusion=fusion)
    block = _Block(config)
    weights = [block.fc1.weight, block.fc2.weight]
    calls = _count_hook_calls(weights)
    model = block if ddp_config is None else DistributedDataParallel(config, ddp_config, block)
    torch.manual_seed(10 + ps.get_data_parallel_rank())
    batches = [(torch.randn(SEQ, BATCH, HIDDEN), torch.randn(SEQ, BATCH, HIDDEN))
               for _ in range(2)]
    if ddp_config is not None:
        model.zero_grad_buffer()
    w_backward_calls = 0
    original_deliver, weight_grad_store._deliver = weight_grad_store._deliver, deliver
    try:
        for mb, (x, dy) in enumerate(batches):
            last = mb == len(batches) - 1
            no_sync = model.no_sync() if ddp_config is not None and not last else \
                contextlib.nullcontext()
            with no_sync:
                store = WeightGradStore()
                with deferring_weight_grads(store):
                    model(x).backward(dy)
                with _counting_autograd_backward() as during_w:
                    store.flush()
                w_backward_calls += len(during_w)
    finally:
        weight_grad_store._deliver = original_deliver
    if ddp_config is None:
        grads = {n: p.grad.clone() for n, p in block.named_parameters()}
    else:
        model.finish_grad_sync()
        field = "main_grad_shard" if ddp_config.shard_gradients else "main_grad"
        grads = {n: getattr(p, field).clone() for n, p in block.named_parameters()}
    return grads, [calls[w] for w in weights], w_backward_calls


def _delivery_cases(fusion, ddp_config):
    new, new_calls, new_backwards = _split_run(fusion, ddp_config, weight_grad_store._deliver)
    old, old_calls, old_backwards = _split_run(fusion, ddp_config, _old_deliver)
    assert old_backwards == 4  # the spy sees the old path: 2 weights x 2 microbatches
    assert new_backwards == 0
    assert new_calls == old_calls, (new_calls, old_calls)  # the hooks ran as often
    if ddp_config is not None:  # DDP takes .grad: the hook sees one gradient per delivery
        assert new_calls == [2, 2]
    assert new.keys() == old.keys()
    for name in old:
        assert torch.equal(new[name], old[name]), name
    return True


_OVERLAP = DistributedDataParallelConfig(overlap_grad_reduce=True, bucket_size=200)
_ZERO2 = DistributedDataParallelConfig(use_distributed_optimizer=True, shard_gradients=True,
                                       overlap_grad_reduce=True, bucket_size=200)


@pytest.mark.parametrize("fusion,ddp_config", [
    (False, None),  # .grad only (fusion needs DDP's main_grad)
    (False, _OVERLAP), (True, _OVERLAP), (False, _ZERO2), (True, _ZERO2),
], ids=["no-ddp", "overlap", "overlap-fusion", "zero2", "zero2-fusion"])
def test_w_step_calls_no_autograd_backward_and_equals_the_old_delivery(fusion, ddp_config):
    world = 1 if ddp_config is None else 2
    assert all(run_distributed(_delivery_cases, world_size=world, tp=1, fusion=fusion,
                               ddp_config=ddp_config))


def _layout_and_tensor_hooks():
    """A first gradient in another layout takes the parameter's strides (as AccumulateGrad
    does); a parameter with a tensor hook goes through autograd, which runs the hook."""
    param = torch.nn.Parameter(torch.randn(4, 3))
    grad = torch.randn(3, 4).t()  # the right shape, transposed strides
    weight_grad_store._deliver(param, grad)
    assert param.grad.stride() == param.stride() and torch.equal(param.grad, grad)
    weight_grad_store._deliver(param, grad)  # then an in-place add
    assert torch.equal(param.grad, grad + grad)
    hooked = torch.nn.Parameter(torch.randn(4, 3))
    hooked.register_hook(lambda g: g * 2)
    with _counting_autograd_backward() as calls:
        weight_grad_store._deliver(hooked, grad)
    assert len(calls) == 1 and torch.equal(hooked.grad, grad * 2)
    return True


def test_first_gradient_layout_and_tensor_hooks_as_autograd():
    assert _layout_and_tensor_hooks()
