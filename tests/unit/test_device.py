"""device.py picks cpu/gloo here, honours overrides, and refuses impossible ones clearly."""
import pytest
import torch

from megatron.core import device


@pytest.fixture(autouse=True)
def _clean(monkeypatch):
    monkeypatch.delenv(device.DEVICE_ENV, raising=False)
    monkeypatch.delenv(device.BACKEND_ENV, raising=False)
    yield
    device.set_device_type(None)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU default")
def test_cpu_and_gloo_without_cuda(monkeypatch):
    assert device.device_type() == "cpu"
    assert device.dist_backend() == "gloo"
    assert device.current_device() == torch.device("cpu")
    assert device.zeros(2, 3).device.type == "cpu"
    with pytest.raises(RuntimeError, match="asks for 'cuda' but torch sees no CUDA device"):
        device.set_device_type("cuda")
    monkeypatch.setenv(device.DEVICE_ENV, "cuda")
    with pytest.raises(RuntimeError, match="MEGATRON_DEVICE=cuda asks for 'cuda'"):
        device.device_type()


def test_overrides(monkeypatch):
    device.set_device_type("cpu")
    assert device.device_type() == "cpu" and device.dist_backend() == "gloo"
    monkeypatch.setenv(device.BACKEND_ENV, "nccl")
    with pytest.raises(RuntimeError, match="nccl needs CUDA tensors"):
        device.dist_backend()
    monkeypatch.setenv(device.BACKEND_ENV, "mpi")
    with pytest.raises(ValueError, match="unknown backend"):
        device.dist_backend()
    with pytest.raises(ValueError, match="unknown device type 'tpu'"):
        device.set_device_type("tpu")
    monkeypatch.setenv(device.DEVICE_ENV, "xpu")
    device.set_device_type(None)
    with pytest.raises(ValueError, match="MEGATRON_DEVICE=xpu: unknown device type"):
        device.device_type()


def test_rng_state_round_trip_and_generator():
    device.manual_seed(3)
    state = device.get_rng_state()
    first = torch.rand(5, device=device.current_device())
    device.set_rng_state(state)
    assert torch.equal(first, torch.rand(5, device=device.current_device()))
    a = torch.rand(5, generator=device.generator(11), device=device.current_device())
    b = torch.rand(5, generator=device.generator(11), device=device.current_device())
    assert torch.equal(a, b) and not torch.equal(a, first)
