"""Which transformer layers each pipeline stage and virtual chunk holds (pure, no torch).

Layers are split evenly over the pipeline ranks, except where the split is told about the
heavier ends: explicit layer counts for the first and/or last stage, or (Megatron's
``account_for_embedding/loss_in_pipeline_split``) the embedding and the loss each counted as
one layer, so the first and last virtual stage get one layer fewer. With virtual stages, chunk
``c`` of rank ``r`` is the ``(c * PP + r)``-th slice of the model, as in Megatron, or under the
V placement (``pipeline_placement``) chunk 0 is slice ``r`` and chunk 1 slice ``2PP - 1 - r``.
"""
from typing import List, Optional, Tuple

from megatron.core.pipeline_placement import LOOP, V, virtual_stage_of


def _even(layers: int, parts: int, what: str, fix: str) -> int:
    if parts and (layers < parts or layers % parts):
        raise ValueError(f"{what} ({layers}) cannot be split evenly over {parts} pipeline "
                         f"stages; change {fix}.")
    return layers // parts if parts else 0


def _check_placement_split(placement: str, first_stage_layers: Optional[int],
                           last_stage_layers: Optional[int]) -> None:
    # First/last stage counts are per rank of the loop; under the V rank 0 holds both ends.
    if placement == V and (first_stage_layers is not None or last_stage_layers is not None):
        raise ValueError("first/last pipeline stage layer counts do not apply to the V "
                         "placement (rank 0 holds both the first and the last stage); use "
                         "the embedding/loss accounting in the split instead.")


def virtual_stage_sizes(num_layers: int, pipeline_size: int,
                        first_stage_layers: Optional[int] = None,
                        last_stage_layers: Optional[int] = None,
                        virtual_size: Optional[int] = None,
                        account_for_embedding: bool = False,
                        account_for_loss: bool = False) -> List[int]:
    """Layers of each virtual stage v = c * PP + r, in model order; ValueError naming the fix
    if they cannot split."""
    vsize = virtual_size or 1
    stages = pipeline_size * vsize
    if account_for_embedding or account_for_loss:
        if first_stage_layers is not None or last_stage_layers is not None:
            raise ValueError("give either first/last stage layer counts or account for the "
                             "embedding/loss in the split, not both.")
        extra = int(account_for_embedding) + int(account_for_loss)
        per = _even(num_layers + extra, stages, "num_layers plus the embedding/loss counted as "
                    "layers", "--num-layers or the pipeline (or virtual) size")
        sizes = [per] * stages
        sizes[0] -= int(account_for_embedding)
        sizes[-1] -= int(account_for_loss)
        if min(sizes) < 1:
            raise ValueError("a virtual stage would hold no transformer layer; use more layers "
                             "or fewer pipeline stages.")
        return sizes

    counts = stage_layer_counts(num_layers, pipeline_size, first_stage_layers,
                                last_stage_layers, virtual_size)
    return [counts[v % pipeline_size] // vsize for v in range(stages)]


def stage_layer_counts(num_layers: int, pipeline_size: int,
                       first_stage_layers: Optional[int] = None,
                       last_stage_layers: Optional[int] = None,
                       virtual_size: Optional[int] = None,
                       account_for_embedding: bool = False,
                       account_for_loss: bool = False,
                       placement: str = LOOP) -> List[int]:
    """Layers held by each pipeline rank; ValueError (naming the fix) if they cannot split."""
    _check_placement_split(placement, first_stage_layers, last_stage_layers)
    if account_for_embedding or account_for_loss:
        sizes = virtual_stage_sizes(num_layers, pipeline_size, first_stage_layers,
                                    last_stage_layers, virtual_size, account_for_embedding,
                                    account_for_loss)
        return [sum(sizes[virtual_stage_of(r, c, pipeline_size, virtual_size, placement)]
                    for c in range(virtual_size or 1)) for r in range(pipeline_size)]
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
    if rest_stages == 0 and rest_layers != 0:
        raise ValueError(f"first + last stage layers ({num_layers - rest_layers}) must equal "
                         f"num_layers ({num_layers}) with pipeline size 2.")
    if overrides:
        per_stage = _even(rest_layers, rest_stages,
                          "the layers left after the first/last stage overrides",
                          "--num-layers, --pipeline-model-parallel-size or the first/last "
                          "stage layer counts")
    else:
        per_stage = _even(num_layers, pipeline_size, "num_layers",
                          "--num-layers or --pipeline-model-parallel-size")
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
                      last_stage_layers: Optional[int] = None,
                      account_for_embedding: bool = False,
                      account_for_loss: bool = False,
                      placement: str = LOOP) -> Tuple[int, int]:
    """(start, end) of the layers of virtual chunk ``chunk`` on pipeline rank ``rank``, its
    virtual stage given by ``placement`` (pipeline_placement.LOOP or V)."""
    if not 0 <= chunk < (virtual_size or 1):
        raise ValueError(f"chunk {chunk} out of range [0, {virtual_size or 1}).")
    _check_placement_split(placement, first_stage_layers, last_stage_layers)
    sizes = virtual_stage_sizes(num_layers, pipeline_size, first_stage_layers,
                                last_stage_layers, virtual_size, account_for_embedding,
                                account_for_loss)
    v = virtual_stage_of(rank, chunk, pipeline_size, virtual_size, placement)
    start = sum(sizes[:v])
    return start, start + sizes[v]
