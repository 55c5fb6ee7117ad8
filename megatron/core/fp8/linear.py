"""The three GEMMs of a linear layer in FP8, for the tensor-parallel layers' autograd function
(which keeps the TP communication, sequence parallelism, gradient-accumulation fusion and the
zero-bubble split; ``tensor_parallel/layers.py``):

    forward   y  = x @ W.T        contracts K: x [M, K] per token, W [N, K] per output row
    dgrad     dx = dy @ W         contracts N: dy [M, N] per token, W.T [K, N]
    wgrad     dW = dy.T @ x       contracts M: dy.T [N, M], x.T [K, M] (tokens contracted)

Operand scalings per recipe (activations and gradients ``act``, the weight ``weight``):
tensorwise both tensorwise; rowwise both rowwise; blockwise 1 x 128 tiles for activations
and gradients, 128 x 128 blocks for the weight. The forward operands are e4m3, the output
gradient e4m3 or (``hybrid``) e5m2. Accumulation is fp32; outputs are in the activation's
dtype.

Quantized once: the weight per optimizer step (cached on the parameter until its version
changes, i.e. until the optimizer writes it), and reused transposed for dgrad where the
recipe's groups transpose exactly (a tensor's scale, a 128 x 128 block's); rowwise needs
the weight's columns scaled, a second quantization of the same step's weight, cached too.
The output gradient is quantized once for dgrad and, transposed the same way, for wgrad
(rowwise and blockwise: again along the tokens). Tensorwise, the input too: the forward
writes x's FP8 and its transpose in one pass (``forward_keeping_input``), and the layer keeps
that for wgrad in place of the high-precision x (half the bytes of a bf16 activation).

Tensor parallelism (``kind`` "column" or "row", ``group`` the TP group): where a scaling group
spans the TP shards (a tensorwise scale of a sharded operand; a row scale along a sharded
contraction: the row-parallel forward's K, the column-parallel dgrad's N) its amax is the MAX
all-reduce over the group, so every rank scales its shard as the unsharded tensor is scaled
and a TP run quantizes the same bytes as one process. Blockwise groups are 128 wide: they
stay inside a shard when the shard sizes are multiples of 128 (checked at start).

Delayed scaling (recipe ``delayed``): tensorwise, and each Fp8Gemms (one per linear then)
holds its linear's ``DelayedScaling``; the input, weight and gradient are cast with their
histories' scales, no amax all-reduce before the cast, and their local amaxes are reduced at
the step boundary instead (fp8/delayed.py).
"""
from typing import Optional

import torch
import torch.distributed as dist
from torch.multiprocessing.reductions import StorageWeakRef

from megatron.core.fp8.config import TILE, Fp8Config
from megatron.core.fp8.delayed import DelayedScaling
from megatron.core.fp8.gemm import fp8_gemm
from megatron.core.fp8.quantize import (
    BLOCKS_128x128,
    ROWWISE,
    TENSORWISE,
    TILES_1x128,
    Quantized,
    group_amax,
    quantize,
)

_SCALINGS = {"tensorwise": (TENSORWISE, TENSORWISE), "delayed": (TENSORWISE, TENSORWISE),
             "rowwise": (ROWWISE, ROWWISE),
             "blockwise": (TILES_1x128, BLOCKS_128x128)}


def _transposed(q: Quantized) -> Quantized:
    """``q`` of the transposed tensor, where its groups transpose exactly (no new scales)."""
    if q.scaling not in (TENSORWISE, BLOCKS_128x128):
        raise ValueError(f"{q.scaling} groups do not transpose")
    scale = q.scale.t().contiguous() if q.scaling == BLOCKS_128x128 else q.scale
    return Quantized(q.data.t().contiguous(), scale, q.scaling)


_GENERATION = [0]  # bumped whenever weights may have changed behind autograd's back


def weights_changed() -> None:
    """Drop every cached quantized weight: the optimizer's step (and anything else that
    writes parameters through ``.data`` or a gathered buffer, which no version counter sees)
    calls this before the new values can reach a forward: the optimizer before the model's
    weights are written or gathered, so --fp8-param-gather's weights belong to the new
    step."""
    _GENERATION[0] += 1


def _storage(weight: torch.Tensor) -> StorageWeakRef:
    """Which storage ``weight`` lives in (a ``.data`` swap changes it), not where its bytes
    are: FSDP2 frees an unsharded weight's bytes after use and gathers it again into the same
    storage at an address that differs from rank to rank, and a cache miss quantizes, which
    all-reduces amaxes over TP, so every rank must miss alike. The weak reference keeps a
    dropped storage's identity from being reused while the cache holds it."""
    return StorageWeakRef(weight.untyped_storage())


