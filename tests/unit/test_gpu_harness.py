"""tests/gpu's harness on CPU: in-process pretrain() on a rank pool, with pipeline messages
staged through host copies as on the GPU, gives the one-process losses. The GPU tier runs this
machinery with only the device changed, so a mistake in it shows up here first."""
import os

import pytest

from tests.gpu.harness import adopt_pools, close_pools, last_stage_losses, pretrain_losses, run_on_gpu
from tests.gpu.test_parallel_gpu import FP32_TOL, LAYOUTS, _flags


def _staged(argv):
    return pretrain_losses(argv, stage_p2p=True)


@pytest.fixture
def cpu_pools(monkeypatch):
    # Pools of this harness carry their backend's environment. The tier's own pools are CPU
    # gloo pools (tests/conftest.py): those serve as they are, and respawning costs seconds.
    cpu_tier = os.environ.get("MEGATRON_DEVICE") == "cpu" and \
        os.environ.get("MEGATRON_DIST_BACKEND", "gloo") == "gloo"
    adopt_pools("gloo") if cpu_tier else close_pools()
    monkeypatch.setenv("MEGATRON_DEVICE", "cpu")
    monkeypatch.setenv("MEGATRON_DIST_BACKEND", "gloo")
    yield
    if not cpu_tier:
        close_pools()


def test_tp2_and_staged_interleaved_pp2_equal_one_process_on_cpu(cpu_pools):
    (ref,) = run_on_gpu(pretrain_losses, world_size=1, timeout=120, argv=_flags("fp32"))
    assert len(ref["losses"]) == 6 and ref["device"] == "cpu"
    # TP=2 evaluates (every 3 iterations) on a TP rank that holds no data iterator.
    for layout in ("tp2", "pp2_interleaved"):
        got = last_stage_losses(run_on_gpu(_staged, world_size=2, timeout=120,
                                           argv=_flags("fp32") + LAYOUTS[layout]))
        assert len(got) == 6
        for a, b in zip(got, ref["losses"]):
            assert abs(a - b) <= FP32_TOL, (layout, got, ref["losses"])


def test_attention_workers_of_the_gpu_tier_run_on_cpu(cpu_pools, monkeypatch):
    """The GPU tier's attention test, run on CPU as it is (its layers read parallel_state:
    the first GPU run found it calling without a layout), and its packed-documents worker
    (on CPU both of its paths are one SDPA per document: equal)."""
    from tests.gpu import test_attention_gpu
    from tests.gpu.test_attention_gpu import _packed, test_default_attention_runs_flash_in_bf16

    def on_gloo(fn, world_size, backend="gloo", **kwargs):  # nccl needs CUDA tensors
        return run_on_gpu(fn, world_size, backend="gloo", **kwargs)

    monkeypatch.setattr(test_attention_gpu, "run_on_gpu", on_gloo)
    test_default_attention_runs_flash_in_bf16(gpu_env=None)
    (_, _, out_diff, grad_diff), = run_on_gpu(_packed, world_size=1, tp=1, timeout=120,
                                              seq_length=256, docs=4)
    assert out_diff == 0 and grad_diff == 0
