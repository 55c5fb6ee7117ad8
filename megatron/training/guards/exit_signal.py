"""Signals that stop a run.

``--exit-signal-handler``: a SIGTERM (what Slurm sends before a job's time limit or a
preemption) or a SIGINT (Ctrl-C) makes every rank finish its iteration, save, and exit 0.
The handler only records the signal; the loop asks all ranks after each iteration (one small
all-reduce), so every rank stops at the same iteration even if only some got the signal.

Without the flag a Ctrl-C stops at once: ``Interrupted`` is raised in the main thread and
pretrain reports it in one line (exit 130). ``interrupted()`` says a SIGINT arrived, so that
what it broke on the way (a peer's closed connection) is not reported as another error.
"""
import os
import signal
import threading
from typing import Optional

import torch
import torch.distributed as dist

from megatron.core import device
from megatron.training.guards.errors import TRACEBACK_ENV

SIGINT_EXIT_CODE = 128 + signal.SIGINT  # what shells and schedulers expect of a Ctrl-C
_interrupted = False


class Interrupted(KeyboardInterrupt):
    """A SIGINT stopped the run where it was."""


def interrupted() -> bool:
    return _interrupted


def _raise_interrupted(signum, frame) -> None:
    global _interrupted
    if _interrupted:  # torchrun forwards the terminal's SIGINT: a second one while stopping
        return
    _interrupted = True
    _silence_thread_errors()
    raise Interrupted()


def _silence_thread_errors() -> None:
    """After a Ctrl-C, what breaks in background threads on the way out (the data loader's
    fd-sharing thread losing a worker's connection) is a consequence, not a second error:
    not printed, unless MEGATRON_TRACEBACK asks for every traceback."""
    if not os.environ.get(TRACEBACK_ENV):
        threading.excepthook = lambda args: None


def install_sigint_handler():
    """Ctrl-C raises Interrupted (recorded by ``interrupted()``); returns the previous handler
    (for ``signal.signal`` to restore)."""
    global _interrupted
    _interrupted = False
    return signal.signal(signal.SIGINT, _raise_interrupted)


class ExitSignal:
    def __init__(self, enabled: bool, signums=(signal.SIGTERM, signal.SIGINT)):
        self.enabled = enabled
        self._received = 0  # the signal's number, 0 while none came
        if enabled:
            for signum in signums:
                signal.signal(signum, self._handler)

    def _handler(self, signum, frame) -> None:
        # A repeated signal changes nothing: under torchrun each rank gets the terminal's
        # SIGINT and torchrun's forwarded copy, and both mean "save and stop".
        self._received = signum

    def received_on_any_rank(self) -> Optional[str]:
        """The signal's name (e.g. 'SIGTERM') if any rank got one, else None. Collective."""
        if not self.enabled:
            return None
        flag = device.tensor([int(self._received)], dtype=torch.int32)  # nccl: on GPU
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        signum = int(flag.item())
        return signal.Signals(signum).name if signum else None
