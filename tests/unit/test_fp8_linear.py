"""FP8 in the tensor-parallel linears: ColumnParallelLinear and RowParallelLinear with
``layer.fp8`` set run their forward, input-gradient and weight-gradient GEMMs in FP8, and each
equals a reference that quantizes the same operands with the scalings the recipe names
(written out here GEMM by GEMM, independently of fp8/linear.py), dequantizes them and
multiplies in fp64: at TP=1, at TP=2 with and without sequence parallelism, with and without
gradient-accumulation fusion. Each layer is checked on its own (a leaf input and a given
output gradient), so every quantized operand is the same bytes in both and only the GEMMs'
accumulation differs: within fp32 rounding (the bound below)."""
import pytest
import torch

from megatron.core import parallel_state as ps
from megatron.core.fp8 import Fp8Config
from megatron.core.fp8.linear import Fp8Gemms
from megatron.core.transformer.fp8_layers import use_fp8
from megatron.core.fp8.quantize import (
    BLOCKS_128x128,
    ROWWISE,
    TENSORWISE,
    TILES_1x128,
    dequantize,
    quantize,
)
from tests.distributed import run_distributed

# The recipe's scaling of each GEMM's two operands (both with the contraction dim last):
# forward (x, W), dgrad (dy, W.T), wgrad (dy.T, x.T).
SCALINGS = {
    "tensorwise": {"forward": (TENSORWISE, TENSORWISE), "dgrad": (TENSORWISE, TENSORWISE),
                   "wgrad": (TENSORWISE, TENSORWISE)},
    "rowwise": {"forward": (ROWWISE, ROWWISE), "dgrad": (ROWWISE, ROWWISE),
                "wgrad": (ROWWISE, ROWWISE)},
    "blockwise": {"forward": (TILES_1x128, BLOCKS_128x128),
                  "dgrad": (TILES_1x128, BLOCKS_128x128), "wgrad": (TILES_1x128, TILES_1x128)},
}


class ReferenceGemms:
    """Fp8Gemms' interface: each GEMM on the dequantized operands in fp64."""

    def __init__(self, config: Fp8Config):
        self.config, self.scalings = config, SCALINGS[config.recipe]

    def _gemm(self, which, a, a_dtype, b, b_dtype, out_dtype):
        sa, sb = self.scalings[which]
        qa = dequantize(quantize(a, a_dtype, sa, self.config.margin), torch.float64)
        qb = dequantize(quantize(b, b_dtype, sb, self.config.margin), torch.float64)
        return (qa @ qb.t()).to(out_dtype)

    def forward(self, x, weight, expert=None):  # expert: weight[expert] of stacked ones
        f = self.config.forward_dtype
        weight = weight if expert is None else weight[expert]
        return self._gemm("forward", x, f, weight.detach(), f, x.dtype)

    def quantize_grad(self, grad):
        return None

    def dgrad(self, grad, weight, grad_q=None, expert=None):
        weight = weight if expert is None else weight[expert]
        return self._gemm("dgrad", grad, self.config.gradient_dtype, weight.detach().t(),
                          self.config.forward_dtype, grad.dtype)

    def wgrad(self, grad, x, out_dtype, grad_q=None):
        return self._gemm("wgrad", grad.t(), self.config.gradient_dtype, x.t(),
                          self.config.forward_dtype, out_dtype)


CONFIGS = [Fp8Config(format=f, recipe=r) for r in ("tensorwise", "rowwise", "blockwise")
           for f in ("e4m3", "hybrid") if not (f == "hybrid" and r == "blockwise")]
S, B, H, F = 64, 2, 256, 384  # sequence, batch, hidden, the linears' other size


def tp_linear_and_input(kind, sequence_parallel, fusion, seq=S):
    """A column-parallel (H -> F) or row-parallel (F -> H) linear, seeded alike on every
    rank, and this rank's input [s, B, k] (its own shard's values, spread over two decades
    along k): (layer, x, the output's last size on this rank)."""
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer import TransformerConfig
    from megatron.core.utils import init_method_normal

    tp = ps.get_tensor_model_parallel_world_size()
    config = TransformerConfig(num_layers=1, hidden_size=H, num_attention_heads=4,
                               tensor_model_parallel_size=tp,
                               sequence_parallel=sequence_parallel,
                               gradient_accumulation_fusion=fusion)
    torch.manual_seed(3)
    if kind == "column":
        layer = ColumnParallelLinear(H, F, config=config, bias=False,
                                     init_method=init_method_normal(0.02))
        in_size, out_size, s_in = H, F // tp, (seq // tp if sequence_parallel else seq)
    else:
        layer = RowParallelLinear(F, H, config=config, bias=False,
                                  init_method=init_method_normal(0.02))
        in_size, out_size, s_in = F // tp, H, seq
    g = torch.Generator().manual_seed(11 + ps.get_tensor_model_parallel_rank())
    x = torch.randn(s_in, B, in_size, generator=g) * torch.logspace(-1, 1, in_size)
    return layer, x, out_size


