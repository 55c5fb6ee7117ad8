"""--torch-compile's compilation rules: ``compiled`` for the norms, the activation, RoPE and the
cross entropy (one shape a run), ``compiled_any_shape`` for FP8's quantization (every linear's
shapes)."""
import functools
import types

import torch


@functools.lru_cache(maxsize=None)
def compiled(fn):
    """``fn`` compiled once, shared by all layers: a whole graph (no breaks), static shapes
    (one microbatch shape per run)."""
    return torch.compile(fn, fullgraph=True, dynamic=False)


@functools.lru_cache(maxsize=None)
def compiled_any_shape(fn, key=()):
    """``fn`` compiled with symbolic sizes (``dynamic=True``: one graph serves the 8+ operand
    shapes of a model's linears, where static shapes would pass dynamo's recompile limit of 8
    and fall back to eager), one compiled copy per ``key``. The key names what dynamo would
    otherwise guard on and recompile for (dtypes, a recipe): each key gets its own code
    object, and dynamo keeps its cache, and counts recompiles, per code object."""
    code = fn.__code__.replace(co_name=f"{fn.__name__}_{abs(hash(key)):x}")
    copy = types.FunctionType(code, fn.__globals__, code.co_name, fn.__defaults__,
                              fn.__closure__)
    return torch.compile(copy, fullgraph=True, dynamic=True)
