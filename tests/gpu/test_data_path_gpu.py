"""The data path and the timers on CUDA: no host sync per microbatch (CUDA's sync debug mode
raises on any), pinned loader batches, timers that wait for the device only when read."""
import pytest
import torch

from tests.gpu.harness import run_on_gpu

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

MBS, SEQ = 2, 8


class _Tokens(torch.utils.data.Dataset):
    def __len__(self):
        return 64

    def __getitem__(self, index):
        return {"text": torch.arange(index, index + SEQ + 1) % 5}  # EOD (0) every 5 tokens


def _microbatches_without_sync():
    from megatron.training.data.batch import get_batch
    from megatron.training.data.samplers import build_pretraining_data_loader
    from megatron.training.gpt_step import loss_func

    loader = build_pretraining_data_loader(_Tokens(), 0, micro_batch_size=MBS, num_workers=0)
    iterator = iter(loader)
    first = next(iterator)
    pinned = first["text"].is_pinned()
    iterator = iter([first] + [next(iterator) for _ in range(3)])
    losses = []
    torch.cuda.set_sync_debug_mode("error")  # any synchronizing call raises
    try:
        for _ in range(4):
            _, labels, loss_mask, _, position_ids = get_batch(iterator, 0, True, True, True,
                                                              MBS, SEQ)
            loss, reported = loss_func(loss_mask, labels.float())
            losses.append(reported["lm loss"])
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return pinned, labels.device.type, position_ids[0].tolist(), [float(x) for x in losses]


def test_get_batch_and_loss_need_no_host_sync(gpu_env):
    (pinned, where, positions, losses), = run_on_gpu(_microbatches_without_sync, world_size=1,
                                                     backend="nccl", tp=1)
    assert pinned and where == "cuda"
    # The last microbatch's first sample is 6: tokens 1 2 3 4 0 1 2 3, EOD at index 4.
    assert positions == [0, 1, 2, 3, 4, 0, 1, 2]
    assert all(x > 0 for x in losses)


def _timers_without_sync():
    from megatron.training.logging.timers import Timers

    timers = Timers(log_level=2)
    a = torch.randn(2048, 2048, device="cuda")
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):
            timers("forward-compute", log_level=2).start()
            for _ in range(10):
                a = (a @ a).tanh_()
            timers("forward-compute").stop()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return timers.get_elapsed(["forward-compute"])["forward-compute"]


def test_timers_record_events_and_wait_only_when_read(gpu_env):
    (seconds,) = run_on_gpu(_timers_without_sync, world_size=1, backend="nccl")
    assert seconds > 0
