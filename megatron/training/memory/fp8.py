"""What FP8 adds to a rank's state: the cached quantized weights of its FP8 layers' linears
(``megatron.core.fp8.linear.weight_cache_bytes`` each), held from a layer's first GEMM of a
step to the next step's. The MoE experts' weights are cached too: under the rowwise recipe
stacked (fp8/experts.py's grouped path: [E x N, K] for the forward, [E x K, N] for dgrad),
under the others expert by expert (``weight_cache_bytes`` of each [N, K]). With
--fp8-param-gather the forward copies are views of the gathered bytes, the same count. The
quantized activations and gradients live for one GEMM (not counted, as other GEMM
workspaces are not)."""
import re
from typing import List

from megatron.core.fp8.linear import weight_cache_bytes
from megatron.training.memory.base import ParamShape
from megatron.training.memory.moe import expert_sizes

_FP8_WEIGHT = re.compile(r"^decoder\.layers\.(\d+)\.(self_attention\.linear_(qkv|proj)|"
                         r"mlp\.(shared_experts\.)?linear_fc[12])\.weight$")
_EXPERT_WEIGHT = re.compile(r"^decoder\.layers\.(\d+)\.mlp\.experts\.weight([12])$")


def _expert_cache(config, shape: ParamShape, which: str, recipe: str) -> int:
    """weight1 [E, 2f, h] or weight2 [E, h, f] (f this expert-TP rank's): each expert's
    [N, K] as a dense weight's (rowwise's stacked copies hold the same bytes and E x (N + K)
    row scales)."""
    h = config.hidden_size
    f = config.moe.moe_ffn_hidden_size // expert_sizes(config)[1]
    rows, cols = (2 * f, h) if which == "1" else (h, f)
    return shape.dim0 * weight_cache_bytes(rows, cols, recipe)


def fp8_weight_cache_bytes(config, shapes: List[ParamShape]) -> int:
    """The cache bytes of the FP8 linear weights among ``shapes`` (one chunk's)."""
    fp8 = getattr(config, "fp8", None)
    if fp8 is None:
        return 0
    total = 0
    for shape in shapes:
        match = _FP8_WEIGHT.match(shape.name)
        if match and fp8.layer_in_fp8(int(match.group(1)) + 1, config.num_layers):
            total += weight_cache_bytes(shape.dim0, shape.numel // shape.dim0, fp8.recipe)
        match = _EXPERT_WEIGHT.match(shape.name)
        if match and fp8.layer_in_fp8(int(match.group(1)) + 1, config.num_layers):
            total += _expert_cache(config, shape, match.group(2), fp8.recipe)
    return total
