"""Gradient-accumulation fusion: the weight-gradient GEMM accumulates into DDP's main_grad.

Reference: the same training run with --no-gradient-accumulation-fusion (the weight gradient
computed on its own and added by DDP's hook). On CPU the fused layer computes the product and
adds it to main_grad itself (the unfused arithmetic): bitwise equal in every case. The GEMM
that accumulates in place (beta = 1, what CUDA runs; forced here with ACCUMULATE_IN_GEMM):
with one microbatch per step main_grad starts at zero, and addmm_ into zeros is the same
k-blocked GEMM as mm, so bitwise equal; with several microbatches it rounds the running sum
once per k-block (((G + p1) + p2) instead of G + (p1 + p2)): a few ulps of the accumulated
gradient per microbatch, which AdamW turns into parameter differences far below FUSION_TOL.
"""
import contextlib

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from megatron.core.distributed import (
    DistributedDataParallel,
    DistributedDataParallelConfig,
    finalize_model_grads,
)
from megatron.core.models import LlamaModel, llama_config
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.tensor_parallel import layers
from tests.distributed import run_distributed

# 24 tokens per microbatch: no weight dimension (32, 48, 64, 96) equals it, so a weight-shaped
# GEMM output can only be a weight gradient.
VOCAB, SEQ, MBS, STEPS = 64, 8, 3, 3
FUSION_TOL = 1e-6  # max |param difference| after STEPS AdamW steps (lr 1e-3), see above
# The first step's accumulated main_grad, in-GEMM vs unfused: a few fp32 ulps per element
# (relative 1e-5 is ~80 ulps), plus an absolute floor for elements that cancel to ~0.
GRAD_RTOL, GRAD_ATOL = 1e-5, 1e-8
ADAM = dict(lr=1e-3, weight_decay=0.1, adam_beta1=0.9, adam_beta2=0.95, adam_eps=1e-8)


def _config(tp, sequence_parallel, fusion):
    return llama_config(num_layers=2, hidden_size=32, num_attention_heads=8,
                        num_query_groups=4, ffn_hidden_size=48, max_position_embeddings=SEQ,
                        tensor_model_parallel_size=tp, sequence_parallel=sequence_parallel,
                        gradient_accumulation_fusion=fusion)


def _batches(num_microbatches):
    g = torch.Generator().manual_seed(3)
    return [[(torch.randint(0, VOCAB, (MBS, SEQ), generator=g),
              torch.randint(0, VOCAB, (MBS, SEQ), generator=g))
             for _ in range(num_microbatches)] for _ in range(STEPS)]


def _forward_step(data_iterator, model):
    tokens, labels = next(data_iterator)

    def loss_func(per_token_loss):
        loss = per_token_loss.mean()
        return loss, {"lm loss": loss.detach()}
    return model(tokens, labels=labels), loss_func


@contextlib.contextmanager
def _accumulate_in_gemm(value):
    layers.ACCUMULATE_IN_GEMM = value
    try:
        yield
    finally:
        layers.ACCUMULATE_IN_GEMM = None


def _train(fusion, sequence_parallel, num_microbatches, overlap, in_gemm=None):
    with _accumulate_in_gemm(in_gemm):
        return _train_steps(fusion, sequence_parallel, num_microbatches, overlap)


def _train_steps(fusion, sequence_parallel, num_microbatches, overlap):
    from megatron.core import parallel_state as ps
    config = _config(ps.get_tensor_model_parallel_world_size(), sequence_parallel, fusion)
    torch.manual_seed(42)
    model = DistributedDataParallel(
        config, DistributedDataParallelConfig(overlap_grad_reduce=overlap, bucket_size=2000),
        LlamaModel(config, VOCAB))
    config.finalize_model_grads_func = finalize_model_grads
    optimizer = get_megatron_optimizer(OptimizerConfig(**ADAM), [model])
    losses, hooks_ran, first_grads = [], [], None
    for batch in _batches(num_microbatches):
        model.zero_grad_buffer()
        optimizer.zero_grad()
        out = get_forward_backward_func()(
            forward_step_func=_forward_step, data_iterator=iter(batch), model=[model],
            num_microbatches=num_microbatches, seq_length=SEQ, micro_batch_size=MBS)
        # DDP's hook ran for every parameter (it clears the fused weights' marker and .grad).
        hooks_ran.append(all(p.grad is None and not getattr(p, "grad_added_to_main_grad", False)
                             for p in model.module.parameters()))
        losses.append(torch.stack([o["lm loss"] for o in out]))
        if first_grads is None:  # the accumulated gradients, before Adam normalises them
            first_grads = {n: p.main_grad.clone() for n, p in model.module.named_parameters()}
        ok, _, _ = optimizer.step()
        assert ok
    params = {n: p.detach().clone() for n, p in model.module.named_parameters()}
    return torch.stack(losses), params, hooks_ran, first_grads


