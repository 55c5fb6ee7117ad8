"""tests/gpu's harness on CPU: in-process pretrain() on a rank pool, with pipeline messages
staged through host copies as on the GPU, gives the one-process losses. The GPU tier runs this
machinery with only the device changed, so a mistake in it shows up here first."""
import pytest

from tests.gpu.harness import close_pools, last_stage_losses, pretrain_losses, run_on_gpu
from tests.gpu.test_parallel_gpu import FP32_TOL, LAYOUTS, _flags


def _staged(argv):
    return pretrain_losses(argv, stage_p2p=True)


@pytest.fixture
def cpu_pools(monkeypatch):
    close_pools()  # pools of this harness carry their backend's environment
    monkeypatch.setenv("MEGATRON_DEVICE", "cpu")
    monkeypatch.setenv("MEGATRON_DIST_BACKEND", "gloo")
    yield
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
