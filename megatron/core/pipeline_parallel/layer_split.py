"""Which transformer layers each pipeline stage and virtual chunk holds (pure, no torch).

Layers are split evenly over the pipeline ranks, except that the first and last stage may be
given their own counts (the embedding and the output layer make those stages heavier). With
virtual stages, each rank's layers are split evenly over its chunks, and chunk ``c`` of rank
``r`` is the ``(c * PP + r)``-th slice of the model, as in Megatron.
"""
from typing import List, Optional, Tuple


def stage_layer_counts(num_layers: int, pipeline_size: int,
                       first_stage_layers: Optional[int] = None,
                       last_stage_layers: Optional[int] = None,
                       virtual_size: Optional[int] = None) -> List[int]:
    """Layers held by each pipeline rank; ValueError (naming the fix) if they cannot split."""
    overrides = {0: first_stage_layers, pipeline_size - 1: last_stage_layers}
    overrides = {rank: n for rank, n in overrides.items() if n is not None}
    if overrides and pipeline_size < 2:
        raise ValueError("first/last pipeline stage layer counts need pipeline-model-parallel "
                         "size >= 2.")
    for rank, n in overrides.items():
        if n < 1:
            raise ValueError(f"pipeline stage {rank} would hold {n} layers; give it at least 1.")
    rest_layers = num_layers - sum(overrides.values())
    rest_stages = pipeline_size - len(overrides)
    if rest_stages == 0:
        if rest_layers != 0:
            raise ValueError(f"first + last stage layers ({num_layers - rest_layers}) must equal "
                             f"num_layers ({num_layers}) with pipeline size 2.")
        per_stage = 0
    elif rest_layers < rest_stages or rest_layers % rest_stages:
        what = "the layers left after the first/last stage overrides" if overrides \
            else "num_layers"
        raise ValueError(
            f"{what} ({rest_layers}) cannot be split evenly over {rest_stages} pipeline stages; "
            f"change --num-layers or --pipeline-model-parallel-size"
            f"{' or the first/last stage layer counts' if overrides else ''}.")
    else:
        per_stage = rest_layers // rest_stages
    counts = [overrides.get(rank, per_stage) for rank in range(pipeline_size)]
    if virtual_size is not None:
        for rank, n in enumerate(counts):
            if n % virtual_size:
                raise ValueError(
                    f"pipeline stage {rank} holds {n} layers, which do not split evenly over "
                    f"{virtual_size} virtual stages; num_layers must be a multiple of "
                    f"PP x virtual stages, or change --num-layers-per-virtual-pipeline-stage.")
    return counts


def chunk_layer_range(num_layers: int, pipeline_size: int, rank: int, chunk: int = 0,
                      virtual_size: Optional[int] = None,
                      first_stage_layers: Optional[int] = None,
                      last_stage_layers: Optional[int] = None) -> Tuple[int, int]:
    """(start, end) of the layers of virtual chunk ``chunk`` on pipeline rank ``rank``."""
    counts = stage_layer_counts(num_layers, pipeline_size, first_stage_layers,
                                last_stage_layers, virtual_size)
    vsize = virtual_size or 1
    if not 0 <= chunk < vsize:
        raise ValueError(f"chunk {chunk} out of range [0, {vsize}).")
    # Slices in model order: virtual stage v = c * PP + r has counts[r] / vsize layers.
    sizes = [counts[v % pipeline_size] // vsize for v in range(pipeline_size * vsize)]
    v = chunk * pipeline_size + rank
    start = sum(sizes[:v])
    return start, start + sizes[v]
