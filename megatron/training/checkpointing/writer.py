"""Running a save's file writes now or in the background, and publishing it once complete.

Every rank submits its writes (possibly none) for each save. Synchronously, the writes run at
once. With ``async_save`` they run on a thread while training continues; ``poll()`` (every
iteration, on every rank) asks all ranks whether theirs are done with one small all-reduce,
and when all are, the save is published. The next save and the end of training wait for the
pending one. A save is published (``finalize``: the directory rename and the tracker file)
only after every rank's writes succeeded; a failed write raises on every rank and leaves the
previous checkpoint the latest.

An async save writes host copies taken at save time (``HostBuffers``): allocated by the first
save and reused by every later one (pinned on CUDA), filled by non_blocking device-to-host
copies; the writer thread waits for them (one event), so training is held up only while the
copies are issued, not while they run or while files are written. The sharded format copies
only the bytes this rank writes; ``torch.save`` files need whole storages.
"""
import bisect
import math
import threading
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from megatron.core import device
from megatron.training.checkpointing.disk_space import DiskFullError
from megatron.training.checkpointing.paths import CheckpointError


class HostBuffers:
    """Host copies of a save's tensors, one buffer per storage, kept for the next save.

    Buffers are named by where their tensor sits in the checkpoint (the same names every
    save), so the second save reuses the first one's memory. A snapshot copies whole storages
    and rebuilds each tensor as the same view of the copy: ``torch.save`` then writes the same
    bytes as for the live tensors (it too writes whole storages)."""

    def __init__(self):
        self.buffers: Dict[str, torch.Tensor] = {}  # name -> uint8 host tensor
        self._ours = set()  # data_ptr of every buffer
        self._taken = set()  # names filled by the current save

    def start(self) -> None:
        """A new save: every buffer may be filled again."""
        self._taken = set()

    def _buffer(self, name: str, nbytes: int) -> torch.Tensor:
        if name in self._taken:  # two tensors in one buffer would overwrite each other
            raise RuntimeError(f"checkpoint snapshot: the name {name} is used twice")
        self._taken.add(name)
        buffer = self.buffers.get(name)
        if buffer is None or buffer.numel() != nbytes:  # new, or the model changed shape
            if buffer is not None:
                self._ours.discard(buffer.data_ptr())
            buffer = self.buffers[name] = device.host_empty(nbytes, dtype=torch.uint8)
            self._ours.add(buffer.data_ptr())
        return buffer

    def tensor(self, name: str, shape, dtype: torch.dtype) -> torch.Tensor:
        """A host tensor of that shape and dtype in the buffer ``name`` (to be filled)."""
        nbytes = math.prod(shape) * dtype.itemsize
        return self._buffer(name, nbytes).view(dtype).view(shape)

    def snapshot(self, tree, name: str = "", whole_storages: bool = True):
        """``tree`` with every tensor replaced by its copy in a host buffer (copies issued
        non_blocking: record an event before reading them). Tensors already in our buffers
        (filled by ``tensor()``) are kept as they are.

        ``whole_storages``: for ``torch.save``, which writes each tensor's whole storage.
        False (the sharded format writes only each tensor's own bytes): only the byte ranges
        the tensors read are copied, packed into one buffer per storage. A DP rank's share of
        the distributed optimizer's parameter buffer (views of one storage) then costs its
        share, not the whole buffer."""
        leaves: List[Tuple[str, torch.Tensor]] = []
        _rebuild(tree, name, lambda x, path: leaves.append((path, x.detach())))
        by_storage: Dict[tuple, List[Tuple[str, torch.Tensor]]] = {}
        for path, x in leaves:
            storage = x.untyped_storage()
            if storage.nbytes() == 0 or storage.data_ptr() in self._ours or \
                    (not whole_storages and x.numel() == 0):
                continue
            by_storage.setdefault((storage.device, storage.data_ptr()), []).append((path, x))
        views = {}  # path -> the tensor's copy
        for tensors in by_storage.values():
            views.update(self._copy_storage(tensors, whole_storages))
        return _rebuild(tree, name, lambda x, path: views.get(path, x.detach()))

    def _copy_storage(self, tensors, whole_storages: bool) -> Dict[str, torch.Tensor]:
        """Copy what ``tensors`` (views of one storage, with their paths) read into the buffer
        named by the first one's path; each tensor's view of the copy, by path."""
        storage = tensors[0][1].untyped_storage()
        ranges = [(0, storage.nbytes())] if whole_storages else \
            _merged([_byte_span(x) for _, x in tensors])
        placed, nbytes = _packed(ranges)
        host = self._buffer(tensors[0][0], nbytes)
        whole = torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)
        for (lo, hi), at in zip(ranges, placed):
            host[at:at + hi - lo].copy_(whole[lo:hi], non_blocking=True)
        views = {}
        for path, x in tensors:
            begin = x.storage_offset() * x.element_size()
            i = bisect.bisect_right([lo for lo, _ in ranges], begin) - 1
            offset = placed[i] + begin - ranges[i][0]
            views[path] = torch.empty(0, dtype=x.dtype).set_(
                host.untyped_storage(), offset // x.element_size(), x.shape, x.stride())
        return views


_ALIGN = 16  # bytes: a range lands at its old address modulo this, so every dtype stays aligned


def _byte_span(x: torch.Tensor) -> Tuple[int, int]:
    """[first, end) bytes of its storage that ``x`` reads (non-empty ``x``, any strides)."""
    extent = 1 + sum((n - 1) * stride for n, stride in zip(x.shape, x.stride()))
    begin = x.storage_offset() * x.element_size()
    return begin, begin + extent * x.element_size()


def _merged(spans: List[Tuple[int, int]]) -> List[Tuple[int, int]]:
    """Sorted, overlapping or touching spans joined."""
    out: List[List[int]] = []
    for lo, hi in sorted(spans):
        if out and lo <= out[-1][1]:
            out[-1][1] = max(out[-1][1], hi)
        else:
            out.append([lo, hi])
    return [(lo, hi) for lo, hi in out]


def _packed(ranges: List[Tuple[int, int]]) -> Tuple[List[int], int]:
    """Where each range goes in one buffer (at its old address modulo _ALIGN), and the size."""
    placed, end = [], 0
    for lo, hi in ranges:
        at = end + (lo - end) % _ALIGN
        placed.append(at)
        end = at + hi - lo
    return placed, end


def _rebuild(value, path: str, replace: Callable[[torch.Tensor, str], torch.Tensor]):
    """``value`` with each tensor replaced by ``replace(tensor, path)``; every tensor gets a
    path of its own (the keys and indices that lead to it)."""
    if torch.is_tensor(value):
        return replace(value, path)
    if isinstance(value, dict):
        return {k: _rebuild(v, f"{path}/{k}", replace) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_rebuild(v, f"{path}/{i}", replace) for i, v in enumerate(value))
    return value


class _Pending:
    def __init__(self, write: Callable[[], None], finalize: Callable[[], None], background,
                 ready=None, abort: Optional[Callable[[], None]] = None,
                 previous: Optional[Callable[[], str]] = None):
        self.finalize = finalize
        self.abort = abort
        self.previous = previous or (lambda: "the previous checkpoint remains the latest")
        self.error: Optional[str] = None
        self.disk_full = False
        self.thread = None
        if background:
            self.thread = threading.Thread(target=self._run, args=(write, ready), daemon=True,
                                           name="checkpoint-writer")
            self.thread.start()
        else:
            self._run(write, ready)

    def _run(self, write, ready):
        try:
            device.wait_event(ready)  # the device-to-host copies of the snapshot
            write()
        except DiskFullError as exc:  # its message is the whole story
            self.error, self.disk_full = str(exc), True
        except Exception as exc:  # reported on every rank by _complete
            self.error = f"{type(exc).__name__}: {exc}"

    def done(self) -> bool:
        return self.thread is None or not self.thread.is_alive()


class CheckpointWriter:
    def __init__(self, async_save: bool = False):
        self.async_save = async_save
        self._pending: Optional[_Pending] = None
        self.host = HostBuffers()  # used by async saves only

    @property
    def pending(self) -> bool:
        return self._pending is not None

    def submit(self, write: Callable[[], None], finalize: Callable[[], None],
               ready=None, abort: Optional[Callable[[], None]] = None,
               previous: Optional[Callable[[], str]] = None) -> None:
        """``ready``: an event (``device.record_event()``) the writes must wait for.
        ``abort``: called on every rank when any rank's writes failed (to remove them).
        ``previous()``: what stays the latest checkpoint then, asked only on failure (the
        pending save this one waits for may publish meanwhile)."""
        self.wait()
        self._pending = _Pending(write, finalize, background=self.async_save, ready=ready,
                                 abort=abort, previous=previous)
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
        dist.all_gather_object(errors, (pending.error, pending.disk_full))
        failed = [(rank, e, full) for rank, (e, full) in enumerate(errors) if e is not None]
        if failed:
            if pending.abort is not None:
                pending.abort()
            rank, error, disk_full = failed[0]
            previous = pending.previous()
            if disk_full:
                raise DiskFullError(f"{error}; {previous}.")
            raise CheckpointError(f"saving the checkpoint failed on rank {rank} ({error}); "
                                  f"{previous}.")
        dist.barrier()
        pending.finalize()
        dist.barrier()
