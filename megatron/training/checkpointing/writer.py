"""Running a save's file writes now or in the background, and publishing it once complete.

Every rank submits its writes (possibly none) for each save. Synchronously, the writes run at
once. With ``async_save`` they run on a thread while training continues; ``poll()`` (every
iteration, on every rank) asks all ranks whether theirs are done with one small all-reduce,
and when all are, the save is published. The next save and the end of training wait for the
pending one. A save is published (``finalize``: the directory rename and the tracker file)
only after every rank's writes succeeded; a failed write raises on every rank and leaves the
previous checkpoint the latest.
"""
import threading
from typing import Callable, Optional

import torch
import torch.distributed as dist

from megatron.core import device

from megatron.training.checkpointing.paths import CheckpointError


class _Pending:
    def __init__(self, write: Callable[[], None], finalize: Callable[[], None], background):
        self.finalize = finalize
        self.error: Optional[str] = None
        self.thread = None
        if background:
            self.thread = threading.Thread(target=self._run, args=(write,), daemon=True,
                                           name="checkpoint-writer")
            self.thread.start()
        else:
            self._run(write)

    def _run(self, write):
        try:
            write()
        except Exception as exc:  # reported on every rank by _complete
            self.error = f"{type(exc).__name__}: {exc}"

    def done(self) -> bool:
        return self.thread is None or not self.thread.is_alive()


class CheckpointWriter:
    def __init__(self, async_save: bool = False):
        self.async_save = async_save
        self._pending: Optional[_Pending] = None

    @property
    def pending(self) -> bool:
        return self._pending is not None

    def submit(self, write: Callable[[], None], finalize: Callable[[], None]) -> None:
        self.wait()
        self._pending = _Pending(write, finalize, background=self.async_save)
        if not self.async_save:
            self._complete()

    def poll(self) -> bool:
        """Publish the pending save if every rank has finished writing; True if it was."""
        if self._pending is None:
            return False
        done = device.tensor([1 if self._pending.done() else 0], dtype=torch.int32)
        dist.all_reduce(done, op=dist.ReduceOp.MIN)
        if done.item() == 1:
            self._complete()
            return True
        return False

    def wait(self) -> None:
        """Block until the pending save (if any) is written everywhere and published."""
        if self._pending is not None:
            if self._pending.thread is not None:
                self._pending.thread.join()
            self._complete()

    def _complete(self) -> None:
        pending, self._pending = self._pending, None
        errors = [None] * dist.get_world_size()
        dist.all_gather_object(errors, pending.error)
        failed = [(rank, e) for rank, e in enumerate(errors) if e is not None]
        if failed:
            rank, error = failed[0]
            raise CheckpointError(f"saving the checkpoint failed on rank {rank} ({error}); the "
                                  f"previous checkpoint remains the latest.")
        dist.barrier()
        pending.finalize()
        dist.barrier()
