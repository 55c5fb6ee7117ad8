"""--fp8-param-gather: the distributed optimizer all-gathers the FP8 linears' weights as FP8
bytes (one a weight element, half of bf16's two), and the forward takes them as its quantized
weight of the step, quantizing nothing.

Tensorwise, each weight has one scale; blockwise, one a 128 x 128 block. After the step,
every DP rank holds the updated values of its contiguous shard of a bucket, a range that may
cut weights (and blocks) anywhere: per scaling group of each weight in the bucket, a rank
takes the absolute maximum of its part (0 where it has none; a blockwise piece is seen as
whole 128-row blocks padded with zeros), a MAX all-reduce over the bucket's DP group (and
for tensorwise over the TP group, as the layer's own quantization reduces a sharded weight's
amax; a block stays inside a TP shard) gives every rank the whole group's amax, each rank
casts its pieces with those scales (``quantize``'s arithmetic, element for element) and the
FP8 shards are all-gathered into a persistent byte buffer of the bucket's layout. The
weights' forward copies (``Fp8Gemms._weight``'s cache; dgrad's is its transpose in both
recipes) are then views of that buffer: bitwise what the layer quantizes from the
all-gathered high-precision weight, so a run with the flag computes exactly what one
without it does.

What stays high precision: the optimizer's main params (fp32) and its state, and this rank's
shard of the model's weights (written from the main params each step). The rest of an FP8
weight's high-precision copy is not gathered (that would be the bytes saved): it is stale
until ``gather_high_precision_params`` all-gathers it, which checkpoint saves do first, so a
checkpoint holds the exact weights whether the flag was on or not; and an FP8 layer that
lost its copy of the step refuses to quantize a stale weight (fp8/linear.py's ``_current``).

The routed experts' stacked [E, N, K] weights are E matrices, each scaled on its own as
fp8/experts.py quantizes them (tensorwise one scale an expert; blockwise the stack's rows cut
in 128-row blocks, which are each expert's own where N is a multiple of 128, else those
experts keep the high-precision gather), gathered over the expert-DP group and installed
expert by expert.

Delayed scaling (tensorwise): each weight is cast with its amax history's scale, the one
its layer's next forward uses (the training step takes the histories' boundary before the
optimizer step for that), on the first step with its current amax; the installed copy
carries the TP shard's amax (the DP maximum of the pieces'), which the layer records at each
use as it records its own copy's.

Not rowwise: its dgrad needs the weight's columns scaled as well, a second copy of the same
bytes.
"""
import math
from typing import Dict, List, Tuple

import torch
import torch.distributed as dist

from megatron.core import device
from megatron.core.collectives import all_gather_into_tensor
from megatron.core.fp8.config import TILE, fp8_max
from megatron.core.fp8.quantize import (
    BLOCKS_128x128,
    TENSORWISE,
    Quantized,
    _scale_and_cast,
    _tiles,
    encode_scale,
    group_amax,
)


GATHERED_RECIPES = ("tensorwise", "blockwise", "delayed")


def _matrices(param: torch.Tensor) -> Tuple[int, int, int]:
    """(E, N, K): a linear's [N, K] weight is one matrix, the experts' stacked [E, N, K] E."""
    return (param.shape[0] if param.dim() == 3 else 1), param.shape[-2], param.shape[-1]


def gathers_in_fp8(param: torch.nn.Parameter) -> bool:
    """Whether ``param`` is an FP8 linear's (or the experts') weight whose recipe can be
    gathered in FP8 (the layers mark their weights: fp8_layers.use_fp8). Stacked experts
    under blockwise only where each expert's rows are whole 128-row blocks (the rows of the
    stack are then cut into blocks as each expert's are)."""
    gemms = getattr(param, "fp8_gemms", None)
    if gemms is None or gemms.config.recipe not in GATHERED_RECIPES:
        return False
    experts, rows, _ = _matrices(param)
    return experts == 1 or gemms.config.recipe == "tensorwise" or rows % TILE == 0


