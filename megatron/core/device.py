"""The one place that knows which accelerator we run on.

Everything else asks this module for the device, the distributed backend, new tensors and the
device RNG state, so the same code runs on CPU with gloo (development, CI) and on NVIDIA GPUs
with nccl (real work). No other module touches ``torch.cuda``.

Overrides, for tests and odd clusters:
  MEGATRON_DEVICE=cpu|cuda            force the device type
  MEGATRON_DIST_BACKEND=gloo|nccl     force the torch.distributed backend
  MEGATRON_ALLOW_SHARED_GPU=1         let several ranks of a node share one GPU (tests that run
                                      N gloo ranks on one GPU); otherwise that is an error
  MEGATRON_ALLOW_TF32=0               keep fp32 GEMMs in full fp32 on CUDA (TF32 is on by
                                      default, as in NVIDIA's PyTorch containers Megatron runs in)
or ``set_device_type(...)`` from Python.
"""
import os
import weakref
from typing import List, Optional, Sequence, Tuple

import torch

DEVICE_ENV = "MEGATRON_DEVICE"
BACKEND_ENV = "MEGATRON_DIST_BACKEND"
_SUPPORTED_DEVICES = ("cpu", "cuda")
_SUPPORTED_BACKENDS = ("gloo", "nccl")
SHARED_GPU_ENV = "MEGATRON_ALLOW_SHARED_GPU"
TF32_ENV = "MEGATRON_ALLOW_TF32"
MAX_CONNECTIONS_ENV = "CUDA_DEVICE_MAX_CONNECTIONS"


class DeviceSetupError(RuntimeError):
    """The job cannot run on this machine as launched; the message names the fix."""


_device_type_override: Optional[str] = None


def cuda_device_count() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def set_device_type(device_type: Optional[str]) -> None:
    """Force 'cpu' or 'cuda' for this process (None returns to auto-detection)."""
    if device_type is not None:
        _check_device_type(device_type, source="set_device_type()")
    global _device_type_override
    _device_type_override = device_type


def _check_device_type(device_type: str, source: str) -> None:
    if device_type not in _SUPPORTED_DEVICES:
        raise ValueError(
            f"{source}: unknown device type {device_type!r}; use one of {_SUPPORTED_DEVICES}."
        )
    if device_type == "cuda" and not torch.cuda.is_available():  # a launch mistake
        raise DeviceSetupError(
            f"{source} asks for 'cuda' but torch sees no CUDA device "
            f"(torch {torch.__version__}, CUDA build: {torch.version.cuda}). "
            f"Run on CPU instead (--device cpu, or unset {DEVICE_ENV}), or install a CUDA "
            f"build of torch."
        )


def check_requested_device(device_type: Optional[str], source: str) -> None:
    """A device the user asked for (``source``: the flag, e.g. '--device cuda') must exist
    here: a DeviceSetupError saying so, before any work, rather than a failure later."""
    if device_type not in (None, "auto"):
        _check_device_type(device_type, source)


def device_type() -> str:
    """'cuda' when CUDA is available, else 'cpu', unless overridden."""
    if _device_type_override is not None:
        return _device_type_override
    env = os.environ.get(DEVICE_ENV)
    if env:
        _check_device_type(env, source=f"{DEVICE_ENV}={env}")
        return env
    return "cuda" if torch.cuda.is_available() else "cpu"


def capability() -> Optional[Tuple[int, int]]:
    """The CUDA device's compute capability (major, minor), or None without CUDA."""
    if not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_capability()


def dist_backend() -> str:
    """'nccl' on CUDA, 'gloo' on CPU, unless MEGATRON_DIST_BACKEND says otherwise."""
    env = os.environ.get(BACKEND_ENV)
    if env:
        if env not in _SUPPORTED_BACKENDS:
            raise ValueError(
                f"{BACKEND_ENV}={env}: unknown backend; use one of {_SUPPORTED_BACKENDS}."
            )
        if env == "nccl" and device_type() != "cuda":
            raise DeviceSetupError(f"{BACKEND_ENV}=nccl needs CUDA tensors, but the device is "
                                   f"cpu; unset {BACKEND_ENV} (gloo serves CPU runs).")
        return env
    return "nccl" if device_type() == "cuda" else "gloo"