def _layers_against_reference(fp8_config, sequence_parallel):
    """Per layer kind and fusion setting: (outputs, input grads, weight grads) of the FP8
    layer and of the reference, on this rank, and the fp32 bounds of each."""
    tp = ps.get_tensor_model_parallel_world_size()
    results = []
    for kind in ("column", "row"):
        for fusion in (False, True):
            layer, x, out_size = tp_linear_and_input(kind, sequence_parallel, fusion)
            out_s = S if kind == "column" else (S // tp if sequence_parallel else S)
            seed = torch.randn(out_s, B, out_size, generator=torch.Generator().manual_seed(5))
            runs = []
            for gemms in (Fp8Gemms(fp8_config), ReferenceGemms(fp8_config)):
                layer.fp8 = gemms
                layer.weight.grad = None
                if fusion:
                    layer.weight.main_grad = torch.zeros_like(layer.weight)
                xi = x.clone().requires_grad_()
                y, _ = layer(xi)
                y.backward(seed)
                wgrad = layer.weight.main_grad if fusion else layer.weight.grad
                runs.append((y.detach(), xi.grad, wgrad.clone()))
            results.append((kind, fusion, runs))
    return results


def _close(got, want):
    """Within fp32 accumulation's rounding: 2^-20 of the largest value (k <= 384 products
    summed in fp32, and the TP reductions' fp32 sums, against fp64)."""
    return (got - want).abs().max() <= 2.0 ** -20 * want.abs().max()


@pytest.mark.parametrize("fp8_config", CONFIGS, ids=lambda c: f"{c.recipe}-{c.format}")
@pytest.mark.parametrize("tp,sp", [(1, False), (2, False), (2, True)],
                         ids=["tp1", "tp2", "tp2-sp"])
def test_fp8_linears_equal_the_dequantized_reference(fp8_config, tp, sp):
    per_rank = run_distributed(_layers_against_reference, world_size=tp, tp=tp,
                               fp8_config=fp8_config, sequence_parallel=sp)
    for results in per_rank:
        for kind, fusion, (ours, reference) in results:
            for name, got, want in zip(("output", "input grad", "weight grad"), ours,
                                       reference):
                assert _close(got, want), (kind, fusion, name,
                                           (got - want).abs().max() / want.abs().max())


def _fp8_against_high_precision(recipe):
    from megatron.core.tensor_parallel import ColumnParallelLinear
    from megatron.core.transformer import TransformerConfig
    from megatron.core.utils import init_method_normal

    config = TransformerConfig(num_layers=1, hidden_size=H, num_attention_heads=4)
    torch.manual_seed(3)
    layer = ColumnParallelLinear(H, F, config=config, bias=False,
                                 init_method=init_method_normal(0.02))
    x = torch.randn(S, B, H, generator=torch.Generator().manual_seed(1))
    want, _ = layer(x)
    layer.fp8 = Fp8Gemms(Fp8Config(recipe=recipe))
    got, _ = layer(x)
    return ((got - want).norm() / want.norm()).item()


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "blockwise"])
def test_fp8_output_is_near_the_high_precision_one(recipe):
    """Against fp32: e4m3's 3 mantissa bits on both operands, relative error per product
    up to 2^-3, averaging out in the sum: the relative norm error of a random GEMM is a few
    percent (tensorwise, one scale for values spread over two decades, the largest)."""
    (error,) = run_distributed(_fp8_against_high_precision, world_size=1, tp=1, recipe=recipe)
    assert 1e-3 < error < 0.06, error


def _fp8_linears_per_layer(start, end):
    from megatron.core.models import LlamaModel, llama_config

    config = llama_config(num_layers=4, hidden_size=64, num_attention_heads=4,
                          ffn_hidden_size=128,
                          fp8=Fp8Config(layers_at_start_in_high_precision=start,
                                        layers_at_end_in_high_precision=end))
    model = LlamaModel(config, 128)
    counts = [sum(getattr(m, "fp8", None) is not None for m in layer.modules())
              for layer in model.decoder.layers]
    return counts, getattr(model.output_layer, "fp8", None)


