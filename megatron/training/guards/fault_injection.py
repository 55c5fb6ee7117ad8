"""Deliberate failures for tests of what survives a crash or a bad step.

``MEGATRON_FAULT_INJECTION="KIND:RANK:ITERATIONS"`` (ITERATIONS: ``7`` or ``3-5``), for global
rank RANK:

- ``save``: SIGKILL (as the OOM killer or a lost node would) in the middle of writing the
  checkpoint of that iteration: its file is half written and not yet renamed;
- ``nan``: NaN in every gradient that rank's optimizer reads at those iterations, after the
  gradients are reduced and before the optimizer step (the update must be skipped and
  logged). Every one, not one element: a distributed optimizer reads only its shard;
- ``kill``: SIGKILL at the start of that iteration.

A fault fires only in a job's first attempt: a worker group that torchrun restarted
(``TORCHELASTIC_RESTART_COUNT`` > 0) runs clean, so a test sees one fault and the recovery.
A comma-separated list plans one fault per attempt (``kill:1:7,save:1:10``: the first attempt
is killed at iteration 7, the restarted one while saving iteration 10, the third runs clean),
so one job shows a chain of recoveries.
"""
import os
import signal
from typing import List, Optional, Tuple

ENV = "MEGATRON_FAULT_INJECTION"
_KINDS = ("save", "nan", "kill")


def _parse(spec: str) -> Tuple[str, int, range]:
    parts = spec.split(":")
    bounds = parts[2].split("-") if len(parts) == 3 else []
    if len(parts) != 3 or parts[0] not in _KINDS or not parts[1].isdigit() or \
            not 1 <= len(bounds) <= 2 or not all(b.isdigit() for b in bounds):
        raise ValueError(f"{ENV}={spec!r} is not KIND:RANK:ITERATION[-ITERATION] with KIND one "
                         f"of {', '.join(_KINDS)} (e.g. save:1:4, nan:0:3-5); unset it to run "
                         f"normally.")
    return parts[0], int(parts[1]), range(int(bounds[0]), int(bounds[-1]) + 1)


def planned_fault() -> Optional[Tuple[str, int, range]]:
    """The fault planned for this attempt of the job (torchrun's restart count), if any."""
    spec = os.environ.get(ENV)
    faults = [_parse(part) for part in spec.split(",")] if spec else []
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    return faults[attempt] if attempt < len(faults) else None


def _active(kind: str, iteration: int) -> bool:
    fault = planned_fault()
    return fault is not None and fault[0] == kind and iteration in fault[2] and \
        int(os.environ.get("RANK", "0")) == fault[1]


def _kill_self() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def maybe_kill_at(iteration: int) -> None:
    if _active("kill", iteration):
        _kill_self()


def maybe_crash_while_writing(path: str, iteration: int) -> None:
    """Called with a fully written but not yet renamed file: truncate it and die."""
    if not _active("save", iteration):
        return
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)
    _kill_self()


def _gradient_the_step_reads(param):
    """The gradient the optimizer will read for ``param``: our DDP's ``main_grad``; under
    --shard-gradients (its full buffer freed after the reduction) this rank's
    ``main_grad_shard``; FSDP2's ``.grad`` is a DTensor: its local shard."""
    for grad in (getattr(param, "main_grad", None), getattr(param, "main_grad_shard", None),
                 param.grad):
        if grad is not None and hasattr(grad, "to_local"):
            grad = grad.to_local()
        if grad is not None and grad.numel() > 0:
            return grad
    return None


def maybe_poison_gradients(model_chunks: List, iteration: int) -> None:
    """Called between the gradient reduction and the optimizer step."""
    if not _active("nan", iteration):
        return
    for chunk in model_chunks:
        for param in chunk.parameters():
            grad = _gradient_the_step_reads(param)
            if grad is not None:
                grad.fill_(float("nan"))
