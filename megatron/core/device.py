"""The one place that knows which accelerator we run on.

Everything else asks this module for the device, the distributed backend, new tensors and the
device RNG state, so the same code runs on CPU with gloo (development, CI) and on NVIDIA GPUs
with nccl (real work). No other module touches ``torch.cuda``.

Overrides, for tests and odd clusters:
  MEGATRON_DEVICE=cpu|cuda            force the device type
  MEGATRON_DIST_BACKEND=gloo|nccl     force the torch.distributed backend
or ``set_device_type(...)`` from Python.
"""
import os
from typing import Optional

import torch

DEVICE_ENV = "MEGATRON_DEVICE"
BACKEND_ENV = "MEGATRON_DIST_BACKEND"
_SUPPORTED_DEVICES = ("cpu", "cuda")
_SUPPORTED_BACKENDS = ("gloo", "nccl")

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
    if device_type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(
            f"{source} asks for 'cuda' but torch sees no CUDA device "
            f"(torch {torch.__version__}, CUDA build: {torch.version.cuda}). "
            f"Unset it to run on CPU, or install a CUDA build of torch."
        )


def device_type() -> str:
    """'cuda' when CUDA is available, else 'cpu', unless overridden."""
    if _device_type_override is not None:
        return _device_type_override
    env = os.environ.get(DEVICE_ENV)
    if env:
        _check_device_type(env, source=f"{DEVICE_ENV}={env}")
        return env
    return "cuda" if torch.cuda.is_available() else "cpu"


def dist_backend() -> str:
    """'nccl' on CUDA, 'gloo' on CPU, unless MEGATRON_DIST_BACKEND says otherwise."""
    env = os.environ.get(BACKEND_ENV)
    if env:
        if env not in _SUPPORTED_BACKENDS:
            raise ValueError(
                f"{BACKEND_ENV}={env}: unknown backend; use one of {_SUPPORTED_BACKENDS}."
            )
        if env == "nccl" and device_type() != "cuda":
            raise RuntimeError(f"{BACKEND_ENV}=nccl needs CUDA tensors, but the device is cpu.")
        return env
    return "nccl" if device_type() == "cuda" else "gloo"


def set_device(local_rank: int) -> None:
    """Bind this process to its GPU (no-op on CPU)."""
    if device_type() == "cuda":
        torch.cuda.set_device(local_rank % torch.cuda.device_count())


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


def synchronize() -> None:
    if device_type() == "cuda":
        torch.cuda.synchronize()
