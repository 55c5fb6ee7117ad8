"""Pipeline parallelism: stage construction, p2p communication and the schedules."""
from megatron.core.pipeline_parallel.layer_split import chunk_layer_range, stage_layer_counts
from megatron.core.pipeline_parallel.model_chunks import get_model_config, unwrap_model
from megatron.core.pipeline_parallel.schedule_order import Step, schedule_order
from megatron.core.pipeline_parallel.schedules import (
    forward_backward_no_pipelining,
    forward_backward_pipelining_with_interleaving,
    forward_backward_pipelining_without_interleaving,
    get_forward_backward_func,
)
from megatron.core.pipeline_parallel.stages import build_model_chunks
from megatron.core.pipeline_parallel.tied_embeddings import (
    allreduce_tied_embedding_grads,
    sync_tied_embedding_weights,
)
from megatron.core.pipeline_parallel.trace import PipelineTrace
