"""The MoE experts' projections in FP8 (megatron/core/fp8/experts.py): for each recipe, the
output and both gradients of an expert projection equal the same computation with every GEMM
done in fp64 on the dequantized operands (tests/unit/test_fp8_linear.py's reference), one
expert receiving no tokens; and an MoE layer built with FP8 runs its experts so."""
import pytest
import torch

from megatron.core.fp8 import Fp8Config
from megatron.core.fp8.experts import fp8_expert_linear
from megatron.core.fp8.linear import Fp8Gemms
from tests.unit.test_fp8_linear import CONFIGS, ReferenceGemms


def _close(got, want):
    return (got - want).abs().max() <= 2.0 ** -20 * want.abs().max()


@pytest.mark.parametrize("fp8_config", CONFIGS, ids=lambda c: f"{c.recipe}-{c.format}")
def test_expert_projection_equals_the_dequantized_reference(fp8_config):
    g = torch.Generator().manual_seed(0)
    counts = [40, 0, 88, 13]  # expert 1 gets no token
    x = torch.randn(sum(counts), 256, generator=g) * torch.logspace(-1, 1, 256)
    weight = torch.randn(len(counts), 384, 256, generator=g) * 0.02
    seed = torch.randn(sum(counts), 384, generator=g)
    runs = []
    for gemms in (Fp8Gemms(fp8_config), ReferenceGemms(fp8_config)):
        xi, wi = x.clone().requires_grad_(), weight.clone().requires_grad_()
        out = fp8_expert_linear(xi, wi, counts, gemms)
        out.backward(seed)
        runs.append((out.detach(), xi.grad, wi.grad))
    for name, got, want in zip(("output", "input grad", "weight grad"), *runs):
        assert _close(got, want), name
    assert torch.all(runs[0][2][1] == 0)  # the idle expert's weight gets no gradient


def _moe_layer_experts_in_fp8():
    from megatron.core.models import LlamaModel, llama_config
    from megatron.core.transformer.moe.moe_config import MoEConfig

    config = llama_config(num_layers=2, hidden_size=64, num_attention_heads=4,
                          ffn_hidden_size=128,
                          moe=MoEConfig(num_moe_experts=4, moe_ffn_hidden_size=64,
                                        moe_router_topk=2),
                          fp8=Fp8Config(recipe="rowwise"))
    model = LlamaModel(config, 128)
    experts = [m for m in model.modules() if type(m).__name__ == "SwiGLUExperts"]
    routers = [m for m in model.modules() if "Router" in type(m).__name__]
    tokens = torch.randint(0, 128, (2, 16))
    loss = model(tokens, labels=tokens).mean()
    loss.backward()
    return (len(experts), all(e.fp8 is not None for e in experts),
            all(getattr(r, "fp8", None) is None for r in routers),
            torch.isfinite(loss).item(), all(e.weight1.grad is not None for e in experts))


def test_an_moe_model_runs_its_experts_in_fp8():
    from tests.distributed import run_distributed

    (count, experts_fp8, routers_high, finite, grads), = run_distributed(
        _moe_layer_experts_in_fp8, world_size=1, tp=1)
    assert count == 2 and experts_fp8 and routers_high and finite and grads
