"""What FP8 adds to a rank's state: the cached quantized weights of its FP8 layers' linears
(``megatron.core.fp8.linear.weight_cache_bytes`` each), held from a layer's first GEMM of a
step to the next step's. The MoE experts' weights are quantized per call (transient); the
quantized activations and gradients live for one GEMM (not counted, as other GEMM
workspaces are not)."""
import re
from typing import List

from megatron.core.fp8.linear import weight_cache_bytes
from megatron.training.memory.base import ParamShape

_FP8_WEIGHT = re.compile(r"^decoder\.layers\.(\d+)\.(self_attention\.linear_(qkv|proj)|"
                         r"mlp\.(shared_experts\.)?linear_fc[12])\.weight$")


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
    return total
