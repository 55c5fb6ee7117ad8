"""The memory estimate's FP8 term: the cached quantized weights (memory/fp8.py) equal, to the
byte, what a model's FP8 linears hold after a training step, for each recipe, at TP 1 and 2,
with the end layers in high precision; and the printed report shows them."""
import pytest
import torch

from megatron.core.fp8 import Fp8Config
from tests.distributed import run_distributed


def _config(recipe, tp, moe=False):
    from megatron.core.models import llama_config
    from megatron.core.transformer.moe.moe_config import MoEConfig

    experts = MoEConfig(num_moe_experts=4, moe_ffn_hidden_size=128, moe_router_topk=2) \
        if moe else None
    return llama_config(num_layers=4, hidden_size=256, num_attention_heads=4,
                        num_query_groups=2, ffn_hidden_size=384, tensor_model_parallel_size=tp,
                        moe=experts, sequence_parallel=moe and tp > 1,
                        fp8=Fp8Config(recipe=recipe, layers_at_start_in_high_precision=1))


def _cached_and_estimated(recipe, moe=False):
    from megatron.core import parallel_state as ps
    from megatron.core.models import LlamaModel
    from megatron.training.memory.fp8 import fp8_weight_cache_bytes
    from megatron.training.memory.params import chunk_param_shapes

    if moe:  # EP 1, expert TP = TP
        ps.initialize_expert_parallel(1)
    config = _config(recipe, ps.get_tensor_model_parallel_world_size(), moe)
    model = LlamaModel(config, 256)
    tokens = torch.randint(0, 256, (2, 32))
    model(tokens, labels=tokens).mean().backward()
    cached = 0
    for p in model.parameters():
        cache = getattr(p, "_fp8_cache", None)
        if cache is not None:
            cached += sum(q.data.numel() + 4 * q.scale.numel() for q in cache[1].values())
    return cached, fp8_weight_cache_bytes(config, chunk_param_shapes(config, 256, 0))


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "blockwise"])
@pytest.mark.parametrize("tp", [1, 2])
def test_estimate_counts_the_cached_fp8_weights_to_the_byte(recipe, tp):
    for cached, estimated in run_distributed(_cached_and_estimated, world_size=tp, tp=tp,
                                             recipe=recipe):
        assert cached == estimated and cached > 0


@pytest.mark.parametrize("recipe", ["rowwise", "tensorwise", "blockwise"])
def test_estimate_counts_the_experts_cached_weights_to_the_byte(recipe):
    """An MoE model at TP 2 (expert TP 2): rowwise experts keep their stacked quantized
    weights between steps (the grouped path), the other recipes each expert's."""
    for cached, estimated in run_distributed(_cached_and_estimated, world_size=2, tp=2,
                                             recipe=recipe, moe=True):
        assert cached == estimated and cached > 0


def test_report_shows_the_fp8_weights():
    from megatron.training.memory.base import OptimizerSetup
    from megatron.training.memory.estimate import estimate_memory, format_report

    config = _config("rowwise", 1)
    estimate = estimate_memory(config, padded_vocab_size=256, seq_length=32,
                               micro_batch_size=2, num_microbatches=1, setup=OptimizerSetup(),
                               device="cpu")
    stage = estimate.stages[0]
    # Layers 2-4 in FP8: QKV [512, 256], proj [256, 256], fc1 [768, 256], fc2 [256, 384].
    want = 3 * sum(2 * r * c + 4 * (r + c) for r, c in
                   ((512, 256), (256, 256), (768, 256), (256, 384)))
    assert stage.state.fp8_weights == want
    assert f"fp8 weights {want / 2**20:.3f} MiB" in format_report(estimate)

