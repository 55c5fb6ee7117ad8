"""--async-save on CUDA: the reused host buffers are pinned, and an async save taken while
training goes on holds the same tensors as a synchronous save of the same state and resumes
bitwise (tests/unit/test_checkpoint_save.py runs the same on CPU, where it also compares the
files byte for byte; here a sync save records CUDA locations, so tensors are compared)."""
import pytest
import torch

from megatron.training.checkpointing.offline import checkpoint_tensors
from tests.gpu.harness import run_on_gpu
from tests.unit.test_checkpoint_save import _async_and_sync_saves, _resume
from tests.unit.test_data_parallel import _assert_params

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.parametrize("ckpt_format", ["torch_dist"])  # the CPU test runs both formats
@pytest.mark.parametrize("kind,world_size,backend", [
    ("distributed", 1, "nccl"), ("distributed", 2, "gloo"), ("none", 2, "gloo")],
    ids=["distributed-nccl", "distributed-dp2", "plain-dp2"])
def test_async_save_on_cuda_is_pinned_and_round_trips_bitwise(gpu_env, tmp_path, kind,
                                                              world_size, backend, ckpt_format):
    ranks = run_on_gpu(_async_and_sync_saves, world_size=world_size, backend=backend,
                       tp=1, tmp_path=tmp_path, kind=kind, ckpt_format=ckpt_format)
    for (first, second), _, pinned, where in ranks:
        assert where == "cuda"
        assert first and first == second and pinned and all(pinned)
    for iteration in (1, 2):
        name = f"iter_{iteration:07d}"
        want = checkpoint_tensors(str(tmp_path / f"sync{iteration}" / name))
        got = checkpoint_tensors(str(tmp_path / "async" / name))
        assert want.keys() == got.keys() and want
        for key in want:
            assert torch.equal(got[key], want[key]), key
    resumed = run_on_gpu(_resume, world_size=world_size, backend=backend, tp=1,
                         tmp_path=tmp_path, kind=kind)
    for (iteration, got), (_, want, _, _) in zip(resumed, ranks):
        assert iteration == 2
        for a, b in zip(got, want):
            _assert_params(a, b, 0)