def _block_rows(piece: torch.Tensor, lo: int, cols: int):
    """The piece at flat offset ``lo`` of a row-major [rows, cols] weight, as whole 128-row
    blocks: zeros before it back to the start of its first block of rows and after it to the
    end of its last (zeros change no block's amax). (view [R, cols], R a multiple of 128;
    the first block row; the zeros before the piece)."""
    block0 = lo // cols // TILE
    front = lo - block0 * TILE * cols
    span = TILE * cols
    padded = piece.new_zeros(-(-(front + piece.numel()) // span) * span)
    padded[front:front + piece.numel()] = piece
    return padded.view(-1, cols), block0, front


class Fp8ShardGather:
    """One bucket's FP8 copy of its weights: quantize this rank's shard, all-gather, hand each
    weight's FP8 view to its layer's cache. The scales (tensorwise one a matrix: a weight, or
    each expert of a stacked one; blockwise one a 128 x 128 block, the experts' stacked rows
    cut as one [E x N, K] matrix) are kept flat, all of the bucket's in one vector: one amax
    all-reduce."""

    def __init__(self, param_ranges: Dict[torch.nn.Parameter, Tuple[int, int]], numel: int,
                 group):
        self.params: List[torch.nn.Parameter] = list(param_ranges)
        self.ranges = param_ranges
        self.group = group
        gemms = [p.fp8_gemms for p in self.params]
        self.config = gemms[0].config
        self.tp_group = gemms[0].group
        if any(g.config != self.config or g.group is not self.tp_group for g in gemms):
            raise ValueError("an FP8-gathered bucket mixes FP8 configs or TP groups")
        self.dtype = self.config.forward_dtype
        self.scaling = gemms[0].weight  # TENSORWISE or BLOCKS_128x128
        self.grids = []
        for param in self.params:
            experts, rows, cols = _matrices(param)
            self.grids.append((experts,) if self.scaling == TENSORWISE else
                              (_tiles(experts * rows), _tiles(cols)))
        self.offsets = [0]
        for grid in self.grids:
            self.offsets.append(self.offsets[-1] + math.prod(grid))
        self.data = device.empty(numel, dtype=torch.uint8)  # FP8 bytes (gloo has no FP8)
        self.scales = None
        self.handle = None

    def _grid(self, flat: torch.Tensor, i: int) -> torch.Tensor:
        return flat[self.offsets[i]:self.offsets[i + 1]].view(self.grids[i])

    def _pieces(self, i: int, piece: torch.Tensor, lo: int):
        """Weight ``i``'s ``piece`` from its flat offset ``lo``, cut where its scales are:
        (rows to cast [r, cols], index into its grid, zeros before the piece's values in
        them, their offset in ``piece``, their count). Tensorwise: each expert's part as one
        row; blockwise: whole 128-row blocks (``_block_rows``)."""
        experts, rows, cols = _matrices(self.params[i])
        if self.scaling != TENSORWISE:
            padded, block0, front = _block_rows(piece, lo, cols)
            return [(padded, block0, front, 0, piece.numel())]
        size = rows * cols
        out = []
        for e in range(lo // size, min(experts, -(-(lo + piece.numel()) // size))):
            a, b = max(lo, e * size) - lo, min(lo + piece.numel(), (e + 1) * size) - lo
            out.append((piece[a:b].view(1, -1), e, 0, a, b - a))
        return out

    def start(self, param_data: torch.Tensor, begin: int, end: int, async_op: bool) -> None:
        """Quantize the shard [begin, end) of ``param_data`` (the bucket's high-precision
        values) with every matrix's whole-tensor (or whole-block) scales and all-gather the
        FP8 bytes."""
        amax = device.zeros(self.offsets[-1], dtype=torch.float32)
        pieces = []  # (weight, rows to cast, grid index, zeros before, shard offset, count)
        for i, param in enumerate(self.params):
            p_begin, p_end = self.ranges[param]
            lo, hi = max(p_begin, begin), min(p_end, end)
            if lo >= hi:
                continue
            for rows, at, front, offset, size in self._pieces(i, param_data[lo:hi],
                                                               lo - p_begin):
                grid = self._grid(amax, i)
                if self.scaling == TENSORWISE:
                    grid[at] = torch.linalg.vector_norm(rows, float("inf")).float()
                else:
                    blocks = group_amax(rows, BLOCKS_128x128)
                    grid[at:at + blocks.shape[0]] = blocks
                pieces.append((i, rows, at, front, lo - begin + offset, size))
        # the max over DP of the pieces' maxes: the whole matrix's (block's), and for a
        # tensorwise scale over the TP shards too, as the layer's own quantization
        dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=self.group)
        self.local_amax = amax.clone()  # delayed scaling records the TP shard's
        if self.tp_group is not None and self.scaling == TENSORWISE:
            dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=self.tp_group)
        encode = encode_scale(amax, self.dtype, self.config.margin)
        if self.config.recipe == "delayed":  # each weight's history, once it has one
            for i, param in enumerate(self.params):
                history = param.fp8_gemms.delayed.encode("weight", self.dtype,
                                                         self.config.margin, amax.device)
                if history is not None:
                    encode[self.offsets[i]] = history
        self.scales = torch.reciprocal(encode)
        shard = self.data[begin:end]
        top = fp8_max(self.dtype)
        for i, rows, at, front, offset, size in pieces:
            grid = self._grid(encode, i)
            grid = grid[at] if self.scaling == TENSORWISE else \
                grid[at:at + rows.shape[0] // TILE]
            cast, _ = _scale_and_cast(rows, grid, self.scaling, top, self.dtype, False)
            shard[offset:offset + size].copy_(cast.view(-1)[front:front + size].view(
                torch.uint8))
        self.handle = all_gather_into_tensor(self.data, shard, group=self.group,
                                             async_op=async_op)
        if not async_op:
            self.handle = None
            self._install()

    def wait(self) -> None:
        if self.handle is not None:
            self.handle.wait()
            self.handle = None
            self._install()

    def _install(self) -> None:
        """Each matrix's forward operand of this step: its view of the gathered bytes."""
        for i, param in enumerate(self.params):
            experts, rows, cols = _matrices(param)
            begin = self.ranges[param][0]
            grid = self._grid(self.scales, i)
            blocks = _tiles(rows)
            for e in range(experts):
                at = begin + e * rows * cols
                data = self.data[at:at + rows * cols].view(self.dtype).view(rows, cols)
                if data.data_ptr() % 16:  # cuBLASLt's FP8 GEMMs take 16-byte aligned operands
                    data = data.clone()
                scale = grid[e] if self.scaling == TENSORWISE else \
                    grid[e * blocks:(e + 1) * blocks]
                q = Quantized(data, scale.clone(), self.scaling)
                if self.config.recipe == "delayed":  # what the layer records at each use
                    q.amax = self._grid(self.local_amax, i)[e].clone()
                param.fp8_gemms.use_weight(param, q, e if param.dim() == 3 else None)
