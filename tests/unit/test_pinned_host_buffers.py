"""CPU offload's host buffers are pinned at their exact size: plain host memory registered
with CUDA (cudaHostRegister), not the caching host allocator, which rounds each allocation up
to a power of two (4.4 GB took 8 GB, twice). CUDA's runtime is faked here; only a GPU can
check the registration itself, that copies from and to the buffer are asynchronous, and that
torch.cuda.host_memory_stats() shows no pinned allocation for it."""
import gc

import pytest
import torch

from megatron.core import device
from megatron.core.optimizer.cpu_offload import _host_buffers


class FakeCudart:
    def __init__(self, error=0):
        self.error = error
        self.registered, self.unregistered = [], []

    def cudaHostRegister(self, pointer, nbytes, flags):
        self.registered.append((pointer, nbytes, flags))
        return self.error

    def cudaHostUnregister(self, pointer):
        self.unregistered.append(pointer)
        return 0


@pytest.fixture
def fake_cuda(monkeypatch):
    cudart = FakeCudart()
    monkeypatch.setattr(device, "device_type", lambda: "cuda")
    monkeypatch.setattr(device, "_cudart", lambda: cudart)
    return cudart


def test_on_cpu_plain_memory_and_no_cuda_call(monkeypatch):
    monkeypatch.setattr(device, "device_type", lambda: "cpu")
    monkeypatch.setattr(device, "_cudart", lambda: pytest.fail("CUDA runtime asked on CPU"))
    buffer = device.pinned_host_empty(1000)
    assert buffer.shape == (1000,) and buffer.dtype == torch.float32
    assert buffer.device.type == "cpu" and not buffer.is_pinned()


def test_on_cuda_registers_exactly_the_bytes_asked(fake_cuda):
    numel = 3 * 2 ** 20 + 5  # a power of two would round it up to 4 Mi elements
    buffer = device.pinned_host_empty(numel)
    assert buffer.numel() == numel
    assert fake_cuda.registered == [(buffer.data_ptr(), numel * 4, 1)]  # cudaHostRegisterPortable


def test_unregistered_when_the_memory_is_freed_not_before(fake_cuda):
    buffer = device.pinned_host_empty(1024)
    pointer = buffer.data_ptr()
    views = list(torch.split(buffer, [1000, 24]))  # what _host_buffers hands out
    del buffer
    gc.collect()
    assert fake_cuda.unregistered == []  # the views still use the memory
    del views
    gc.collect()
    assert fake_cuda.unregistered == [pointer]


def test_a_failed_registration_is_an_error_naming_the_limit(fake_cuda):
    fake_cuda.error = 2  # cudaErrorMemoryAllocation
    with pytest.raises(RuntimeError, match="cudaHostRegister of 400 bytes.*ulimit -l"):
        device.pinned_host_empty(100)


def test_no_registration_for_an_empty_buffer(fake_cuda):
    assert device.pinned_host_empty(0).numel() == 0 and fake_cuda.registered == []


def test_cpu_offload_host_buffers_are_one_exact_registration(fake_cuda):
    buffers = _host_buffers([3, 5, 7])
    assert [b.numel() for b in buffers] == [3, 5, 7]
    assert fake_cuda.registered == [(buffers[0].data_ptr(), 15 * 4, 1)]
    assert buffers[1].data_ptr() == buffers[0].data_ptr() + 3 * 4  # views of the one buffer
