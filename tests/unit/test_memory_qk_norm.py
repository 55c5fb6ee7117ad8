"""The memory estimate's parameter list (memory/params.py) is the model's, name by name, for a
model with per-head q/k norms (Qwen3), RMSNorm or LayerNorm, at TP 2."""
import pytest

from tests.distributed import run_distributed


def _model_parameter_counts(qk_layernorm, normalization):
    from megatron.core import parallel_state as ps
    from megatron.core.models import LlamaModel, llama_config
    from megatron.training.memory.params import chunk_param_shapes

    config = llama_config(num_layers=2, hidden_size=64, num_attention_heads=4,
                          num_query_groups=2, kv_channels=32, ffn_hidden_size=96,
                          qk_layernorm=qk_layernorm, normalization=normalization,
                          tensor_model_parallel_size=ps.get_tensor_model_parallel_world_size())
    model = LlamaModel(config, 128)
    real = {name: p.numel() for name, p in model.named_parameters()}
    estimated = {s.name: s.numel for s in chunk_param_shapes(  # LlamaModel: untied
        config, 128, 0, 0, share_embeddings_and_output_weights=False)}
    return real, estimated


@pytest.mark.parametrize("normalization", ["RMSNorm", "LayerNorm"])
def test_the_estimate_counts_every_parameter_of_a_qk_norm_model(normalization):
    """Qwen3's per-head q/k norms are parameters too (the estimate once left them out:
    Qwen3-8B's count was 36 x 256 short of its published 8,190,735,360)."""
    for real, estimated in run_distributed(_model_parameter_counts, world_size=2, tp=2,
                                           qk_layernorm=True, normalization=normalization):
        assert estimated == real
