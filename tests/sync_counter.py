"""Count, on CPU, the calls that would make the host wait for the GPU on CUDA.

    with SyncCounter() as syncs:
        step()
    assert syncs.count <= 1, syncs.calls

A device-to-host read blocks the CPU until the GPU's queue drains: ``.item()``, ``.tolist()``,
``bool``/``int``/``float`` of a tensor, ``.cpu()``/``.numpy()``, ``torch.nonzero``, and ops whose
output size depends on the values (``bincount``, ``repeat_interleave`` with tensor repeats and no
``output_size``, ``unique``, ``masked_select``). On CPU nothing waits, so tests count the calls
instead: the same code on CUDA syncs at least that often. ``calls`` names each one (with the
caller's file and line) so a failing assertion says where they are.
"""
import os
import sys
from typing import List

import torch
from torch.overrides import TorchFunctionMode

_READS = {
    torch.Tensor.item: "item", torch.Tensor.tolist: "tolist", torch.Tensor.__bool__: "bool",
    torch.Tensor.__int__: "int", torch.Tensor.__float__: "float", torch.Tensor.__index__: "index",
    torch.Tensor.cpu: "cpu", torch.Tensor.numpy: "numpy",
    torch.nonzero: "nonzero", torch.Tensor.nonzero: "nonzero",
    torch.bincount: "bincount", torch.Tensor.bincount: "bincount",
    torch.unique: "unique", torch.Tensor.unique: "unique",
    torch.masked_select: "masked_select", torch.Tensor.masked_select: "masked_select",
}
_REPEAT_INTERLEAVE = (torch.repeat_interleave, torch.Tensor.repeat_interleave)


def _value_dependent(func, args, kwargs) -> str:
    if func in _READS:
        return _READS[func]
    if func in _REPEAT_INTERLEAVE:
        repeats = args[1] if len(args) > 1 else kwargs.get("repeats")
        if isinstance(repeats, torch.Tensor) and kwargs.get("output_size") is None:
            return "repeat_interleave without output_size"
    if func in (torch.Tensor.to,) and _to_host(args, kwargs):
        return "to(cpu)"
    return ""


def _to_host(args, kwargs) -> bool:
    target = kwargs.get("device", args[1] if len(args) > 1 else None)
    return isinstance(target, (str, torch.device)) and torch.device(target).type == "cpu"


_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep


def _caller() -> str:
    """The first frame outside this module and torch: the code that asked for the value."""
    frame = sys._getframe(1)
    while frame is not None and (frame.f_code.co_filename == __file__ or
                                 frame.f_code.co_filename.startswith(_TORCH_DIR)):
        frame = frame.f_back
    return f"{frame.f_code.co_filename}:{frame.f_lineno}" if frame is not None else "?"


class SyncCounter(TorchFunctionMode):
    """Counts value-dependent reads of tensors while active (see the module's docstring)."""

    def __init__(self):
        super().__init__()
        self.calls: List[str] = []

    @property
    def count(self) -> int:
        return len(self.calls)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        kind = _value_dependent(func, args, kwargs)
        if kind:
            self.calls.append(f"{kind} at {_caller()}")
        return func(*args, **kwargs)
