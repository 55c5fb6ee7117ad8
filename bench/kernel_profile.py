"""Where one training step's time goes: torch.profiler over one call of a step function.

``profile_step(step, label)`` runs ``step()`` once under the profiler and returns a text
report: on CUDA, device time by kind of kernel (GEMM, attention, element-wise, optimizer,
communication, copies, Triton), the number of kernels, host syncs and device-to-host
copies, and the top kernels by device time; on CPU, the top operators by self CPU time
(what the --dry-run of shtools/gpu_run.sh prints).
"""
from collections import defaultdict

import torch

# Substrings of kernel names, tried in this order; the first that matches names the kind.
KINDS = (
    ("communication", ("nccl",)),
    ("attention", ("flash", "fmha", "attention", "sdpa")),
    ("GEMM", ("gemm", "nvjet", "cutlass", "xmma", "cublas", "matmul", "splitk")),
    ("optimizer/foreach", ("adam", "multi_tensor", "foreach")),
    ("copy/set", ("memcpy", "memset")),
    ("triton (compiled)", ("triton",)),
)
SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")
TOP = 25


def kernel_kind(name: str) -> str:
    lower = name.lower()
    for kind, needles in KINDS:
        if any(n in lower for n in needles):
            return kind
    return "element-wise/other"


def is_annotation(name: str) -> bool:
    """A record_function range mirrored on the GPU timeline ("Optimizer.step#AdamW.step"):
    '#' and no parentheses or spaces. Kernel names carry '#' too, in demangled lambdas
    ("direct_copy_kernel_cuda(at::TensorIteratorBase&)::{lambda()#3}"), always with
    parentheses: those are kernels."""
    return "#" in name and "(" not in name and " " not in name


def _device_us(event) -> float:
    """A kernel's (or copy's) own duration: its time range on the device."""
    return float(event.time_range.elapsed_us())


def _is_device_event(event) -> bool:
    return getattr(event, "device_type", None) == torch.autograd.DeviceType.CUDA


def profile_step(step, label: str) -> str:
    on_cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
    activities = [torch.profiler.ProfilerActivity.CPU]
    if on_cuda:
        activities.append(torch.profiler.ProfilerActivity.CUDA)
        torch.cuda.synchronize()
    with torch.profiler.profile(activities=activities) as prof:
        step()
        if on_cuda:
            torch.cuda.synchronize()
    events = prof.events()
    return _cuda_report(events, label) if on_cuda else _cpu_report(prof, label)


def _cuda_report(events, label: str) -> str:
    by_name = defaultdict(lambda: [0.0, 0])
    syncs = dtoh = 0
    for event in events:
        if _is_device_event(event) and is_annotation(event.name):
            continue  # a range on the GPU timeline, not a kernel: its time is its kernels'
        if _is_device_event(event):
            entry = by_name[event.name]
            entry[0] += _device_us(event)
            entry[1] += 1
            if event.name.startswith("Memcpy DtoH"):
                dtoh += 1
        elif event.name in SYNC_CALLS:
            syncs += 1
    total = sum(t for t, _ in by_name.values()) or 1.0
    kernels = sum(n for _, n in by_name.values())
    by_kind = defaultdict(lambda: [0.0, 0])
    for name, (us, n) in by_name.items():
        by_kind[kernel_kind(name)][0] += us
        by_kind[kernel_kind(name)][1] += n
    lines = [f"profile of one step, {label}: device time {total / 1e3:.2f} ms in {kernels} "
             f"kernels; host syncs {syncs}, device-to-host copies {dtoh}"]
    for kind, (us, n) in sorted(by_kind.items(), key=lambda kv: -kv[1][0]):
        lines.append(f"  {kind:<20} {us / 1e3:10.2f} ms {100 * us / total:6.1f} %  {n:6d} kernels")
    lines.append(f"  top {TOP} kernels (ms, count, kind, name):")
    for name, (us, n) in sorted(by_name.items(), key=lambda kv: -kv[1][0])[:TOP]:
        lines.append(f"  {us / 1e3:10.3f} {n:6d}  {kernel_kind(name):<18} {name[:110]}")
    return "\n".join(lines)


def _cpu_report(prof, label: str) -> str:
    averages = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)
    total = sum(e.self_cpu_time_total for e in averages) or 1.0
    lines = [f"profile of one step, {label}: CPU self time {total / 1e3:.2f} ms in "
             f"{sum(e.count for e in averages)} operator calls (no CUDA: operators, not kernels)"]
    for e in averages[:TOP]:
        lines.append(f"  {e.self_cpu_time_total / 1e3:10.3f} {e.count:6d}  {e.key[:110]}")
    return "\n".join(lines)
