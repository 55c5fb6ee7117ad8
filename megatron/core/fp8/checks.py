"""What an FP8 run needs, checked at start: one line naming the problem and the fix, or None."""
from typing import Iterable, Optional, Tuple

from megatron.core.fp8.config import TILE

CUDA_ALIGNMENT = 16  # cuBLAS's FP8 GEMMs: every dimension a multiple of 16


def fp8_gemm_sizes(config, tokens: int) -> Iterable[Tuple[str, int]]:
    """(what, size) of every dimension the transformer layers' FP8 GEMMs see on one rank:
    the three operands' rows and columns of QKV, the output projection, fc1 and fc2, and the
    tokens of a microbatch (the weight gradient contracts them)."""
    tp = config.tensor_model_parallel_size
    heads, groups, d = config.num_attention_heads, config.num_query_groups, config.kv_channels
    ffn = config.ffn_hidden_size
    yield "--hidden-size", config.hidden_size
    yield "the QKV projection's rows per TP rank", (heads + 2 * groups) * d // tp
    yield "the attention output's columns per TP rank", heads * d // tp
    yield "--ffn-hidden-size per TP rank", ffn // tp
    yield "tokens per microbatch (--micro-batch-size x --seq-length / CP)", tokens


def fp8_unsupported_reason(config, device_type: str, capability: Optional[Tuple[int, int]],
                           tokens: int) -> Optional[str]:
    """Why ``config.fp8`` cannot train on this device, or None. CPU runs the GEMMs through
    torch's reference kernels (the tests' path) and takes any size."""
    fp8 = config.fp8
    if fp8 is None or device_type != "cuda":
        return None
    if capability is not None and capability < (8, 9):
        return (f"--fp8-format needs FP8 tensor cores (compute capability 8.9 or newer: Ada, "
                f"Hopper, Blackwell); this GPU is sm{capability[0]}{capability[1]}. Drop "
                f"--fp8-format to train in bf16.")
    if fp8.layers_at_start_in_high_precision + fp8.layers_at_end_in_high_precision >= \
            config.num_layers:
        return None  # the end layers in high precision cover them all: no FP8 GEMM runs
    align, why = CUDA_ALIGNMENT, "cuBLAS's FP8 GEMMs need multiples of 16"
    if fp8.recipe == "blockwise":
        align, why = TILE, "the blockwise recipe's 128-wide tiles need multiples of 128"
    for what, size in fp8_gemm_sizes(config, tokens):
        if size % align:
            return (f"{what} is {size}, which FP8 cannot tile: {why}. Choose sizes that are, "
                    f"or another --fp8-recipe, or drop --fp8-format.")
    return None
