"""--fp8-param-gather: the distributed optimizer all-gathers the FP8 linears' weights as FP8
bytes (one a weight element, half of bf16's two), and the forward takes them as its quantized
weight of the step, quantizing nothing.

Each FP8 linear's weight is quantized tensorwise, so one scale per weight. After the step,
every DP rank holds the updated values of its contiguous shard of a bucket, a range that may
cut weights anywhere: per weight in the bucket, a rank takes the absolute maximum of its piece
(0 where it has none), a MAX all-reduce over the bucket's DP group (and over the TP group, as
the layer's own quantization reduces a sharded weight's amax) gives every rank the whole
weight's amax, each rank casts its pieces with that scale (``quantize``'s arithmetic, element
for element) and the FP8 shards are all-gathered into a persistent byte buffer of the
bucket's layout. The weights' forward copies (``Fp8Gemms._weight``'s cache) are then views
of that buffer: bitwise what the layer quantizes from the all-gathered high-precision weight,
so a run with the flag computes exactly what one without it does.

What stays high precision: the optimizer's main params (fp32) and its state, and this rank's
shard of the model's weights (written from the main params each step). The rest of an FP8
weight's high-precision copy is not gathered (that would be the bytes saved): it is stale
until ``gather_high_precision`` all-gathers it, which checkpoint saves do first, so a
checkpoint holds the exact weights whether the flag was on or not.

Only tensorwise: a rowwise dgrad needs the weight's columns scaled as well (a second copy of
the same bytes), blockwise's 128 x 128 blocks span the DP shard boundaries, and delayed
scaling's weight amax history would need the whole weight's amax per step too. Routed experts
keep the high-precision gather (their per-expert weights are quantized per call).
"""
from typing import Dict, List, Tuple

import torch
import torch.distributed as dist

from megatron.core import device
from megatron.core.collectives import all_gather_into_tensor
from megatron.core.fp8.config import fp8_max
from megatron.core.fp8.quantize import TENSORWISE, Quantized, _scale_and_cast, encode_scale


def gathers_in_fp8(param: torch.nn.Parameter) -> bool:
    """Whether ``param`` is an FP8 linear's weight whose recipe can be gathered in FP8 (the
    layers mark their weights: fp8_layers.use_fp8)."""
    gemms = getattr(param, "fp8_gemms", None)
    return gemms is not None and gemms.config.recipe == "tensorwise"


class Fp8ShardGather:
    """One bucket's FP8 copy of its weights: quantize this rank's shard, all-gather, hand each
    weight's FP8 view to its layer's cache."""

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
        self.data = device.empty(numel, dtype=torch.uint8)  # FP8 bytes (gloo has no FP8)
        self.scales = None
        self.handle = None

    def start(self, param_data: torch.Tensor, begin: int, end: int, async_op: bool) -> None:
        """Quantize the shard [begin, end) of ``param_data`` (the bucket's high-precision
        values) with every weight's whole-tensor scale and all-gather the FP8 bytes."""
        amax = device.zeros(len(self.params), dtype=torch.float32)
        pieces = []
        for i, param in enumerate(self.params):
            p_begin, p_end = self.ranges[param]
            lo, hi = max(p_begin, begin), min(p_end, end)
            if lo < hi:
                piece = param_data[lo:hi].view(1, -1)
                amax[i] = torch.linalg.vector_norm(piece, float("inf")).float()
                pieces.append((i, piece, lo - begin))
        # the max over DP of the pieces' maxes: the whole (TP shard of the) weight's
        dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=self.group)
        if self.tp_group is not None:
            dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=self.tp_group)
        encode = encode_scale(amax, self.dtype, self.config.margin)
        self.scales = torch.reciprocal(encode)
        shard = self.data[begin:end]
        top = fp8_max(self.dtype)
        for i, piece, offset in pieces:
            cast, _ = _scale_and_cast(piece, encode[i], TENSORWISE, top, self.dtype, False)
            shard[offset:offset + piece.numel()].copy_(cast.view(-1).view(torch.uint8))
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
        """Each weight's forward operand of this step: its view of the gathered bytes."""
        for i, param in enumerate(self.params):
            p_begin, p_end = self.ranges[param]
            data = self.data[p_begin:p_end].view(self.dtype).view(param.shape)
            param.fp8_gemms.use_weight(param, Quantized(data, self.scales[i].clone(), TENSORWISE))