def test_use_fp8_sets_every_linear_of_a_layer_and_the_end_layers_stay_high_precision():
    (counts, head), = run_distributed(_fp8_linears_per_layer, world_size=1, tp=1, start=0,
                                      end=0)
    assert counts == [4, 4, 4, 4] and head is None  # QKV, proj, fc1, fc2; the head stays
    (counts, _), = run_distributed(_fp8_linears_per_layer, world_size=1, tp=1, start=1, end=2)
    assert counts == [0, 4, 0, 0]


def test_the_weight_is_quantized_once_per_optimizer_step():
    from megatron.core.fp8.linear import weights_changed

    weight = torch.nn.Parameter(torch.randn(128, 128))
    gemms = Fp8Gemms(Fp8Config(recipe="rowwise"))
    first = gemms._weight(weight)
    dgrad = gemms._weight_t(weight)
    # Microbatches of one step: forward and dgrad both cached, whatever the order.
    assert gemms._weight(weight) is first and gemms._weight_t(weight) is dgrad
    with torch.no_grad():
        weight.add_(1.0)  # an in-place write autograd sees bumps the version
    again = gemms._weight(weight)
    assert again is not first
    assert torch.equal(again.data.view(torch.uint8),
                       quantize(weight.detach(), torch.float8_e4m3fn, ROWWISE).data.view(
                           torch.uint8))
    # The optimizer writes the model's bf16 weights through .data (no version bump) and
    # says so: the next call quantizes the new values.
    weight.data.mul_(0.5)
    assert gemms._weight(weight) is again  # unseen by the version counter...
    weights_changed()
    fresh = gemms._weight(weight)  # ...until the optimizer's step announces it
    assert fresh is not again and torch.equal(
        fresh.data.view(torch.uint8),
        quantize(weight.detach(), torch.float8_e4m3fn, ROWWISE).data.view(torch.uint8))


def _gather_again_elsewhere(weight):
    """FSDP2's free_storage and alloc_storage of ``weight``'s bytes in the same storage,
    until the allocator puts them at another address (each freed address held meanwhile)."""
    storage, address, nbytes = weight.untyped_storage(), weight.data_ptr(), weight.nbytes
    held = []
    for _ in range(8):
        storage.resize_(0)
        held.append(torch.empty(nbytes, dtype=torch.uint8))
        storage.resize_(nbytes)
        if weight.data_ptr() != address:
            return


def test_the_cached_weight_outlives_fsdp2s_free_and_gather_of_its_bytes():
    """FSDP2 frees a gathered weight's bytes after use and gathers them again into the same
    storage, at an address each rank's allocator picks: the cache holds (a miss quantizes and,
    under TP, all-reduces amaxes, so every rank must hit or miss alike); a ``.data`` swap to
    another storage quantizes anew."""
    weight = torch.nn.Parameter(torch.randn(64, 64))
    gemms = Fp8Gemms(Fp8Config(recipe="tensorwise"))
    first = gemms._weight(weight)
    values, address = weight.detach().clone(), weight.data_ptr()
    _gather_again_elsewhere(weight)
    weight.data.copy_(values)
    assert weight.data_ptr() != address  # what the cache keyed on before
    assert gemms._weight(weight) is first
    weight.data = weight.detach().clone()
    assert gemms._weight(weight) is not first


def _optimizer_step_invalidates():
    """A real optimizer step through MegatronOptimizer (bf16 params, fp32 main params: the
    copy back goes through .data) leaves no stale quantized weight behind."""
    from megatron.core.models import LlamaModel, llama_config
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.training.training import build_model

    config = llama_config(num_layers=1, hidden_size=64, num_attention_heads=4,
                          ffn_hidden_size=128, params_dtype=torch.bfloat16,
                          fp8=Fp8Config(recipe="tensorwise"))
    from megatron.core.distributed import DistributedDataParallelConfig

    model = build_model(lambda **_: LlamaModel(config, 128), config,
                        DistributedDataParallelConfig(grad_reduce_in_fp32=True), 1)
    optimizer = get_megatron_optimizer(OptimizerConfig(lr=0.1, bf16=True,
                                                       params_dtype=torch.bfloat16), model)
    layer = model[0].module.decoder.layers[0].mlp.linear_fc1
    tokens = torch.randint(0, 128, (2, 16))
    model[0](tokens, labels=tokens).float().mean().backward()
    before = layer.fp8._weight(layer.weight).data.clone()
    ok, _, _ = optimizer.step()
    after = layer.fp8._weight(layer.weight)
    want = quantize(layer.weight.detach(), torch.float8_e4m3fn, TENSORWISE)
    return ok, torch.equal(before.view(torch.uint8), after.data.view(torch.uint8)), \
        torch.equal(after.data.view(torch.uint8), want.data.view(torch.uint8))


