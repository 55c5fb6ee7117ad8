"""FP8 training: configs, current-scaling quantization per recipe, delayed scaling's amax
histories (delayed.py), and FP8 GEMMs."""
from megatron.core.fp8.config import FORMATS, RECIPES, Fp8Config, layer_fp8
from megatron.core.fp8.gemm import fp8_gemm
from megatron.core.fp8.quantize import Quantized, dequantize, quantize

__all__ = ["FORMATS", "RECIPES", "Fp8Config", "Quantized", "dequantize", "fp8_gemm",
           "layer_fp8", "quantize"]
