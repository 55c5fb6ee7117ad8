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


def _pretend_cuda(monkeypatch, gpus: int, backend: str = "nccl"):
    """device.py believes it runs on ``gpus`` GPUs; torch.cuda.set_device records its calls."""
    bound = []
    monkeypatch.setattr(device, "device_type", lambda: "cuda")
    monkeypatch.setattr(device, "dist_backend", lambda: backend)
    monkeypatch.setattr(device, "cuda_device_count", lambda: gpus)
    monkeypatch.setattr(torch.cuda, "set_device", bound.append)
    # set_device turns TF32 on: tests/conftest.py puts the process's settings back.
    return bound


def test_two_ranks_on_one_gpu_are_refused_unless_allowed(monkeypatch):
    bound = _pretend_cuda(monkeypatch, gpus=2)
    monkeypatch.delenv(device.SHARED_GPU_ENV, raising=False)
    device.set_device(1)
    assert bound == [1]
    with pytest.raises(device.DeviceSetupError) as err:
        device.set_device(2)
    message = str(err.value)
    for part in ("LOCAL_RANK=2", "only 2 visible GPU(s)", "--nproc-per-node 2",
                 "CUDA_VISIBLE_DEVICES", "MEGATRON_ALLOW_SHARED_GPU=1"):
        assert part in message
    assert bound == [1]
    monkeypatch.setenv(device.SHARED_GPU_ENV, "1")  # deliberate sharing (GPU test tier)
    device.set_device(3)
    assert bound == [1, 1]


def test_set_device_is_a_no_op_on_cpu(monkeypatch):
    bound = []
    monkeypatch.setattr(torch.cuda, "set_device", bound.append)
    device.set_device_type("cpu")
    device.set_device(5)
    assert bound == []


def test_tf32_is_turned_on_only_on_cuda(monkeypatch):
    _pretend_cuda(monkeypatch, gpus=1)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    monkeypatch.setattr(device, "device_type", lambda: "cpu")
    device.configure_cuda_math()
    assert not torch.backends.cuda.matmul.allow_tf32 and not torch.backends.cudnn.allow_tf32
    monkeypatch.setattr(device, "device_type", lambda: "cuda")
    device.set_device(0)  # binding the GPU sets the math mode
    assert torch.backends.cuda.matmul.allow_tf32 and torch.backends.cudnn.allow_tf32
    monkeypatch.setenv(device.TF32_ENV, "0")
    device.configure_cuda_math()
    assert not torch.backends.cuda.matmul.allow_tf32 and not torch.backends.cudnn.allow_tf32


def test_cuda_device_max_connections_is_required_for_tensor_parallel_on_cuda(monkeypatch):
    monkeypatch.delenv(device.MAX_CONNECTIONS_ENV, raising=False)
    device.set_device_type("cpu")
    device.check_max_connections(4)  # CPU: no hardware queues to order
    monkeypatch.setattr(device, "device_type", lambda: "cuda")
    device.check_max_connections(1)  # no TP communication to overlap
    with pytest.raises(device.DeviceSetupError,
                       match=r"TP=2\) on CUDA needs CUDA_DEVICE_MAX_CONNECTIONS=1 \(it is unset\)"):
        device.check_max_connections(2)
    monkeypatch.setenv(device.MAX_CONNECTIONS_ENV, "8")
    with pytest.raises(device.DeviceSetupError, match=r"\(it is '8'\)"):
        device.check_max_connections(2)
    monkeypatch.setenv(device.MAX_CONNECTIONS_ENV, "1")
    device.check_max_connections(2)


def test_process_group_device_id_only_with_nccl(monkeypatch):
    device.set_device_type("cpu")
    assert device.process_group_device_id(0) is None
    _pretend_cuda(monkeypatch, gpus=4, backend="gloo")
    assert device.process_group_device_id(1) is None  # gloo binds no GPU
    monkeypatch.setattr(device, "dist_backend", lambda: "nccl")
    assert device.process_group_device_id(3) == torch.device("cuda", 3)


def test_max_memory_allocated_is_none_on_cpu_and_cuda_peak_on_cuda(monkeypatch):
    device.set_device_type("cpu")
    assert device.max_memory_allocated() is None
    monkeypatch.setattr(device, "device_type", lambda: "cuda")
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda *a: 3 * 2**30)
    assert device.max_memory_allocated() == 3 * 2**30
