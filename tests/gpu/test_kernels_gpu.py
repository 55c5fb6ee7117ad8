"""Kernels and fusion on CUDA: gradient-accumulation fusion in bf16 (one GEMM with an fp32
output into DDP's fp32 main_grad), the vectorized cross entropy, the fused (compiled) cross
entropy's memory, --torch-compile."""
import pytest
import torch

from tests.gpu.harness import run_on_gpu

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

VOCAB, SEQ, MBS, MICROBATCHES = 256, 64, 2, 3


def _bf16_model(fusion, torch_compile=False):
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models import LlamaModel, llama_config

    config = llama_config(num_layers=2, hidden_size=128, num_attention_heads=4,
                          num_query_groups=2, ffn_hidden_size=256, max_position_embeddings=SEQ,
                          params_dtype=torch.bfloat16, gradient_accumulation_fusion=fusion,
                          torch_compile=torch_compile)
    torch.manual_seed(42)
    return DistributedDataParallel(config, DistributedDataParallelConfig(grad_reduce_in_fp32=True),
                                   LlamaModel(config, VOCAB))


def _main_grads(fusion):
    from megatron.core import device
    from megatron.core.tensor_parallel.layers import _fp32_accumulate_from_half_supported

    model = _bf16_model(fusion)
    g = torch.Generator().manual_seed(3)
    for _ in range(MICROBATCHES):
        tokens = torch.randint(0, VOCAB, (MBS, SEQ), generator=g).to(device.current_device())
        model(tokens, labels=tokens).float().mean().backward()
    grads = {n: p.main_grad.float().cpu() for n, p in model.module.named_parameters()}
    return grads, _fp32_accumulate_from_half_supported(device.current_device())


def test_gradient_accumulation_fusion_bf16_matches_unfused(gpu_env):
    """Fused: one bf16 x bf16 -> fp32 GEMM adds each microbatch's weight gradient to the fp32
    main_grad. Unfused: the gradient is rounded to bf16 (2^-9 relative), then added. Over
    MICROBATCHES microbatches they differ by at most that rounding each time."""
    (fused, supported), = run_on_gpu(_main_grads, world_size=1, backend="nccl", tp=1,
                                      fusion=True)
    (unfused, _), = run_on_gpu(_main_grads, world_size=1, backend="nccl", tp=1, fusion=False)
    assert supported, "torch on this GPU has no fp32-output bf16 GEMM (aten::addmm.dtype_out)"
    for name, want in unfused.items():
        bound = MICROBATCHES * 2.0 ** -8 * want.abs().max().item()
        torch.testing.assert_close(fused[name], want, rtol=0, atol=bound, msg=name)


def _cross_entropy_paths():
    from megatron.core import device
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    g = torch.Generator().manual_seed(5)
    logits = torch.randn(1024, 4, 4000, generator=g).to(device.current_device())
    target = torch.randint(0, 4000, (1024, 4), generator=g).to(device.current_device())
    out = []
    for vectorized in (False, True):
        x = logits.clone().requires_grad_()
        loss = vocab_parallel_cross_entropy(x * 1.0, target, 0.1, inplace=True,
                                            vectorized=vectorized)
        loss.sum().backward()
        out.append((loss.detach().cpu(), x.grad.cpu()))
    return out


def _fused_cross_entropy():
    """bf16 logits [1024 x 4, 32000] (a 1.1B LLaMA's microbatch of 4 x 1024 tokens): loss and
    gradient of the fused path against the unfused one (its fp32 copy), and the bytes each
    allocates beyond its input during forward and backward."""
    from megatron.core import device
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    g = torch.Generator().manual_seed(6)
    dev = device.current_device()
    logits = (torch.randn(1024, 4, 32000, generator=g) * 2).to(dev, torch.bfloat16)
    target = torch.randint(0, 32000, (1024, 4), generator=g).to(dev)
    out = {}
    for fused in (False, True, True):  # the second fused run: compiled already
        x = logits.clone().requires_grad_()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        loss = vocab_parallel_cross_entropy(x, target, inplace=True, fused=fused)
        loss.float().mean().backward()
        torch.cuda.synchronize()
        out[fused] = (loss.detach().cpu(), x.grad.float().cpu(),
                      torch.cuda.max_memory_allocated() - base)
    return out, logits.numel()


def test_fused_cross_entropy_needs_no_fp32_logits(gpu_env):
    """The fused path never holds the logits in fp32: beyond its bf16 input it allocates less
    than one fp32 copy (the unfused path allocates that copy and more). Both do fp32
    arithmetic on the same bf16 values: the loss within 1e-5 relative (other summation order),
    the bf16 gradient within one bf16 step (2^-8) of its largest value."""
    (out, numel), = run_on_gpu(_fused_cross_entropy, world_size=1, backend="nccl", tp=1)
    (loss_u, grad_u, bytes_u), (loss_f, grad_f, bytes_f) = out[False], out[True]
    fp32_logits = numel * 4
    assert bytes_u >= fp32_logits, bytes_u
    assert bytes_f < fp32_logits, (bytes_f, fp32_logits)
    torch.testing.assert_close(loss_f, loss_u, rtol=1e-5, atol=0)
    torch.testing.assert_close(grad_f, grad_u, rtol=0, atol=2.0 ** -8 * grad_u.abs().max().item())


def test_vectorized_cross_entropy_equals_chunked(gpu_env):
    """The same ops over all rows at once; a CUDA row reduction may split a row differently
    with another row count, hence fp32 rounding (1e-6 relative) rather than bitwise."""
    ((loss_c, grad_c), (loss_v, grad_v)), = run_on_gpu(_cross_entropy_paths, world_size=1,
                                                       backend="nccl", tp=1)
    torch.testing.assert_close(loss_v, loss_c, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(grad_v, grad_c, rtol=1e-6, atol=1e-9)


def _compiled_step(torch_compile):
    from megatron.core import device

    model = _bf16_model(True, torch_compile=torch_compile)
    tokens = torch.randint(0, VOCAB, (MBS, SEQ), generator=torch.Generator().manual_seed(7))
    tokens = tokens.to(device.current_device())
    loss = model(tokens, labels=tokens).float().mean()
    loss.backward()
    return loss.item(), {n: p.main_grad.float().cpu() for n, p in model.module.named_parameters()}


def test_torch_compile_runs_a_step(gpu_env):
    """bf16: compiled element-wise regions round differently from eager ones (bf16 results of
    fp32 math, a few 3.9e-3 roundings): the loss within 1e-2 relative, and every weight's
    gradient (not only their global norm) within 3e-2 of its largest eager value."""
    (eager_loss, eager_grads), = run_on_gpu(_compiled_step, world_size=1, backend="nccl",
                                            tp=1, torch_compile=False)
    (loss, grads), = run_on_gpu(_compiled_step, world_size=1, backend="nccl", tp=1,
                                torch_compile=True)
    assert loss == pytest.approx(eager_loss, rel=1e-2)
    assert grads.keys() == eager_grads.keys()
    for name, want in eager_grads.items():
        bound = 3e-2 * want.abs().max().item()
        torch.testing.assert_close(grads[name], want, rtol=0, atol=bound, msg=name)