def set_device(local_rank: int) -> None:
    """Bind this process to its GPU, one GPU per rank (no-op on CPU)."""
    if device_type() != "cuda":
        return
    count = cuda_device_count()
    if local_rank >= count and os.environ.get(SHARED_GPU_ENV) != "1":
        # Two ranks on one GPU would each hold a full share of memory and serialize their
        # kernels (nccl refuses it outright): a launch mistake, not a configuration.
        raise DeviceSetupError(
            f"LOCAL_RANK={local_rank} but this node has only {count} visible GPU(s), so ranks "
            f"would share a GPU. Start at most {count} processes per node "
            f"(--nproc-per-node {count}), or make more GPUs visible (CUDA_VISIBLE_DEVICES); "
            f"set {SHARED_GPU_ENV}=1 only to share GPUs on purpose (tests, with gloo).")
    torch.cuda.set_device(local_rank % count)
    configure_cuda_math()


def configure_cuda_math() -> None:
    """TF32 for fp32 GEMMs and convolutions on CUDA (Megatron runs in NVIDIA's containers,
    which turn it on); ``MEGATRON_ALLOW_TF32=0`` keeps full fp32. No-op on CPU."""
    if device_type() != "cuda":
        return
    allow = os.environ.get(TF32_ENV, "1") != "0"
    torch.backends.cuda.matmul.allow_tf32 = allow
    torch.backends.cudnn.allow_tf32 = allow


def check_max_connections(tensor_model_parallel_size: int) -> None:
    """Megatron's rule: TP on CUDA needs CUDA_DEVICE_MAX_CONNECTIONS=1, so the GPU runs kernels
    in issue order and a TP collective issued before a GEMM really overlaps it (with more
    hardware queues the GEMM can be scheduled first). CUDA reads it when its context starts,
    hence a check before any CUDA work rather than setting it here."""
    if device_type() != "cuda" or tensor_model_parallel_size <= 1:
        return
    value = os.environ.get(MAX_CONNECTIONS_ENV)
    if value != "1":
        raise DeviceSetupError(
            f"tensor parallelism (TP={tensor_model_parallel_size}) on CUDA needs "
            f"{MAX_CONNECTIONS_ENV}=1 (it is {'unset' if value is None else repr(value)}) so "
            f"that TP communication overlaps the GEMMs; export {MAX_CONNECTIONS_ENV}=1 before "
            f"launching (the shtools/launch templates do).")


def current_device() -> torch.device:
    if device_type() == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def empty(*size, dtype: torch.dtype = torch.float32, **kwargs) -> torch.Tensor:
    return torch.empty(*size, dtype=dtype, device=current_device(), **kwargs)


def zeros(*size, dtype: torch.dtype = torch.float32, **kwargs) -> torch.Tensor:
    return torch.zeros(*size, dtype=dtype, device=current_device(), **kwargs)


