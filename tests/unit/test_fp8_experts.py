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


@pytest.mark.parametrize("recipe", ["tensorwise", "blockwise"])
def test_each_experts_weight_is_quantized_once_per_step(recipe, monkeypatch):
    """Two microbatches of one step (forward and backward each): every expert's weight is
    quantized once, its cached copy reused by the second microbatch and by dgrad (the
    transpose of the forward copy in both recipes); a step (weights_changed) quantizes anew."""
    from megatron.core.fp8 import linear

    calls = []
    real = linear.quantize
    monkeypatch.setattr(linear, "quantize", lambda x, *a, **k: calls.append(x.shape) or
                        real(x, *a, **k))
    g = torch.Generator().manual_seed(0)
    counts = [8, 0, 16]
    weight = (torch.randn(3, 128, 256, generator=g) * 0.02).requires_grad_()
    gemms = Fp8Gemms(Fp8Config(recipe=recipe))

    def microbatch():
        x = torch.randn(sum(counts), 256, generator=g)
        fp8_expert_linear(x, weight, counts, gemms).sum().backward()
    microbatch()
    weights = [shape for shape in calls if shape == (128, 256)]
    assert len(weights) == 2  # the experts with tokens, once each
    calls.clear()
    microbatch()
    assert (128, 256) not in calls  # the step's copies: no weight quantized again
    linear.weights_changed()
    calls.clear()
    microbatch()
    assert [shape for shape in calls if shape == (128, 256)] == [(128, 256)] * 2


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
    configured = (len(experts), all(e.fp8 is not None for e in experts),
                  all(getattr(r, "fp8", None) is None for r in routers),
                  all(e.weight1.grad is not None for e in experts))
    with torch.no_grad():  # the same model with its experts in high precision
        for e in experts:
            e.fp8 = None
        high = model(tokens, labels=tokens).mean()
    return configured, loss.item(), high.item()


def test_an_moe_model_runs_its_experts_in_fp8():
    """The model's experts take the FP8 path (the loss moves off the high-precision one by
    FP8's rounding) and the router does not."""
    from tests.distributed import run_distributed

    ((count, experts_fp8, routers_high, grads), loss, high), = run_distributed(
        _moe_layer_experts_in_fp8, world_size=1, tp=1)
    assert count == 2 and experts_fp8 and routers_high and grads
    assert 0 < abs(loss - high) < 1e-2 * abs(high), (loss, high)


def _expert_projections_at_this_etp(fp8_config):
    """fc1 [E, 2f, h] split by rows and fc2 [E, h, f] by columns over the ranks (as expert TP
    splits them, here over the TP group), each projection on its own: (fc1 output, its input
    grad, fc1 weight grad, fc2 output, its input grad, fc2 weight grad), gathered to full."""
    import torch.distributed as dist

    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.mappings import _gather_along_last_dim as gather_last

    n, rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    group = ps.get_tensor_model_parallel_group() if n > 1 else None
    g = torch.Generator().manual_seed(0)
    counts, h, f = [40, 0, 88, 13], 256, 256  # f / 2 = 128: whole blocks per rank
    x = torch.randn(sum(counts), h, generator=g) * torch.logspace(-1, 1, h)
    act = torch.randn(sum(counts), f, generator=g)
    w1 = torch.randn(len(counts), f, h, generator=g) * 0.02  # one projection's rows
    w2 = torch.randn(len(counts), h, f, generator=g) * 0.02
    seed1 = torch.randn(sum(counts), f, generator=g)
    seed2 = torch.randn(sum(counts), h, generator=g)
    rows = slice(rank * f // n, (rank + 1) * f // n)

    w1_local = w1[:, rows].clone().requires_grad_()
    xi = x.clone().requires_grad_()
    out1 = fp8_expert_linear(xi, w1_local, counts, Fp8Gemms(fp8_config, "column", group))
    out1.backward(seed1[:, rows])
    if n > 1:
        dist.all_reduce(xi.grad, group=group)  # the column split's input gradient: a sum

    w2_local = w2[:, :, rows].clone().requires_grad_()
    ai = act[:, rows].clone().requires_grad_()
    out2 = fp8_expert_linear(ai, w2_local, counts, Fp8Gemms(fp8_config, "row", group))
    out2 = out2.detach()
    if n > 1:
        dist.all_reduce(out2, group=group)  # the row split's output: partial sums
    fp8_expert_linear(ai, w2_local, counts, Fp8Gemms(fp8_config, "row", group)).backward(
        seed2)

    def full(t, dim):
        if n == 1:
            return t
        return gather_last(t.transpose(dim, -1).contiguous()).transpose(dim, -1)

    return (full(out1.detach(), 1), xi.grad, full(w1_local.grad, 1), out2, full(ai.grad, 1),
            full(w2_local.grad, 2))


@pytest.mark.parametrize("fp8_config", CONFIGS, ids=lambda c: f"{c.recipe}-{c.format}")
def test_expert_tp2_quantizes_as_one_process_does(fp8_config):
    """With the expert-TP amax all-reduces a rank's expert shard is quantized as the whole
    expert is: outputs and gradients within fp32 rounding (the TP sums) of one process."""
    from tests.distributed import run_distributed

    (one,) = run_distributed(_expert_projections_at_this_etp, world_size=1, tp=1,
                             fp8_config=fp8_config)
    for two in run_distributed(_expert_projections_at_this_etp, world_size=2, tp=2,
                               fp8_config=fp8_config):
        for i, (got, want) in enumerate(zip(two, one)):
            assert got.shape == want.shape, i
            assert _close(got, want), (i, ((got - want).abs().max() / want.abs().max()).item())
