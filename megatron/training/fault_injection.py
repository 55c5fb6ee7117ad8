"""Deliberate failures for tests of what survives a crash.

``MEGATRON_FAULT_INJECTION="save:RANK:ITERATION"`` kills global rank RANK (SIGKILL, as the
OOM killer or a lost node would) in the middle of writing the checkpoint of ITERATION: its
file is half written and not yet renamed.
"""
import os
import signal
from typing import Optional, Tuple

ENV = "MEGATRON_FAULT_INJECTION"
_KINDS = ("save",)


def _parse(spec: str) -> Tuple[str, int, int]:
    parts = spec.split(":")
    if len(parts) != 3 or parts[0] not in _KINDS or not all(p.isdigit() for p in parts[1:]):
        raise ValueError(f"{ENV}={spec!r} is not KIND:RANK:ITERATION with KIND one of "
                         f"{', '.join(_KINDS)} (e.g. save:1:4); unset it to run normally.")
    return parts[0], int(parts[1]), int(parts[2])


def planned_fault() -> Optional[Tuple[str, int, int]]:
    spec = os.environ.get(ENV)
    return _parse(spec) if spec else None


def _kill_self() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def maybe_crash_while_writing(path: str, iteration: int) -> None:
    """Called with a fully written but not yet renamed file: truncate it and die."""
    fault = planned_fault()
    if fault is None or fault[0] != "save" or fault[2] != iteration or \
            int(os.environ.get("RANK", "0")) != fault[1]:
        return
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)
    _kill_self()
