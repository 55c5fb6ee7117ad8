"""tests/distributed.py's rank pools serve only runs of the device and backend they were made
for. On the GPU machine a CPU reference run once landed in the nccl world a GPU test had left
("No backend type associated with device type cpu"): this is that rule, shown on CPU."""
import os

import torch
import torch.distributed as dist

from tests import distributed


def _backend_and_pid():
    return dist.get_backend(), os.getpid()


def test_device_and_backend_resolve_as_megatron_does():
    default = "cuda" if torch.cuda.is_available() else "cpu"
    assert distributed._device_and_backend({}) == (
        default, "nccl" if default == "cuda" else "gloo")
    assert distributed._device_and_backend({"MEGATRON_DEVICE": "cpu"}) == ("cpu", "gloo")
    assert distributed._device_and_backend({"MEGATRON_DEVICE": "cuda"}) == ("cuda", "nccl")
    assert distributed._device_and_backend(
        {"MEGATRON_DEVICE": "cuda", "MEGATRON_DIST_BACKEND": "gloo"}) == ("cuda", "gloo")


def test_a_pool_made_for_another_backend_is_replaced(monkeypatch):
    monkeypatch.setenv("MEGATRON_DEVICE", "cpu")
    monkeypatch.delenv("MEGATRON_DIST_BACKEND", raising=False)
    (first,) = distributed.run_distributed(_backend_and_pid, world_size=1)
    monkeypatch.setenv("MEGATRON_DIST_BACKEND", "gloo")  # the same resolved backend
    (same,) = distributed.run_distributed(_backend_and_pid, world_size=1)
    assert same == first == ("gloo", first[1])
    # As if a GPU test had made this pool for nccl on CUDA: a CPU run gets fresh ranks.
    distributed._POOLS[1].made_for = ("cuda", "nccl")
    (fresh,) = distributed.run_distributed(_backend_and_pid, world_size=1)
    assert fresh[0] == "gloo" and fresh[1] != first[1]


_shared = None


def _compile_at_width(width):
    """One compiled function shared across tasks, as megatron/core/compiled.py shares one
    across layers, called at a shape no earlier task used: (pid, square sum)."""
    global _shared
    if _shared is None:
        _shared = torch.compile(lambda x: (x * x).sum(), fullgraph=True, dynamic=False,
                                backend="eager")  # dynamo's caches, no code generation
    return os.getpid(), _shared(torch.ones(width)).item()


def test_a_pooled_rank_forgets_compiled_code_between_tasks():
    """Twelve tasks in one pooled rank, each compiling the shared function at a new shape:
    dynamo refuses a ninth recompilation of one code object (recompile limit 8), as the GPU
    tier's bf16 PP=2 run was refused; a task starts with no compiled code, as a process."""
    results = [distributed.run_distributed(_compile_at_width, world_size=1, width=w)[0]
               for w in range(1, 13)]
    assert len({pid for pid, _ in results}) == 1  # one pooled process served them all
    assert [total for _, total in results] == [float(w) for w in range(1, 13)]
