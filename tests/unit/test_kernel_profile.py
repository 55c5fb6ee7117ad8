"""bench/kernel_profile.py's CUDA report, on events shaped as torch.profiler gives them: kernel
names as the first GPU run printed them are sorted into the right kinds, and the GPU-timeline
annotation is left out while kernels whose demangled names hold '#' stay in (a filter on '#'
alone dropped 265 of 694 ms of that run's step)."""
import types

import torch

from bench.kernel_profile import _cuda_report, is_annotation, kernel_kind

GEMM = "nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_NNT"
FLASH = "cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_knob_26_64x64x64_1x4x1"
COPY = ("void at::native::unrolled_elementwise_kernel<at::native::direct_copy_kernel_cuda("
        "at::TensorIteratorBase&)::{lambda()#3}::operator()() const::{lambda()#7}>")
ADAM = ("void at::native::(anonymous namespace)::multi_tensor_apply_kernel<at::native::("
        "anonymous namespace)::FusedOptimizerTensorListMetadata<4>>")
TRITON = "triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_0"
ANNOTATION = "Optimizer.step#AdamW.step"


def _event(name, us, on_gpu=True):
    span = types.SimpleNamespace(elapsed_us=lambda: us)
    kind = torch.autograd.DeviceType.CUDA if on_gpu else torch.autograd.DeviceType.CPU
    return types.SimpleNamespace(name=name, device_type=kind, time_range=span)


def test_kinds_of_the_kernels_the_first_gpu_run_saw():
    assert kernel_kind(GEMM) == "GEMM"
    assert kernel_kind(FLASH) == "attention"
    assert kernel_kind(COPY) == "element-wise/other"
    assert kernel_kind(ADAM) == "optimizer/foreach"
    assert kernel_kind(TRITON) == "triton (compiled)"
    assert kernel_kind("Memcpy DtoH (Device -> Pinned)") == "copy/set"
    assert kernel_kind("ncclDevKernel_AllReduce_Sum_f32_RING_LL") == "communication"
    assert is_annotation(ANNOTATION)
    assert not any(map(is_annotation, (GEMM, FLASH, COPY, ADAM, TRITON)))


def test_report_sums_kernels_not_annotations():
    events = [_event(GEMM, 3000), _event(GEMM, 1000), _event(COPY, 500), _event(FLASH, 1500),
              _event(ANNOTATION, 9000), _event("Memcpy DtoH (Device -> Pageable)", 10),
              _event("cudaStreamSynchronize", 20, on_gpu=False), _event("aten::mm", 40, False)]
    report = _cuda_report(events, "test").splitlines()
    assert report[0] == ("profile of one step, test: device time 6.01 ms in 5 kernels; host "
                         "syncs 1, device-to-host copies 1")
    kinds = {line.split("  ")[1].strip(): line for line in report[1:5]}
    assert kinds["GEMM"].split()[1:4] == ["4.00", "ms", "66.6"]
    assert kinds["attention"].split()[1] == "1.50"
    assert kinds["element-wise/other"].split()[1] == "0.50"
    assert all(ANNOTATION not in line for line in report)
