"""tests/gpu's harness on CPU: in-process pretrain() on a rank pool, with pipeline messages
staged through host copies as on the GPU, gives the one-process losses. The GPU tier runs this
machinery with only the device changed, so a mistake in it shows up here first."""
import os

import pytest

from tests.distributed import close_pools
from tests.gpu.harness import last_stage_losses, pretrain_losses, run_on_gpu
from tests.gpu.test_parallel_gpu import (
    FP32_TOL,
    GLOBAL_BATCH,
    LAYOUTS,
    _flags,
    assert_bf16_close,
    fp32_of_bf16_training,
)


def _staged(argv):
    return pretrain_losses(argv, stage_p2p=True)


@pytest.fixture
def cpu_pools(monkeypatch):
    # The tier's own pools are CPU gloo pools (tests/conftest.py): those serve as they are,
    # and respawning costs seconds; others carry another environment.
    cpu_tier = os.environ.get("MEGATRON_DEVICE") == "cpu" and \
        os.environ.get("MEGATRON_DIST_BACKEND", "gloo") == "gloo"
    if not cpu_tier:
        close_pools()
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


def _pretrain_with_fault(fault, **kwargs):
    """pretrain_losses with one bug planted in this rank: an optimizer step that does nothing,
    gradients summed over DP instead of averaged, or parameters never all-gathered after the
    distributed optimizer's step (each rank keeps others' shards stale)."""
    import torch

    from megatron.core.distributed import param_and_grad_buffer as buffers

    if fault == "no-op step":
        torch.optim.SGD.step = lambda self, closure=None: None
    elif fault == "no DP average":
        init = buffers.GradBuffer.__init__

        def summed(self, params, grad_dtype, bucket_size, group, scaling, *args, **kw):
            init(self, params, grad_dtype, bucket_size, group, 1.0, *args, **kw)
        buffers.GradBuffer.__init__ = summed
    elif fault == "stale all-gather":
        buffers.Bucket.start_param_gather = lambda self, async_op: None
    return pretrain_losses(**kwargs)


@pytest.mark.slow  # six bf16 runs and one fp32
def test_bf16_tolerance_of_the_gpu_tier_catches_a_broken_step(cpu_pools):
    """The GPU tier's bf16 check (a share of how far the reference's loss falls on a repeated
    batch) passes the DP=2 distributed-optimizer layout and fails each planted bug; the bf16
    reference passes against the fp32 run of the same training and fails with a no-op step.
    The pools are closed after: the patches live in their ranks."""
    try:
        argv = _flags("bf16")
        (ref,) = run_on_gpu(pretrain_losses, world_size=1, argv=argv, repeat_batch=GLOBAL_BATCH)
        (fp32,) = run_on_gpu(pretrain_losses, world_size=1, argv=fp32_of_bf16_training(),
                             repeat_batch=GLOBAL_BATCH)
        assert_bf16_close(ref["losses"], fp32["losses"], "bf16 vs fp32")
        (noop,) = run_on_gpu(_pretrain_with_fault, world_size=1, fault="no-op step", argv=argv,
                             repeat_batch=GLOBAL_BATCH)
        with pytest.raises(AssertionError):
            assert_bf16_close(noop["losses"], fp32["losses"], "no-op step vs fp32")
        layout = argv + LAYOUTS["dp2_distributed_optimizer"]
        for fault in (None, "no-op step", "no DP average", "stale all-gather"):
            got = last_stage_losses(run_on_gpu(_pretrain_with_fault, world_size=2, fault=fault,
                                               argv=layout, repeat_batch=GLOBAL_BATCH))
            if fault is None:
                assert_bf16_close(got, ref["losses"], "no fault")
            else:
                with pytest.raises(AssertionError):
                    assert_bf16_close(got, ref["losses"], fault)
    finally:
        close_pools()
