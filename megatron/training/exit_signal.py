"""``--exit-signal-handler``: a SIGTERM (what Slurm sends before a job's time limit or a
preemption) makes every rank finish its iteration, save, and exit 0.

The handler only records the signal; the loop asks all ranks after each iteration (one small
all-reduce), so every rank stops at the same iteration even if only some got the signal.
"""
import signal

import torch
import torch.distributed as dist

from megatron.core import device


class ExitSignal:
    def __init__(self, enabled: bool, signum: int = signal.SIGTERM):
        self.enabled = enabled
        self.signum = signum
        self._received = False
        if enabled:
            signal.signal(signum, self._handler)

    def _handler(self, signum, frame) -> None:
        self._received = True

    def received_on_any_rank(self) -> bool:
        if not self.enabled:
            return False
        flag = device.tensor([1 if self._received else 0], dtype=torch.int32)  # nccl: on GPU
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())