def _weight_cache(weight: torch.Tensor) -> dict:
    """``weight``'s cache of this optimizer step: valid while no step has happened
    (``weights_changed``), the parameter's version counter (in-place writes through
    autograd-visible tensors) and its storage (``_storage``) are the same."""
    stamp = (_GENERATION[0], weight._version, _storage(weight))
    cache = getattr(weight, "_fp8_cache", None)
    if cache is None or cache[0] != stamp:
        cache = (stamp, {})
        weight._fp8_cache = cache
    return cache[1]


def _cached_weight(weight: torch.Tensor, key: str, make) -> Quantized:
    """The quantized weight of this optimizer step, per ``key`` (forward, dgrad)."""
    cache = _weight_cache(weight)
    if key not in cache:
        cache[key] = make()
    return cache[key]


def _current(weight: torch.Tensor, expert: Optional[int]) -> torch.Tensor:
    """The values to quantize, detached: ``weight``, or ``weight[expert]`` of the experts'
    stacked one; refused where --fp8-param-gather left the high-precision weight stale
    (param_and_grad_buffer.py): its FP8 copy of the step was dropped, and quantizing the stale
    values would train on other ranks' older weights without a word."""
    if getattr(weight, "fp8_high_precision_stale", False):
        raise RuntimeError("an FP8 weight gathered in FP8 (--fp8-param-gather) lost its FP8 "
                           "copy of this step while its high-precision copy is stale: call "
                           "the model's gather_high_precision_params() first.")
    return (weight if expert is None else weight[expert]).detach()


