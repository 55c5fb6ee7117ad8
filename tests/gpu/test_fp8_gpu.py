"""FP8 on CUDA: each recipe's three GEMMs in a column- and a row-parallel linear (bf16
activations, cuBLAS's FP8 kernels) against the fp64 product of the same dequantized operands
(tests/unit/test_fp8_linear.py's reference), at TP 1 and, over two ranks on the one GPU, TP 2
with sequence parallelism; a whole bf16 training step with FP8 GEMMs stays near the bf16
step from the same weights; and --fp8-param-gather trains bitwise like the plain gather."""
import pytest
import torch

from tests.gpu.harness import run_on_gpu

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

S, B, H, F = 256, 2, 256, 512  # multiples of 16 (cuBLAS) and of 128 per TP rank (blockwise)
# bf16 outputs: one rounding of an fp32 result, 2^-9 relative, and TP's bf16 sums: 2^-7 of
# the largest value.
TOL = 2.0 ** -7


def _layers_on_cuda(recipe, fmt, sequence_parallel):
    from megatron.core import device
    from megatron.core import parallel_state as ps
    from megatron.core.fp8 import Fp8Config
    from megatron.core.fp8.linear import Fp8Gemms
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer import TransformerConfig
    from megatron.core.utils import init_method_normal
    from tests.unit.test_fp8_linear import ReferenceGemms

    dev = device.current_device()
    tp = ps.get_tensor_model_parallel_world_size()
    fp8 = Fp8Config(format=fmt, recipe=recipe)
    config = TransformerConfig(num_layers=1, hidden_size=H, num_attention_heads=4,
                               tensor_model_parallel_size=tp, params_dtype=torch.bfloat16,
                               sequence_parallel=sequence_parallel)
    errors = {}
    for kind, cls, (k, n) in (("column", ColumnParallelLinear, (H, F)),
                              ("row", RowParallelLinear, (F, H))):
        torch.manual_seed(3)
        layer = cls(k, n, config=config, bias=False, init_method=init_method_normal(0.02))
        s_in = S // tp if (sequence_parallel and kind == "column") else S
        k_local = k // tp if kind == "row" else k
        g = torch.Generator(device=dev).manual_seed(11 + ps.get_tensor_model_parallel_rank())
        x = torch.randn(s_in, B, k_local, device=dev, generator=g).bfloat16()
        runs = []
        for gemms in (Fp8Gemms(fp8), ReferenceGemms(fp8)):
            layer.fp8, layer.weight.grad = gemms, None
            xi = x.clone().requires_grad_()
            y, _ = layer(xi)
            seed = torch.ones_like(y) * torch.linspace(-1, 1, y.shape[-1], device=dev,
                                                       dtype=y.dtype)
            y.backward(seed)
            runs.append((y.detach().float(), xi.grad.float(), layer.weight.grad.float()))
        errors[kind] = [((a - b).abs().max() / b.abs().max()).item()
                        for a, b in zip(*runs)]
    return errors


@pytest.mark.parametrize("recipe,fmt", [("tensorwise", "e4m3"), ("tensorwise", "hybrid"),
                                        ("rowwise", "e4m3"), ("rowwise", "hybrid"),
                                        ("blockwise", "e4m3")])
@pytest.mark.parametrize("tp", [1, 2])
def test_fp8_linears_on_cuda_equal_the_dequantized_reference(gpu_env, recipe, fmt, tp):
    results = run_on_gpu(_layers_on_cuda, world_size=tp, backend="nccl" if tp == 1 else "gloo",
                         tp=tp, recipe=recipe, fmt=fmt, sequence_parallel=tp > 1)
    for errors in results:
        for kind, (out, dgrad, wgrad) in errors.items():
            assert max(out, dgrad, wgrad) <= TOL, (kind, out, dgrad, wgrad)


@pytest.mark.parametrize("scaling", ["tensorwise", "rowwise", "1x128", "128x128"])
@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2],
                         ids=["e4m3", "e5m2"])
def test_compiled_quantization_is_bitwise_the_eager_one_on_cuda(scaling, dtype):
    """Inductor's Triton kernel for the scale-clamp-cast pass (tests/unit/test_fp8_fused.py
    checks its CPU kernel) writes the bytes eager CUDA writes."""
    from megatron.core.fp8.quantize import quantize

    g = torch.Generator(device="cuda").manual_seed(0)
    x = (torch.randn(1024, 768, device="cuda", generator=g)
         * torch.logspace(-3, 3, 1024, device="cuda")[:, None]).bfloat16()
    x[5] = 0
    for operand in (x, x.t()):
        eager = quantize(operand, dtype, scaling, 1)
        fused = quantize(operand, dtype, scaling, 1, compile=True,
                         transpose=scaling == "tensorwise")
        assert torch.equal(eager.data.view(torch.uint8), fused.data.view(torch.uint8))
        assert torch.equal(eager.scale, fused.scale)
        if scaling == "tensorwise":
            assert torch.equal(fused.transposed.data.view(torch.uint8),
                               eager.data.t().contiguous().view(torch.uint8))


def test_native_blockwise_agrees_on_hopper():
    from megatron.core.fp8.gemm import NATIVE_BLOCKWISE_WHY, native_blockwise

    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("torch's DeepSeek-style block scaling is sm90 only")
    for pair in (("1x128", "128x128"), ("1x128", "1x128")):
        assert native_blockwise("cuda", *pair), NATIVE_BLOCKWISE_WHY[("cuda", *pair)]


def test_grouped_expert_gemm_agrees_on_hopper():
    """torch's grouped FP8 GEMM (the rowwise experts' forward and dgrad) against the same
    GEMMs expert by expert (fp8/grouped.py's probe: an idle expert, unaligned counts)."""
    from megatron.core.fp8.grouped import GROUPED_WHY, grouped_kernel

    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("torch's grouped FP8 GEMM is sm90 only")
    assert grouped_kernel("cuda"), GROUPED_WHY["cuda"]


@pytest.mark.parametrize("recipe", ["tensorwise", "blockwise"])
def test_fp8_param_gather_on_cuda_trains_bitwise_like_the_plain_gather(gpu_env, recipe):
    """--fp8-param-gather on CUDA (bf16 weights, DP 2 on the one GPU, overlapped gathers):
    the FP8 bytes cast from the shards and viewed out of the gathered buffer by cuBLAS's
    GEMMs, bitwise what the layers quantize from the gathered bf16 weights
    (tests/unit/test_fp8_param_gather.py's run and checks)."""
    from tests.unit.test_fp8_param_gather import _train

    runs = [run_on_gpu(_train, world_size=2, fp8_gather=gather, overlap=gather,
                       dtype=torch.bfloat16, recipe=recipe, tp=1) for gather in (False, True)]
    for want, got in zip(*runs, strict=True):
        assert got["losses"] == want["losses"]
        assert all(torch.equal(got["params"][n], v) for n, v in want["params"].items())
        assert got["checks"] and all(all(check) for check in got["checks"])
        assert got["log"]["fp8"] and {d for d, _ in got["log"]["fp8"]} == {torch.uint8}
