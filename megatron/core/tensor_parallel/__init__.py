"""Tensor parallelism: layers, mappings, cross entropy, RNG tracking, recomputation."""
from megatron.core.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from megatron.core.tensor_parallel.data import broadcast_data
from megatron.core.tensor_parallel.layers import (
    ColumnParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    initialize_affine_weight,
    param_is_tensor_parallel_duplicate,
    set_tensor_model_parallel_attributes,
    vocab_parallel_lookup,
)
from megatron.core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
    gather_from_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_sequence_parallel_region,
    scatter_to_tensor_model_parallel_region,
)
from megatron.core.tensor_parallel.random import (
    CheckpointFunction,
    RNGStatesTracker,
    checkpoint,
    get_cuda_rng_tracker,
    get_rng_tracker,
    model_parallel_cuda_manual_seed,
    model_parallel_manual_seed,
)
from megatron.core.tensor_parallel.utils import vocab_range_for_rank, vocab_size_with_padding
from megatron.core.tensor_parallel.weight_grad_store import (
    WeightGradStore,
    current_weight_grad_store,
    deferring_weight_grads,
)
