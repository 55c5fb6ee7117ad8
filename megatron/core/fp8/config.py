"""What an FP8 run is: the format, the scaling recipe and the layers left in high precision
(Megatron's --fp8-format / --fp8-recipe / --fp8-margin / --first-last-layers-bf16 flags).

Formats (the OCP FP8 types torch has): e4m3 (``torch.float8_e4m3fn``, largest finite 448, 3
mantissa bits) for every operand, or ``hybrid``: e4m3 for the forward's operands (activations
and weights) and e5m2 (``torch.float8_e5m2``, largest 57344, 2 mantissa bits, the range
gradients need) for the output gradient in both backward GEMMs.

Recipes, all with current (just-in-time) scaling: each operand's scale comes from its own
absolute maximum at the moment it is quantized.
- ``tensorwise``: one scale per tensor.
- ``rowwise``: one scale per row of each GEMM operand along the contraction dimension (a
  token's activations, a weight's output row; for the weight gradient's GEMM the tokens are
  contracted, so activations and gradients are scaled per column there).
- ``blockwise`` (DeepSeek-V3): activations and gradients in 1 x 128 tiles along the
  contraction dimension, weights in 128 x 128 blocks.

And ``delayed`` (TransformerEngine's DelayedScaling): tensorwise, each operand's scale from an
amax history of the previous optimizer steps (``amax_history_len`` steps, ``most_recent``
or ``max`` of them; fp8/delayed.py).
"""
from dataclasses import dataclass
from typing import Optional

import torch

FORMATS = ("e4m3", "hybrid")
RECIPES = ("tensorwise", "rowwise", "blockwise", "delayed")
AMAX_COMPUTE_ALGOS = ("most_recent", "max")
TILE = 128  # the blockwise recipe's tile and block edge

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2


@dataclass(frozen=True)
class Fp8Config:
    format: str = "e4m3"
    recipe: str = "tensorwise"
    # Scales leave 2^margin of headroom below the format's largest value (Megatron's
    # --fp8-margin): amax maps to max / 2^margin.
    margin: int = 0
    # Transformer layers at each end kept in high precision (--num-layers-at-{start,end}-in-bf16
    # under --first-last-layers-bf16).
    layers_at_start_in_high_precision: int = 0
    layers_at_end_in_high_precision: int = 0
    # delayed only (Megatron's --fp8-amax-history-len, --fp8-amax-compute-algo and defaults)
    amax_history_len: int = 1
    amax_compute_algo: str = "most_recent"

    def __post_init__(self):
        if self.format not in FORMATS:
            raise ValueError(f"fp8 format {self.format!r} is not one of {', '.join(FORMATS)}")
        if self.recipe not in RECIPES:
            raise ValueError(f"fp8 recipe {self.recipe!r} is not one of {', '.join(RECIPES)}")
        if self.format == "hybrid" and self.recipe == "blockwise":
            raise ValueError("--fp8-format hybrid is not available with --fp8-recipe blockwise "
                             "(its 1 x 128 and 128 x 128 scales are for e4m3 operands, as in "
                             "DeepSeek-V3): use --fp8-format e4m3, or --fp8-recipe tensorwise "
                             "or rowwise for e5m2 gradients")
        if self.amax_history_len < 1:
            raise ValueError(f"--fp8-amax-history-len must be >= 1, got "
                             f"{self.amax_history_len}")
        if self.amax_compute_algo not in AMAX_COMPUTE_ALGOS:
            raise ValueError(f"--fp8-amax-compute-algo {self.amax_compute_algo!r} is not one "
                             f"of {', '.join(AMAX_COMPUTE_ALGOS)}")
        if self.margin < 0:
            raise ValueError(f"--fp8-margin must be >= 0, got {self.margin}")

    @property
    def forward_dtype(self) -> torch.dtype:
        return E4M3

    @property
    def gradient_dtype(self) -> torch.dtype:
        return E5M2 if self.format == "hybrid" else E4M3

    def layer_in_fp8(self, layer_number: int, num_layers: int) -> bool:
        """Whether transformer layer ``layer_number`` (1-based, global) runs its GEMMs in
        FP8."""
        return (self.layers_at_start_in_high_precision < layer_number
                <= num_layers - self.layers_at_end_in_high_precision)


def fp8_max(dtype: torch.dtype) -> float:
    return float(torch.finfo(dtype).max)


def layer_fp8(config, layer_number: int) -> Optional[Fp8Config]:
    """The FP8 config a transformer layer's linears use (None: high precision)."""
    fp8 = getattr(config, "fp8", None)
    if fp8 is None or not fp8.layer_in_fp8(layer_number, config.num_layers):
        return None
    return fp8
