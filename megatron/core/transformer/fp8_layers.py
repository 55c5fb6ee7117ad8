"""Which layers of a transformer layer run their GEMMs in FP8 (``use_fp8``): the place that
knows both the layers (tensor_parallel, moe) and FP8's GEMMs (megatron/core/fp8), so neither
has to import the other."""
import torch

from megatron.core.fp8.config import Fp8Config
from megatron.core.fp8.linear import Fp8Gemms


def use_fp8(module: torch.nn.Module, config: Fp8Config, compile: bool = False) -> int:
    """Run the GEMMs of every column- and row-parallel linear in ``module``, and of the MoE
    experts' projections (fp8/experts.py), in FP8; returns how many modules. The router
    stays in high precision (it is neither). ``compile``: --torch-compile's switch (the
    quantizations' casts compiled, fp8/quantize.py)."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.moe.experts import SwiGLUExperts

    group = parallel_state.get_tensor_model_parallel_group() \
        if parallel_state.get_tensor_model_parallel_world_size() > 1 else None
    etp_group = None
    if parallel_state.expert_parallel_is_initialized() and \
            parallel_state.get_expert_tensor_parallel_world_size() > 1:
        etp_group = parallel_state.get_expert_tensor_parallel_group()
    # The experts' fc1 is split over the expert-TP ranks by rows, fc2 by columns: as a
    # column- and a row-parallel linear, over the expert-TP group.
    gemms = {ColumnParallelLinear: Fp8Gemms(config, "column", group, compile),
             RowParallelLinear: Fp8Gemms(config, "row", group, compile),
             SwiGLUExperts: (Fp8Gemms(config, "column", etp_group, compile),
                             Fp8Gemms(config, "row", etp_group, compile))}
    count = 0
    for layer in module.modules():
        if type(layer) in gemms:
            if config.recipe == "delayed":
                if type(layer) is SwiGLUExperts:
                    raise ValueError("--fp8-recipe delayed does not cover the MoE experts' "
                                     "GEMMs yet: use --fp8-recipe tensorwise with MoE")
                # each linear its own amax histories (fp8/delayed.py)
                layer.fp8 = Fp8Gemms(config, gemms[type(layer)].kind,
                                     gemms[type(layer)].group, compile)
            else:
                layer.fp8 = gemms[type(layer)]
            # --fp8-param-gather finds the weights by this (fp8/param_gather.py)
            if type(layer) is SwiGLUExperts:
                layer.weight1.fp8_gemms, layer.weight2.fp8_gemms = layer.fp8
            else:
                layer.weight.fp8_gemms = layer.fp8
            count += 1
    return count
