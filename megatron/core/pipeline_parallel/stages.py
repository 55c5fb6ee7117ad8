"""Building this rank's model chunks: which layers, and whether it holds the embedding
(first stage) and the output layer and loss (last stage). Each chunk holds the layers of its
virtual stage (pipeline_placement: the loop, or the V of the zbv schedule), so layer numbers,
initial weights and checkpoint names are those of the whole model on one process."""
from typing import Callable, List

import torch

from megatron.core import parallel_state
from megatron.core.pipeline_parallel.layer_split import chunk_layer_range
from megatron.core.pipeline_parallel.tied_embeddings import sync_tied_embedding_weights
from megatron.core.pipeline_placement import placement_for_schedule


def build_model_chunks(model_provider: Callable[..., torch.nn.Module], config
                       ) -> List[torch.nn.Module]:
    """One model per virtual chunk of this pipeline rank (one chunk without virtual stages).

    ``model_provider(pre_process=..., post_process=..., layer_range=(start, end))`` builds a
    chunk; ``config`` (a TransformerConfig) gives the layer count and any uneven first/last
    stage sizes and the schedule, whose placement (loop or V) parallel_state's stage queries
    answer for from here on. A tied embedding on the last stage is made equal to the first
    stage's.
    """
    pipeline_size = parallel_state.get_pipeline_model_parallel_world_size()
    rank = parallel_state.get_pipeline_model_parallel_rank()
    virtual_size = parallel_state.get_virtual_pipeline_model_parallel_world_size()
    if virtual_size != config.virtual_pipeline_model_parallel_size and \
            config.virtual_pipeline_model_parallel_size is not None:
        raise ValueError(f"the config asks for {config.virtual_pipeline_model_parallel_size} "
                         f"virtual stages but parallel_state was initialised with "
                         f"{virtual_size}.")
    if pipeline_size != config.pipeline_model_parallel_size:
        raise ValueError(f"the config says pipeline size {config.pipeline_model_parallel_size}"
                         f" but parallel_state was initialised with {pipeline_size}.")
    placement = placement_for_schedule(getattr(config, "pipeline_schedule", None))
    parallel_state.set_pipeline_placement(placement)
    chunks = []
    # Every chunk starts from the same CPU generator state, so its initial weights do not
    # depend on how many chunks were built before it (init_rng seeds each layer from there).
    generator_state = torch.get_rng_state()
    for chunk in range(virtual_size or 1):
        torch.set_rng_state(generator_state)
        layer_range = chunk_layer_range(
            config.num_layers, pipeline_size, rank, chunk, virtual_size,
            config.num_layers_in_first_pipeline_stage, config.num_layers_in_last_pipeline_stage,
            config.account_for_embedding_in_pipeline_split,
            config.account_for_loss_in_pipeline_split, placement)
        with parallel_state.in_model_chunk(chunk):
            chunks.append(model_provider(pre_process=parallel_state.is_pipeline_first_stage(),
                                         post_process=parallel_state.is_pipeline_last_stage(),
                                         layer_range=layer_range))
    sync_tied_embedding_weights(chunks)
    return chunks