def weight_cache_bytes(rows: int, cols: int, recipe: str) -> int:
    """The bytes a [rows, cols] weight's cached FP8 copies hold between steps (``_weight`` and
    ``_weight_t``): two copies of one byte an element, and their fp32 scales (tensorwise one
    each; rowwise one a row of W and one a row of W.T; blockwise one a 128 x 128 block
    each)."""
    if recipe in ("tensorwise", "delayed"):
        scales = 1 + 1
    elif recipe == "rowwise":
        scales = rows + cols
    else:
        scales = 2 * (-(-rows // TILE)) * (-(-cols // TILE))
    return 2 * rows * cols + 4 * scales


class Fp8Gemms:
    """The three GEMMs of ``config``'s recipe; inputs and outputs 2-D in high precision.
    ``kind``/``group``: a column- or row-parallel layer's TP sharding (module docstring)."""

    def __init__(self, config: Fp8Config, kind: Optional[str] = None,
                 group: Optional[dist.ProcessGroup] = None, compile: bool = False):
        self.config = config
        self.act, self.weight = _SCALINGS[config.recipe]
        self.kind, self.group = kind, group
        self.compile = compile  # --torch-compile: each quantization's cast as one kernel
        # delayed scaling: this linear's amax histories (one Fp8Gemms per linear then)
        self.delayed = DelayedScaling(config.amax_history_len, config.amax_compute_algo) \
            if config.recipe == "delayed" else None

    def _reduce(self, sharded: bool):
        """The amax all-reduce where this operand's scaling group spans the TP shards."""
        if not sharded or self.group is None or self.act not in (TENSORWISE, ROWWISE):
            return None
        return lambda amax: dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=self.group)

    def _quantize(self, x, dtype, scaling, sharded=False, transpose=False, operand=None):
        """``operand`` (one of delayed.OPERANDS): under delayed scaling, cast with its
        history's scale (current scaling on the first step) and record x's local amax."""
        encode = None
        if self.delayed is not None and operand is not None:
            encode = self.delayed.encode(operand, dtype, self.config.margin, x.device)
        q = quantize(x, dtype, scaling, self.config.margin, self._reduce(sharded),
                     self.compile, transpose, encode)
        if self.delayed is not None and operand is not None:
            q.amax = group_amax(x, TENSORWISE)  # the cached weight's, for each step's record
            self.delayed.record(operand, q.amax)
        return q

    def _key(self, what: str, expert: Optional[int] = None) -> str:
        """The weight cache's key: delayed scaling's scale changes at each step boundary; a
        stacked experts' weight holds one entry per expert."""
        steps = f" {self.delayed.steps}" if self.delayed is not None else ""
        which = "" if expert is None else f" expert {expert}"
        return f"{what}{which} {self.config.recipe} {self.config.margin}{steps}"

    @property
    def _tensorwise(self) -> bool:
        return self.act == TENSORWISE

    def _weight(self, weight: torch.Tensor, expert: Optional[int] = None) -> Quantized:
        """W [N, K] for the forward: a tensor scale spans the shards in both kinds, a row
        scale only along the row-parallel K. ``expert``: W is ``weight[expert]`` of the
        experts' stacked weight, cached on it (fp8/experts.py)."""
        dtype = self.config.forward_dtype
        sharded = self._tensorwise or self.kind == "row"
        q = _cached_weight(weight, self._key("forward", expert),
                           lambda: self._quantize(_current(weight, expert), dtype,
                                                  self.weight, sharded, operand="weight"))
        if self.delayed is not None:  # also where evaluation made the cached copy
            self.delayed.record("weight", q.amax)
        return q

    def _weight_t(self, weight: torch.Tensor, expert: Optional[int] = None) -> Quantized:
        """W.T [K, N] for dgrad (rows along N: sharded in the column-parallel layer)."""
        key = self._key("dgrad", expert)
        if self.weight in (TENSORWISE, BLOCKS_128x128):
            return _cached_weight(weight, key,
                                  lambda: _transposed(self._weight(weight, expert)))
        dtype = self.config.forward_dtype
        return _cached_weight(weight, key, lambda: self._quantize(
            _current(weight, expert).t(), dtype, self.weight, self.kind == "column"))

    def _input(self, x: torch.Tensor, transpose: bool = False) -> Quantized:
        """x [M, K]: K is the row-parallel layer's shard."""
        return self._quantize(x, self.config.forward_dtype, self.act, self.kind == "row",
                              transpose, operand="input")

    def use_weight(self, weight: torch.Tensor, q: Quantized,
                   expert: Optional[int] = None) -> None:
        """``q`` as ``weight``'s (``weight[expert]``'s) forward operand of this step
        (fp8/param_gather.py: the all-gathered FP8 weight, bitwise what ``_weight`` would
        quantize)."""
        _weight_cache(weight)[self._key("forward", expert)] = q

    def forward(self, x: torch.Tensor, weight: torch.Tensor,
                expert: Optional[int] = None) -> torch.Tensor:
        return fp8_gemm(self._input(x), self._weight(weight, expert), x.dtype)

    @property
    def reuses_input(self) -> bool:
        """Whether wgrad can take the forward's quantized input (tensorwise: x's FP8
        transposed is exactly what wgrad quantizes; the other recipes group x.T along the
        tokens, other groups than the forward's)."""
        return self._tensorwise

    def forward_keeping_input(self, x: torch.Tensor, weight: torch.Tensor,
                              rows: Optional[slice] = None):
        """``forward``, and (data, scale) of x's FP8 for wgrad (``reuses_input`` only): x.T
        [K, M], written by the same pass; with ``rows`` (sequence parallelism: this rank's
        shard of the gathered x) those rows of x [m, K], which the backward gathers."""
        xq = self._input(x, transpose=rows is None)
        out = fp8_gemm(xq, self._weight(weight), x.dtype)
        if rows is None:
            return out, (xq.transposed.data, xq.scale)
        return out, (xq.data[rows].clone(), xq.scale)

    def quantize_grad(self, grad: torch.Tensor) -> Quantized:
        """dy [M, N]: N is the column-parallel layer's shard."""
        return self._quantize(grad, self.config.gradient_dtype, self.act,
                              self.kind == "column", operand="grad")

    def dgrad(self, grad: torch.Tensor, weight: torch.Tensor,
              grad_q: Optional[Quantized] = None, expert: Optional[int] = None
              ) -> torch.Tensor:
        gq = grad_q if grad_q is not None else self.quantize_grad(grad)
        return fp8_gemm(gq, self._weight_t(weight, expert), grad.dtype)

    def wgrad(self, grad: torch.Tensor, x: Optional[torch.Tensor], out_dtype: torch.dtype,
              grad_q: Optional[Quantized] = None, kept=None,
              kept_rows: bool = False) -> torch.Tensor:
        """dW [N, K] = grad.T @ x, both [M, *]: the tokens contracted (never TP-sharded: under
        sequence parallelism both arrive gathered), so only tensorwise scales span shards.
        ``kept``: ``forward_keeping_input``'s (data, scale) in place of x, the data x.T [K, M]
        or (``kept_rows``: the gathered rows) x [M, K]."""
        if self._tensorwise:
            gq = _transposed(grad_q if grad_q is not None else self.quantize_grad(grad))
            if kept is not None:
                data, scale = kept
                xq = Quantized(data.t().contiguous() if kept_rows else data, scale,
                               TENSORWISE)
            else:
                xq = _transposed(self._input(x))
        else:
            gq = self._quantize(grad.t(), self.config.gradient_dtype, self.act)
            xq = self._quantize(x.t(), self.config.forward_dtype, self.act)
        return fp8_gemm(gq, xq, out_dtype)
