"""Peak bytes of the tensor storages a block of code allocates, on any device (CPU included).

    with track_allocations() as track:
        result = optimizer.state_dict()
    track.finish()          # after the block, with what it returned still referenced
    track.peak_temporary    # most bytes alive at once among storages freed by the end

Every aten op run on this thread inside the block is seen (a TorchDispatchMode): an op's
output whose storage is none of its inputs' is a new allocation (factories, copies, the output
buffers handed to collectives, ``torch.tensor(...)``); it is freed when its storage dies (storages keep their Python
object while alive, so a finalizer fires exactly then). Temporaries are the storages that no
longer exist at ``finish()``; the others (what the block returned or installed) are reported
as ``kept``. Not seen: memory a backend allocates outside aten on its own threads (gloo's
internal staging copies; nccl has none). Seen late: a collective's buffers that the backend's
thread releases after the call returned (``finish`` waits for them to settle).
"""
import contextlib
import gc
import time
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class _Tracker(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.events = []  # ("alloc", id, nbytes) / ("free", id)
        self._alive = {}  # id -> (storage weakref, nbytes)
        self._next = 0
        self.peak_temporary = None
        self.kept = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        # torch.tensor(data) builds its tensor below this mode and hands it to lift_fresh.
        fresh = func is torch.ops.aten.lift_fresh.default
        inputs = set() if fresh else {t.untyped_storage().data_ptr()
                                      for t in tree_leaves((args, kwargs))
                                      if isinstance(t, torch.Tensor)}
        out = func(*args, **kwargs)
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                if storage.data_ptr() not in inputs and storage.nbytes() > 0 and \
                        not any(ref() is storage for ref, _ in self._alive.values()):
                    self._record(storage)
        return out

    def _record(self, storage):
        key, self._next = self._next, self._next + 1
        self._alive[key] = (weakref.ref(storage), storage.nbytes())
        self.events.append(("alloc", key, storage.nbytes()))
        weakref.finalize(storage, self._freed, key)

    def _freed(self, key):
        self._alive.pop(key, None)
        self.events.append(("free", key))

    def finish(self, settle_s: float = 0.05, limit_s: float = 2.0):
        """Call after the block, holding what it returned: computes the figures. A backend
        may release a collective's buffers on its own thread just after the call returned
        (gloo's work objects): wait until no storage has died for ``settle_s`` (at most
        ``limit_s``), so such a buffer counts as the temporary it is, not as kept."""
        gc.collect()
        start = last_change = time.monotonic()
        alive = len(self._alive)
        while time.monotonic() - last_change < settle_s and time.monotonic() - start < limit_s:
            time.sleep(0.005)
            gc.collect()
            if len(self._alive) != alive:
                alive, last_change = len(self._alive), time.monotonic()
        kept = set(self._alive)
        sizes = {e[1]: e[2] for e in self.events if e[0] == "alloc"}
        live = peak = 0
        for event in self.events:
            if event[1] in kept:
                continue
            live += sizes[event[1]] if event[0] == "alloc" else -sizes[event[1]]
            peak = max(peak, live)
        self.peak_temporary = peak
        self.kept = sum(sizes[k] for k in kept)
        return self


@contextlib.contextmanager
def track_allocations():
    tracker = _Tracker()
    with tracker:
        yield tracker
