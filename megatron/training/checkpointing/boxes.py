"""Where a rank's tensor lies in the global (unsharded) tensor, for the sharded format.

A rank's local tensor is its tensor-parallel shard of a global tensor (the whole tensor where
it is replicated). Along the partitioned dimension the local tensor is ``stride`` blocks
(SwiGLU's fc1: gate rows, then up rows), block ``k`` of TP rank ``r`` being rows
``[k * L * tp + r * L, ... + L)`` of the global tensor (L = local block size). So the local
tensor is ``stride`` *boxes* of the global tensor, each a contiguous run of the local tensor's
flat order (the partitioned dimension is the first, or there is one block).

A stored *piece* is a flat range ``[a, b)`` of one box's row-major order: the whole box for
weights, a data-parallel rank's part of it for distributed-optimizer state. Vocabulary
tensors are global without the padding rows (padding depends on TP); padding rows are
neither saved nor read (they load as zeros, as resharding always did).

Copying between a saved piece and a wanted piece is a contiguous copy when their boxes are
the same or differ only along dimension 0 (any re-cut of row-split tensors, any DP size);
otherwise (a column-split tensor read at another TP size) it goes element by element
through global coordinates, in bounded blocks.
"""
import math
from dataclasses import dataclass
from typing import Callable, Iterator, List, Optional, Sequence, Tuple

import torch

from megatron.core.models.tp_sharding import partition_of

_VOCAB_SUFFIXES = ("word_embeddings.weight", "output_layer.weight")
_INDEX_BLOCK = 1 << 20  # elements per block on the element-by-element path (bounded memory)

Shape = Tuple[int, ...]


@dataclass(frozen=True)
class Box:
    """A box of the global tensor: ``offset`` and ``shape`` per dimension."""
    offset: Shape
    shape: Shape

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class Piece:
    """Elements ``[start, stop)`` of ``box`` in row-major order."""
    box: Box
    start: int
    stop: int


@dataclass(frozen=True)
class Placement:
    """How a local tensor of ``local_shape`` sits in its global tensor of ``global_shape``."""
    global_shape: Shape
    local_shape: Shape
    dim: Optional[int] = None  # the TP-partitioned dimension; None: replicated
    stride: int = 1
    tp_size: int = 1
    tp_rank: int = 0

    @property
    def local_numel(self) -> int:
        return math.prod(self.local_shape)

    def local_boxes(self) -> List[Tuple[Box, int]]:
        """(box, first local flat index of the box) for each non-empty box, in local order.
        A box clipped by the vocabulary keeps its local start (its rows come first)."""
        if self.dim is None:
            return [(Box((0,) * len(self.local_shape), self.local_shape), 0)]
        if self.stride > 1 and self.dim != 0:
            raise ValueError("a strided partition must be along dimension 0")
        block = self.local_shape[self.dim] // self.stride
        inner = math.prod(self.local_shape[self.dim + 1:]) if self.dim == 0 else 0
        boxes = []
        for k in range(self.stride):
            begin = (k * self.tp_size + self.tp_rank) * block
            rows = max(0, min(block, self.global_shape[self.dim] - begin))  # vocabulary clip
            if rows == 0:
                continue
            offset = tuple(begin if d == self.dim else 0 for d in range(len(self.local_shape)))
            shape = tuple(rows if d == self.dim else s for d, s in enumerate(self.local_shape))
            boxes.append((Box(offset, shape), k * block * inner))
        return boxes

    def pieces(self, start: int = 0, stop: Optional[int] = None
               ) -> List[Tuple[Piece, int, int]]:
        """The pieces holding local flat elements ``[start, stop)`` (default: all):
        (piece, local start, local stop) with local stop - local start == piece length."""
        stop = math.prod(self.local_shape) if stop is None else stop
        out = []
        for box, first in self.local_boxes():
            lo, hi = max(start, first), min(stop, first + box.numel)
            if lo < hi:
                out.append((Piece(box, lo - first, hi - first), lo, hi))
        return out


def is_vocab(name: str) -> bool:
    return name.endswith(_VOCAB_SUFFIXES)


def placement_of(name: str, local_shape: Sequence[int], gated_mlp: bool, tp_size: int,
                 tp_rank: int, vocab_size: int) -> Placement:
    """The placement of this project's parameter ``name`` (chunk-local or global: only the
    suffix matters) held by TP rank ``tp_rank`` of ``tp_size``."""
    local_shape = tuple(int(s) for s in local_shape)
    part = partition_of(name, gated_mlp)
    if part is None:
        return Placement(local_shape, local_shape)
    dim, stride = part
    global_shape = list(local_shape)
    global_shape[dim] *= tp_size
    if is_vocab(name):
        global_shape[0] = vocab_size
    return Placement(tuple(global_shape), local_shape, dim, stride, tp_size, tp_rank)


# --- copying from saved pieces into a wanted one ---------------------------------------------

Reader = Callable[[int, int], torch.Tensor]  # (start, stop) within the saved piece -> 1-D


