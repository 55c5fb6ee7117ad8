"""What a checkpoint file records about how the model was cut, so another layout can load it."""
from typing import Dict, List

from megatron.core import parallel_state
from megatron.core.pipeline_parallel.model_chunks import unwrap_model
from megatron.core.transformer.gated_linear_unit import GATED_ACTIVATIONS
from megatron.training.checkpointing.experts import expert_layout


def chunk_layer_range(chunk) -> List[int]:
    block = unwrap_model(chunk).decoder
    return [block.layer_offset, block.layer_offset + len(block.layers)]


def current_layout(model_chunks, configs) -> Dict:
    first = unwrap_model(model_chunks[0])
    tc = configs.transformer
    return {
        "tensor_model_parallel_size": parallel_state.get_tensor_model_parallel_world_size(),
        "pipeline_model_parallel_size": parallel_state.get_pipeline_model_parallel_world_size(),
        "virtual_pipeline_model_parallel_size":
            parallel_state.get_virtual_pipeline_model_parallel_world_size(),
        # The ranks that hold the same weights (DP x CP): the optimizer's shards, RNG states.
        "data_parallel_size": parallel_state.get_data_parallel_world_size(
            with_context_parallel=True),
        "context_parallel_size": parallel_state.get_context_parallel_world_size(),
        "num_layers": tc.num_layers,
        "layer_ranges": [chunk_layer_range(c) for c in model_chunks],
        "vocab_size": getattr(configs, "checkpoint_vocab_size", None) or first.vocab_size,
        "padded_vocab_size": first.padded_vocab_size,
        "gated_mlp": tc.activation in GATED_ACTIVATIONS,
        "tied_output": bool(first.share_embeddings_and_output_weights),
        "distributed_optimizer": bool(configs.optimizer.sharded),
        **expert_layout(),
    }


_MODEL_CUT = ("tensor_model_parallel_size", "pipeline_model_parallel_size",
              "virtual_pipeline_model_parallel_size", "layer_ranges", "padded_vocab_size")
_EXPERT_CUT = ("expert_model_parallel_size", "expert_tensor_parallel_size")  # 1 in older ones


def same_model_cut(saved: Dict, current: Dict) -> bool:
    """True when this rank's own file holds exactly its tensors (DP may differ)."""
    return all(saved.get(k) == current[k] for k in _MODEL_CUT) and all(
        saved.get(k, 1) == current[k] for k in _EXPERT_CUT)


def model_key(chunk: int, virtual_size) -> str:
    return "model" if virtual_size is None else f"model{chunk}"
