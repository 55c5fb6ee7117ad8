"""Count the torch.distributed collectives our code issues (patched on torch.distributed)."""
import collections
import contextlib

import torch.distributed as dist

# torch.distributed name -> kind counted (the flat-tensor variants count as their kind).
_KINDS = {
    "all_reduce": "all_reduce",
    "all_gather": "all_gather",
    "all_gather_into_tensor": "all_gather",
    "all_gather_single": "all_gather",
    "reduce_scatter": "reduce_scatter",
    "reduce_scatter_tensor": "reduce_scatter",
    "reduce_scatter_single": "reduce_scatter",
    "broadcast": "broadcast",
    "all_to_all": "all_to_all",
    "all_to_all_single": "all_to_all",
    "send": "p2p", "recv": "p2p", "isend": "p2p", "irecv": "p2p",
    "batch_isend_irecv": "p2p",
}


@contextlib.contextmanager
def count_collectives():
    """Yields a Counter of collective kinds called through torch.distributed inside the block."""
    counts = collections.Counter()
    originals = {}
    for name, kind in _KINDS.items():
        fn = getattr(dist, name, None)
        if fn is None:
            continue
        originals[name] = fn

        def counted(*args, _fn=fn, _kind=kind, **kwargs):
            counts[_kind] += 1
            return _fn(*args, **kwargs)

        setattr(dist, name, counted)
    try:
        yield counts
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)
