"""Probes of the kernels the CUDA path relies on; one line each: OK or FAIL and why.

    python3 bench/gpu_probes.py            # on the GPU (shtools/gpu_run.sh's first step)
    MEGATRON_DEVICE=cpu python3 bench/gpu_probes.py   # the same probes on CPU (--dry-run)

Each probe compares against a plain fp32 computation where there is one, so an OK means
the kernel runs and gives the right numbers, not only that it exists. The machine's
versions come first.
"""
import inspect
import os
import sys
import traceback

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir))

from megatron.core import device  # noqa: E402

PROBES, RESULTS = [], []


def probe(fn):
    PROBES.append(fn)
    return fn


def run_probe(fn):
    try:
        detail = fn()
        RESULTS.append(("OK", fn.__name__))
        print(f"OK   {fn.__name__}: {detail}", flush=True)
    except Exception as exc:  # a probe's failure is its result
        RESULTS.append(("FAIL", fn.__name__))
        last = traceback.format_exc().strip().splitlines()[-1]
        print(f"FAIL {fn.__name__}: {type(exc).__name__}: {str(exc)[:300]} ({last[:200]})",
              flush=True)


def _dev():
    return device.current_device()


def _half():
    return torch.bfloat16


def _rel(a, b) -> float:
    a, b = a.detach().float(), b.detach().float()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def versions() -> None:
    print(f"python {sys.version.split()[0]} | torch {torch.__version__} | CUDA "
          f"{torch.version.cuda} | device {device.device_type()}")
    if torch.cuda.is_available():
        print(f"nccl {'.'.join(map(str, torch.cuda.nccl.version()))} | cuDNN "
              f"{torch.backends.cudnn.version()} | {torch.cuda.get_device_name()} | capability "
              f"{torch.cuda.get_device_capability()} | memory "
              f"{torch.cuda.get_device_properties(0).total_memory / 2**30:.1f} GiB")
    try:
        import transformers
        print(f"transformers {transformers.__version__}")
    except ImportError as exc:
        print(f"transformers missing: {exc}")
    for name in ("zstandard", "wandb", "triton", "liger_kernel", "torchao",
                 "transformer_engine", "flash_attn"):
        try:
            module = __import__(name)
            print(f"{name} {getattr(module, '__version__', '?')}")
        except Exception as exc:
            print(f"{name}: not importable ({type(exc).__name__})")


@probe
def addmm_fp32_out_from_bf16():
    """What gradient-accumulation fusion calls: main_grad (fp32) += grad^T @ input (bf16).
    CPU has no such kernel: layers.py then adds a separate GEMM's output (not a failure)."""
    from megatron.core.tensor_parallel.layers import _fp32_accumulate_from_half_supported

    if device.device_type() == "cpu" and not _fp32_accumulate_from_half_supported(_dev()):
        return "not on CPU (layers.py falls back to a GEMM and an add)"
    g = torch.Generator().manual_seed(0)
    a = torch.randn(256, 512, generator=g).to(_dev(), _half())
    b = torch.randn(512, 384, generator=g).to(_dev(), _half())
    c = torch.randn(256, 384, generator=g).to(_dev())
    expected = c + a.float() @ b.float()
    torch.ops.aten.addmm.dtype_out(c, a, b, torch.float32, out=c)
    err = _rel(c, expected)
    assert c.dtype == torch.float32 and err < 1e-5, f"relative error {err:.2e}"
    return f"relative error {err:.2e} vs fp32"


@probe
def grouped_mm_with_an_empty_group():
    """The MoE experts' GEMM; one expert gets no tokens (offsets repeat)."""
    if not hasattr(torch, "_grouped_mm"):
        raise RuntimeError("torch._grouped_mm does not exist")
    g = torch.Generator().manual_seed(0)
    x32 = torch.randn(48, 64, generator=g)
    w32 = torch.randn(3, 32, 64, generator=g)
    offsets = torch.tensor([16, 16, 48], dtype=torch.int32)  # expert 1 receives none
    x = x32.to(_dev(), _half()).requires_grad_()
    w = w32.to(_dev(), _half()).requires_grad_()
    out = torch._grouped_mm(x, w.transpose(1, 2), offs=offsets.to(_dev()))
    out.float().square().sum().backward()
    xr, wr = x32.clone().requires_grad_(), w32.clone().requires_grad_()
    bounds = [0, 16, 16, 48]
    ref = torch.cat([xr[bounds[e]:bounds[e + 1]] @ wr[e].t() for e in range(3)])
    ref.square().sum().backward()
    errs = (_rel(out.cpu(), ref), _rel(x.grad.cpu(), xr.grad), _rel(w.grad.cpu(), wr.grad))
    assert float(w.grad[1].abs().max()) == 0.0, "the empty expert got a gradient"
    assert max(errs) < 2e-2, f"relative errors {errs}"
    return "relative errors out/dx/dw " + ", ".join(f"{e:.1e}" for e in errs) + " (bf16)"