def test_an_optimizer_step_leaves_no_stale_quantized_weight():
    (ok, unchanged, fresh), = run_distributed(_optimizer_step_invalidates, world_size=1, tp=1)
    assert ok and not unchanged and fresh


def test_hybrid_blockwise_is_refused():
    with pytest.raises(ValueError, match="hybrid is not available with --fp8-recipe blockwise"):
        Fp8Config(format="hybrid", recipe="blockwise")


def fp8_layer_as_the_model_builds_it(kind, fp8_config):
    """A column- (256 -> 512) or row-parallel (512 -> 256) layer at this TP, FP8 through
    use_fp8 (the TP group's amax reductions; shards of 256: whole 128-wide blocks at TP 2),
    and a whole input and output gradient, the same on every rank: (layer, x, seed)."""
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer import TransformerConfig
    from megatron.core.utils import init_method_normal

    hidden, other = 256, 512
    config = TransformerConfig(num_layers=1, hidden_size=hidden, num_attention_heads=4,
                               tensor_model_parallel_size=ps.get_tensor_model_parallel_world_size())
    torch.manual_seed(3)
    cls, (k, n) = ((ColumnParallelLinear, (hidden, other)) if kind == "column"
                   else (RowParallelLinear, (other, hidden)))
    layer = cls(k, n, config=config, bias=False, init_method=init_method_normal(0.02))
    assert use_fp8(layer, fp8_config) == 1
    g = torch.Generator().manual_seed(11)
    x = torch.randn(S, B, k, generator=g) * torch.logspace(-1, 1, k)
    return layer, x, torch.randn(S, B, n, generator=g)


def _layer_at_this_tp(kind, fp8_config):
    """One FP8 layer as the model builds it (use_fp8: the TP group's amax reductions), its
    input and output gradient the same full tensors on every rank: (output, input gradient,
    weight gradient), each gathered to the full tensor."""
    from megatron.core.tensor_parallel.mappings import (
        _gather_along_last_dim as gather_along_last_dim,
    )

    tp = ps.get_tensor_model_parallel_world_size()
    rank = ps.get_tensor_model_parallel_rank()
    layer, x, seed = fp8_layer_as_the_model_builds_it(kind, fp8_config)
    if kind == "row":
        x = x.chunk(tp, dim=2)[rank]
    x.requires_grad_()
    y, _ = layer(x)
    y.backward(seed if kind == "row" else seed.chunk(tp, dim=2)[rank])
    weight_grad = layer.weight.grad
    if tp > 1:
        if kind == "column":
            y = gather_along_last_dim(y.detach())
            weight_grad = gather_along_last_dim(weight_grad.t().contiguous()).t()
        else:
            weight_grad = gather_along_last_dim(weight_grad)
            x_grad = gather_along_last_dim(x.grad)
    x_grad = x.grad if tp == 1 or kind == "column" else x_grad
    return y.detach(), x_grad, weight_grad


@pytest.mark.parametrize("fp8_config", CONFIGS, ids=lambda c: f"{c.recipe}-{c.format}")
@pytest.mark.parametrize("kind", ["column", "row"])
def test_tp2_quantizes_as_one_process_does(fp8_config, kind):
    """The same full weights, input and output gradient at TP 1 and TP 2: with the amax
    all-reduces every operand is the same FP8 bytes, so output and gradients agree within
    fp32 rounding (the TP sums); without them a shard's tensorwise or row scale would be its
    own and the results would differ by FP8 roundings (~1e-2)."""
    (one,) = run_distributed(_layer_at_this_tp, world_size=1, tp=1, kind=kind,
                             fp8_config=fp8_config)
    two = run_distributed(_layer_at_this_tp, world_size=2, tp=2, kind=kind,
                          fp8_config=fp8_config)
    for rank_result in two:
        for name, got, want in zip(("output", "input grad", "weight grad"), rank_result, one):
            assert got.shape == want.shape, name
            assert _close(got, want), (name, ((got - want).abs().max() /
                                              want.abs().max()).item())