@pytest.mark.parametrize("in_gemm", [None, True], ids=["cpu_default", "in_gemm"])
@pytest.mark.parametrize("sequence_parallel,num_microbatches,overlap",
                         [(False, 1, False), (True, 1, True), (False, 3, True), (True, 3, False)])
def test_fused_training_equals_unfused(sequence_parallel, num_microbatches, overlap, in_gemm):
    kwargs = dict(world_size=2, tp=2, sequence_parallel=sequence_parallel,
                  num_microbatches=num_microbatches, overlap=overlap)
    fused = run_distributed(_train, fusion=True, in_gemm=in_gemm, **kwargs)
    unfused = run_distributed(_train, fusion=False, **kwargs)
    for (f_loss, f_params, f_hooks, f_grads), (u_loss, u_params, _, u_grads) in zip(fused,
                                                                                  unfused):
        assert all(f_hooks)
        if num_microbatches == 1 or in_gemm is None:  # the unfused arithmetic: bitwise
            assert torch.equal(f_loss, u_loss)
            for name, value in u_params.items():
                assert torch.equal(f_params[name], value), name
                assert torch.equal(f_grads[name], u_grads[name]), name
        else:
            assert torch.equal(f_loss[0], u_loss[0])  # the first step's forward is the same
            # Adam cancels a constant scale of a gradient: compare the accumulated gradients
            # themselves, element by element (k-block rounding: a few ulps of each).
            for name, value in u_grads.items():
                torch.testing.assert_close(f_grads[name], value, rtol=GRAD_RTOL, atol=GRAD_ATOL,
                                           msg=name)
            torch.testing.assert_close(f_loss, u_loss, rtol=0, atol=FUSION_TOL)
            for name, value in u_params.items():
                torch.testing.assert_close(f_params[name], value, rtol=0, atol=FUSION_TOL,
                                           msg=name)


class _RecordWeightGradients(TorchDispatchMode):
    """Records GEMM outputs of a linear weight's shape, and adds into the weights' main_grad."""

    def __init__(self, weights):
        super().__init__()
        self.shapes = {tuple(w.shape) for w in weights}
        self.main_grads = {w.main_grad.data_ptr() for w in weights}
        self.weight_sized_gemms, self.main_grad_adds, self.fused = [], [], 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if name in ("mm", "addmm", "matmul", "bmm") and tuple(out.shape) in self.shapes:
            self.weight_sized_gemms.append(name)
        if name == "add_" and args[0].data_ptr() in self.main_grads:
            self.main_grad_adds.append(tuple(args[0].shape))
        if name == "addmm_" and args[0].data_ptr() in self.main_grads:
            self.fused += 1
        return out


def _backward_ops(fusion):
    with _accumulate_in_gemm(True):
        return _backward_ops_run(fusion)


def _backward_ops_run(fusion):
    config = _config(1, False, fusion)
    torch.manual_seed(42)
    model = DistributedDataParallel(config, DistributedDataParallelConfig(),
                                    LlamaModel(config, VOCAB))
    names = [n for n, m in model.module.named_modules()
             if isinstance(m, (ColumnParallelLinear, RowParallelLinear))]
    weights = [model.module.get_submodule(n).weight for n in names]
    tokens = torch.randint(0, VOCAB, (MBS, SEQ))
    loss = model(tokens, labels=tokens).mean()
    with _RecordWeightGradients(weights) as record:
        loss.backward()
    assert all(w.grad is None and not getattr(w, "grad_added_to_main_grad", False)
               for w in weights)
    return record, len(weights), {n: w.main_grad.clone() for n, w in zip(names, weights)}


def test_fused_backward_makes_no_weight_gradient_tensor():
    """With fusion accumulating in the GEMM (CUDA's path), no GEMM produces a weight-shaped
    gradient and DDP's hook adds nothing into the linear weights' main_grad: one addmm_ per
    weight writes it (before fusion: an mm per weight, then the hook's add_)."""
    fused, n, fused_grads = run_distributed(_backward_ops, world_size=1, tp=1, fusion=True)[0]
    assert fused.weight_sized_gemms == [] and fused.main_grad_adds == []
    assert fused.fused == n
    unfused, _, unfused_grads = run_distributed(_backward_ops, world_size=1, tp=1,
                                                fusion=False)[0]
    assert len(unfused.weight_sized_gemms) == n and len(unfused.main_grad_adds) == n
    for key, grad in unfused_grads.items():  # into a zero buffer: bitwise the same
        assert torch.equal(fused_grads[key], grad)
