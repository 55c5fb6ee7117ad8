"""Which global ranks form each process group of a layout (pure: no communication).

Rank order is Megatron's: ``global_rank = tp_rank + cp_rank * TP + dp_rank * TP * CP +
pp_rank * TP * CP * DP`` (see parallel_state). ``rank_layout`` lists every group of every kind;
parallel_state creates them and answers the rank queries.
"""
import itertools
from typing import Dict, List

TENSOR = "tensor"
PIPELINE = "pipeline"
DATA = "data"
DATA_GLOO = "data_gloo"
MODEL = "model"
EMBEDDING = "embedding"
POSITION_EMBEDDING = "position_embedding"
TENSOR_AND_DATA = "tensor_and_data"
TENSOR_AND_DATA_CONTEXT = "tensor_and_data_with_context"
TENSOR_AND_CONTEXT = "tensor_and_context"
CONTEXT = "context"
DATA_CONTEXT = "data_with_context"
DATA_CONTEXT_GLOO = "data_with_context_gloo"


def rank_layout(world_size: int, tensor_model_parallel_size: int,
                pipeline_model_parallel_size: int, context_parallel_size: int = 1
                ) -> Dict[str, List[List[int]]]:
    """Every group of every kind as lists of global ranks (pure; no communication)."""
    tp, pp, cp = tensor_model_parallel_size, pipeline_model_parallel_size, context_parallel_size
    dp = world_size // (tp * pp * cp)

    def rank(t, c, d, p):
        return t + c * tp + d * tp * cp + p * tp * cp * dp

    def every(*sizes):
        return itertools.product(*(range(n) for n in sizes))

    pipeline = sorted([rank(t, c, d, p) for p in range(pp)]
                      for t, c, d in every(tp, cp, dp))
    embedding = [sorted({ranks[0], ranks[-1]}) for ranks in pipeline]
    return {
        TENSOR: sorted([rank(t, c, d, p) for t in range(tp)] for c, d, p in every(cp, dp, pp)),
        CONTEXT: sorted([rank(t, c, d, p) for c in range(cp)]
                         for t, d, p in every(tp, dp, pp)),
        DATA: sorted([rank(t, c, d, p) for d in range(dp)] for t, c, p in every(tp, cp, pp)),
        DATA_CONTEXT: sorted([rank(t, c, d, p) for d in range(dp) for c in range(cp)]
                              for t, p in every(tp, pp)),
        PIPELINE: pipeline,
        MODEL: sorted(sorted(rank(t, c, d, p) for p in range(pp) for t in range(tp))
                       for c, d in every(cp, dp)),
        EMBEDDING: embedding,
        POSITION_EMBEDDING: [[ranks[0]] for ranks in pipeline],
        TENSOR_AND_DATA: sorted([rank(t, c, d, p) for d in range(dp) for t in range(tp)]
                                 for c, p in every(cp, pp)),
        # The ranks that split one micro batch's tokens (TP under SP, CP), without and with
        # the DP replicas: the MoE router sums its token counts over them.
        TENSOR_AND_CONTEXT: sorted([rank(t, c, d, p) for c in range(cp) for t in range(tp)]
                                    for d, p in every(dp, pp)),
        TENSOR_AND_DATA_CONTEXT: sorted([rank(t, c, d, p) for d in range(dp) for c in range(cp)
                                          for t in range(tp)] for (p,) in every(pp)),
    }
