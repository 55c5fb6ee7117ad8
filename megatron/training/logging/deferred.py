"""Values the training loop leaves on the device until the log interval.

Reading a device tensor on the host (``.item()``, ``.tolist()``) waits for the GPU's queue to
drain: once per iteration, that stalls every step. The loop keeps its per-iteration reports
(the losses, the gradient norm) on the device and the logger reads those of a whole log
interval with ``read_together``: one device-to-host copy.
"""
from typing import Iterable, List, Optional

import torch

from megatron.core.device import read_together


class DeviceReport:
    """A report still on the device: ``pending()`` is its tensor (None once read);
    ``resolve(numbers)`` takes that tensor's values, read elsewhere, as floats."""

    def pending(self) -> Optional[torch.Tensor]:
        raise NotImplementedError

    def resolve(self, numbers: List[float]) -> None:
        raise NotImplementedError


def resolve_reports(reports: Iterable[DeviceReport]) -> None:
    """Read every pending report at once."""
    waiting = [r for r in reports if isinstance(r, DeviceReport) and r.pending() is not None]
    for report, numbers in zip(waiting, read_together([r.pending() for r in waiting])):
        report.resolve(numbers)


class DeviceScalar(DeviceReport):
    """One number on the device (the gradient norm)."""

    def __init__(self, tensor: torch.Tensor):
        self._tensor, self._value = tensor, None

    def pending(self) -> Optional[torch.Tensor]:
        return self._tensor

    def resolve(self, numbers: List[float]) -> None:
        (self._value,), self._tensor = numbers, None

    def value(self) -> float:
        resolve_reports([self])
        return self._value