def _only_rows_differ(a: Box, b: Box) -> bool:
    return a.offset[1:] == b.offset[1:] and a.shape[1:] == b.shape[1:]


def copy_overlap(out: torch.Tensor, covered: torch.Tensor, wanted: Piece, saved: Piece,
                 read: Reader, global_shape: Shape) -> None:
    """Copy into ``out`` (the wanted piece's 1-D values) what ``saved`` holds of it, and mark
    those elements in ``covered`` (bool, like ``out``); ``read`` gives a range of the saved
    piece's values."""
    if wanted.box == saved.box or (len(global_shape) > 0 and
                                   _only_rows_differ(wanted.box, saved.box)):
        _copy_rows(out, covered, wanted, saved, read)
    elif _whole(wanted) and _whole(saved):
        _copy_box(out, covered, wanted.box, saved.box, read)
    else:
        _copy_by_index(out, covered, wanted, saved, read)


def _whole(piece: Piece) -> bool:
    return piece.start == 0 and piece.stop == piece.box.numel


def _copy_box(out, covered, wanted: Box, saved: Box, read: Reader) -> None:
    """Whole boxes (weights read at another TP size, a whole tensor read offline): slice the
    overlap out of the saved box (read whole: a column cut touches every row)."""
    if not _boxes_meet(wanted, saved):
        return
    lows = [max(w, s) for w, s in zip(wanted.offset, saved.offset)]
    highs = [min(w + ws, s + ss) for w, ws, s, ss in
             zip(wanted.offset, wanted.shape, saved.offset, saved.shape)]
    source = read(0, saved.numel).view(saved.shape)
    into = tuple(slice(lo - o, hi - o) for lo, hi, o in zip(lows, highs, wanted.offset))
    take = tuple(slice(lo - o, hi - o) for lo, hi, o in zip(lows, highs, saved.offset))
    out.view(wanted.shape)[into] = source[take]
    covered.view(wanted.shape)[into] = True


def _copy_rows(out, covered, wanted: Piece, saved: Piece, read: Reader) -> None:
    """Boxes differing at most along dimension 0: the overlap is one contiguous run in both
    pieces' flat order."""
    if not wanted.box.shape:  # a scalar
        lo, hi = max(wanted.start, saved.start), min(wanted.stop, saved.stop)
        if lo < hi:
            out[lo - wanted.start:hi - wanted.start] = read(lo - saved.start, hi - saved.start)
            covered[lo - wanted.start:hi - wanted.start] = True
        return
    inner = math.prod(wanted.box.shape[1:])
    # Flat positions measured from the global row 0 of these boxes' common columns.
    w0, s0 = wanted.box.offset[0] * inner, saved.box.offset[0] * inner
    lo = max(w0 + wanted.start, s0 + saved.start)
    hi = min(w0 + wanted.stop, s0 + saved.stop)
    if lo < hi:
        out[lo - w0 - wanted.start:hi - w0 - wanted.start] = read(lo - s0 - saved.start,
                                                                  hi - s0 - saved.start)
        covered[lo - w0 - wanted.start:hi - w0 - wanted.start] = True


def _unravel(flat: torch.Tensor, shape: Shape) -> List[torch.Tensor]:
    coords = []
    for size in reversed(shape):
        coords.append(flat % size)
        flat = flat // size
    return coords[::-1]


def _blocks(start: int, stop: int) -> Iterator[Tuple[int, int]]:
    for lo in range(start, stop, _INDEX_BLOCK):
        yield lo, min(stop, lo + _INDEX_BLOCK)


def _copy_by_index(out, covered, wanted: Piece, saved: Piece, read: Reader) -> None:
    """The general case, through global coordinates, a bounded block at a time."""
    if not _boxes_meet(wanted.box, saved.box):
        return
    for lo, hi in _blocks(wanted.start, wanted.stop):
        local = _unravel(torch.arange(lo, hi, dtype=torch.int64), wanted.box.shape)
        coords = [c + o for c, o in zip(local, wanted.box.offset)]
        inside = torch.ones(hi - lo, dtype=torch.bool)
        flat = torch.zeros(hi - lo, dtype=torch.int64)
        for c, o, s in zip(coords, saved.box.offset, saved.box.shape):
            inside &= (c >= o) & (c < o + s)
            flat = flat * s + (c - o)
        inside &= (flat >= saved.start) & (flat < saved.stop)
        if not bool(inside.any()):
            continue
        positions = flat[inside] - saved.start
        first, last = int(positions.min()), int(positions.max()) + 1
        values = read(first, last)
        out[lo - wanted.start:hi - wanted.start][inside] = values[positions - first]
        covered[lo - wanted.start:hi - wanted.start][inside] = True


def _boxes_meet(a: Box, b: Box) -> bool:
    return all(ao < bo + bs and bo < ao + as_ for ao, as_, bo, bs in
               zip(a.offset, a.shape, b.offset, b.shape))
