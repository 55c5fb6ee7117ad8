"""tests/sync_counter.py: what it counts as a device-to-host read, and what it does not."""
import torch

from tests.sync_counter import SyncCounter


def test_counts_each_value_read_and_names_where():
    x = torch.arange(6.0)
    repeats = torch.ones(6, dtype=torch.long)
    with SyncCounter() as syncs:
        x.sum().item()
        x.tolist()
        bool(x[0])
        int(x[1])
        torch.bincount(repeats)
        torch.nonzero(x)
        x.repeat_interleave(repeats)
        x.to("cpu")
    assert [call.split(" at ")[0] for call in syncs.calls] == [
        "item", "tolist", "bool", "int", "bincount", "nonzero",
        "repeat_interleave without output_size", "to(cpu)"]
    assert all(f" at {__file__}:" in call for call in syncs.calls), syncs.calls


def test_device_side_work_is_not_counted():
    x = torch.arange(6.0)
    repeats = torch.ones(6, dtype=torch.long)
    with SyncCounter() as syncs:
        y = (x * 2).float().sum()
        x.repeat_interleave(repeats, output_size=6)
        x.repeat_interleave(2)
        torch.zeros(3).scatter_add_(0, torch.tensor([0, 1, 1]), torch.ones(3))
        torch.clamp(y, max=1.0)
    assert syncs.count == 0, syncs.calls