def tensor(data, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    return torch.tensor(data, dtype=dtype, device=current_device())


def generator(seed: int) -> torch.Generator:
    """A generator on the current device, seeded."""
    g = torch.Generator(device=current_device())
    g.manual_seed(seed)
    return g


def manual_seed(seed: int) -> None:
    """Seed the default generator of the current device (the one dropout draws from)."""
    if device_type() == "cuda":
        torch.cuda.manual_seed(seed)
    else:
        torch.manual_seed(seed)


def get_rng_state() -> torch.Tensor:
    """State of the default generator of the current device."""
    if device_type() == "cuda":
        return torch.cuda.get_rng_state()
    return torch.get_rng_state()


def set_rng_state(state: torch.Tensor) -> None:
    if device_type() == "cuda":
        torch.cuda.set_rng_state(state)
    else:
        torch.set_rng_state(state)


def read_together(tensors: Sequence[torch.Tensor]) -> List[List[float]]:
    """Each tensor's values as floats, in one device-to-host copy for all of them (each read is
    a host sync on CUDA). float64 holds every float32, bf16 and fp16 value exactly, so the
    floats are what ``.tolist()`` gives."""
    if not tensors:
        return []
    flat = torch.cat([t.detach().reshape(-1).double() for t in tensors]).tolist()
    values, start = [], 0
    for t in tensors:
        values.append(flat[start:start + t.numel()])
        start += t.numel()
    return values


def synchronize() -> None:
    if device_type() == "cuda":
        torch.cuda.synchronize()


def process_group_device_id(local_rank: int) -> Optional[torch.device]:
    """``device_id`` for init_process_group: with nccl it binds the group to this rank's GPU
    and creates the communicator at once, not at the first collective (None with gloo)."""
    if device_type() != "cuda" or dist_backend() != "nccl":
        return None
    return torch.device("cuda", local_rank % cuda_device_count())


def max_memory_allocated() -> Optional[int]:
    """Peak bytes allocated by tensors on this rank's GPU; None on CPU."""
    if device_type() != "cuda":
        return None
    return torch.cuda.max_memory_allocated()


def host_empty(*size, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A host tensor for device-to-host copies: pinned on CUDA (so a non_blocking copy into it
    is truly asynchronous and runs at full bandwidth), plain memory on CPU."""
    return torch.empty(*size, dtype=dtype, device="cpu", pin_memory=device_type() == "cuda")


_CUDA_HOST_REGISTER_PORTABLE = 1  # cudaHostRegisterPortable: pinned for every CUDA context


def pinned_host_empty(numel: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A 1-D host tensor of exactly ``numel`` elements for asynchronous copies to and from the
    device. On CUDA: plain host memory page-locked with cudaHostRegister (as torch's async
    checkpoint stager does), not the caching host allocator (``pin_memory=True``), which rounds
    every allocation up to a power of two (4.4 GB would take 8 GB); unregistered when the
    memory is freed. Plain memory on CPU."""
    tensor = torch.empty(numel, dtype=dtype, device="cpu")
    if device_type() == "cuda" and tensor.numel() > 0:
        register_host_memory(tensor.untyped_storage(), _cudart())
    return tensor


def _cudart():
    return torch.cuda.cudart()


def register_host_memory(storage: torch.UntypedStorage, cudart) -> None:
    """Page-lock ``storage`` for the device until the storage is freed (``cudart``: torch's
    CUDA runtime bindings, ``torch.cuda.cudart()``)."""
    pointer, nbytes = storage.data_ptr(), storage.nbytes()
    error = int(cudart.cudaHostRegister(pointer, nbytes, _CUDA_HOST_REGISTER_PORTABLE))
    if error != 0:
        raise RuntimeError(f"cudaHostRegister of {nbytes} bytes of host memory failed "
                           f"(cudaError {error}): is the locked-memory limit (ulimit -l) too low?")
    # The storage object lives as long as its memory (torch keeps it for the views).
    unregister = weakref.finalize(storage, cudart.cudaHostUnregister, pointer)
    unregister.atexit = False  # at exit the CUDA context may already be gone


def record_event(timing: bool = False):
    """An event marking the work issued so far on the current stream (e.g. non_blocking
    copies; with ``timing``, a timer's start or stop); None on CPU, where that work is already
    done and the host clock is the device's."""
    if device_type() != "cuda":
        return None
    event = torch.cuda.Event(enable_timing=timing)
    event.record()
    return event


def wait_event(event) -> None:
    """Block the calling thread (not the device) until ``event`` has passed; None: no-op."""
    if event is not None:
        event.synchronize()


def reset_max_memory_allocated() -> None:
    """Start a new peak for ``max_memory_allocated`` (no-op on CPU)."""
    if device_type() == "cuda":
        torch.cuda.reset_peak_memory_stats()


def memory_allocated() -> Optional[int]:
    """Bytes held by live tensors on this rank's GPU now; None on CPU."""
    if device_type() != "cuda":
        return None
    return torch.cuda.memory_allocated()
