"""--torch-compile's one compilation rule, shared by the norms, the activation, RoPE and the
cross entropy."""
import functools

import torch


@functools.lru_cache(maxsize=None)
def compiled(fn):
    """``fn`` compiled once, shared by all layers: a whole graph (no breaks), static shapes
    (one microbatch shape per run)."""
    return torch.compile(fn, fullgraph=True, dynamic=False)