@probe
def cp_block_flash_forward_backward():
    """context_parallel.blocks' CUDA flash block (private aten op) against its reference kernel."""
    from megatron.core.transformer.context_parallel import blocks as cp_blocks

    b, hq, hkv, s, d = 2, 8, 2, 128, 64
    kernel = cp_blocks.choose_block_kernel(device.device_type(), _half(), d, False, False)
    g = torch.Generator().manual_seed(0)
    q, k, v, dout = (torch.randn(b, h, s, d, generator=g).to(_dev(), _half())
                     for h in (hq, hkv, hkv, hq))
    pos = torch.arange(s, device=_dev())
    results = {}
    for name in (kernel, "reference"):
        st = cp_blocks.BlockSettings(scale=d ** -0.5, kernel=name)
        out, lse = cp_blocks.block_forward(q, k, v, pos, pos, True, st)
        grads = cp_blocks.block_backward(dout, q, k, v, out.to(q.dtype), lse, pos, pos, True,
                                         st)
        results[name] = (out, lse, *grads)
    errs = [_rel(a, r) for a, r in zip(results[kernel], results["reference"])]
    assert max(errs) < 2e-2, f"relative errors {errs}"
    return f"kernel {kernel}; out/lse/dq/dk/dv vs reference " + \
        ", ".join(f"{e:.1e}" for e in errs)


@probe
def varlen_attn_signature():
    from megatron.core.transformer import attention

    kernel = attention.varlen_kernel()
    if kernel is None:
        raise RuntimeError("torch.nn.attention.varlen.varlen_attn is not importable")
    return f"varlen_attn{inspect.signature(kernel)}"


@probe
def sdpa_kernel_for_gqa_bf16():
    """Which kernel F.scaled_dot_product_attention runs for our call, vs our prediction."""
    from megatron.core.transformer.attention import sdpa_kernel_for

    predicted, repeat_kv = sdpa_kernel_for(device.device_type(), _half(), 64, True, False,
                                           False)
    q = torch.randn(2, 8, 256, 64, device=_dev(), dtype=_half(), requires_grad=True)
    k = torch.randn(2, 2, 256, 64, device=_dev(), dtype=_half(), requires_grad=True)
    v = torch.randn(2, 2, 256, 64, device=_dev(), dtype=_half(), requires_grad=True)
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.device_type() == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                               enable_gqa=True)
        out.sum().backward()
        device.synchronize()
    names = sorted({e.name for e in prof.events()
                    if any(w in e.name.lower() for w in ("flash", "efficient", "math",
                                                         "cudnn", "fmha", "attention"))})
    return f"predicted {predicted} (repeat_kv={repeat_kv}); ran: {'; '.join(names)[:600]}"


def _fp8_case(a_scaling, b_scaling, a_dtype=torch.float8_e4m3fn, out=torch.bfloat16):
    """fp8_gemm of two random operands against the fp64 product of their dequantized
    values: the relative error (bf16 output: ~2^-9)."""
    from megatron.core.fp8 import dequantize, fp8_gemm, quantize

    g = torch.Generator().manual_seed(0)
    x = torch.randn(512, 1024, generator=g).to(_dev())
    w = torch.randn(768, 1024, generator=g).to(_dev())
    a, b = quantize(x, a_dtype, a_scaling), quantize(w, torch.float8_e4m3fn, b_scaling)
    got = fp8_gemm(a, b, out)
    want = dequantize(a).double() @ dequantize(b).double().t()
    err = _rel(got.double(), want)
    assert got.dtype == out and err < 1e-2, f"relative error {err:.2e}"
    return err


@probe
def fp8_scaled_mm_tensorwise_and_rowwise():
    """torch._scaled_mm as the FP8 linears call it: tensorwise and rowwise, e4m3 and e5m2
    (hybrid's gradients), bf16 and fp32 outputs (fp32: the fused weight gradient)."""
    results = []
    for scaling in ("tensorwise", "rowwise"):
        for a_dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            for out in (torch.bfloat16, torch.float32):
                try:
                    err = _fp8_case(scaling, scaling, a_dtype, out)
                    results.append(f"{scaling} {str(a_dtype)[-5:]} -> {str(out)[6:]}: "
                                   f"{err:.1e}")
                except Exception as exc:  # a refused combination is the finding
                    results.append(f"{scaling} {str(a_dtype)[-5:]} -> {str(out)[6:]}: "
                                   f"REFUSED ({str(exc).splitlines()[0][:80]})")
    assert not any("REFUSED" in r and "bfloat16" in r for r in results), results
    return "; ".join(results)


@probe
def fp8_blockwise_native_or_sliced():
    """Blockwise: whether torch's native block-scaled GEMM agrees with the per-K-slice path
    (and so is used), why not (the exception, or the mismatch), and the error of what runs."""
    from megatron.core.fp8.gemm import NATIVE_BLOCKWISE_WHY, native_blockwise

    pairs = (("1x128", "128x128"), ("1x128", "1x128"))
    native = {pair: native_blockwise(device.device_type(), *pair) for pair in pairs}
    why = {f"{a}x{b}": NATIVE_BLOCKWISE_WHY.get((device.device_type(), a, b), "?")
           for a, b in pairs}
    errors = {f"{a}x{b}": f"{_fp8_case(a, b):.1e}" for a, b in native}
    return f"native: {native}; why: {why}; relative errors {errors}"


@probe
def fp8_grouped_experts():
    """The rowwise experts: whether torch's grouped FP8 GEMM agrees with the per-expert GEMMs
    (and so is used), or why not."""
    from megatron.core.fp8.grouped import GROUPED_WHY, grouped_kernel

    used = grouped_kernel(device.device_type())
    return f"grouped kernel used: {used}; {GROUPED_WHY.get(device.device_type(), '?')}"


def main() -> int:
    versions()
    for fn in PROBES:
        run_probe(fn)
    failed = [name for status, name in RESULTS if status == "FAIL"]
    print(f"probes: {len(RESULTS) - len(failed)} OK, {len(failed)} failed"
          + (f" ({', '.join(failed)})" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
