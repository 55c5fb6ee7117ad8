"""Tensorwise FP8 quantizes a linear's input once a step: the forward keeps x's FP8 (x.T, or
under sequence parallelism its rows, gathered in backward as bytes) in place of the
high-precision x, and the weight gradient uses it. Per layer kind, at TP 1 and TP 2 with
sequence parallelism, with and without gradient-accumulation fusion, whole and split
(zero-bubble W deferred) backward: the input is quantized once (rowwise, whose wgrad groups
differ, twice), no high-precision copy of it is saved, and every output and gradient equals,
bit for bit, the run that quantizes the input again in backward."""
import pytest
import torch

from megatron.core import parallel_state as ps
from megatron.core.fp8 import Fp8Config
from megatron.core.fp8 import linear as fp8_linear
from megatron.core.fp8.linear import Fp8Gemms
from tests.distributed import run_distributed
from tests.unit.test_fp8_linear import B, tp_linear_and_input

S = 32  # 64 tokens: no operand shares the input's element count (B, H, F: test_fp8_linear's)


class RequantizingGemms(Fp8Gemms):
    """The behaviour before the reuse: backward quantizes the high-precision x again."""

    reuses_input = False


def _run(recipe, sequence_parallel):
    from megatron.core.tensor_parallel.weight_grad_store import (
        WeightGradStore,
        deferring_weight_grads,
    )

    tp = ps.get_tensor_model_parallel_world_size()
    group = ps.get_tensor_model_parallel_group() if tp > 1 else None
    results = []
    real_quantize = fp8_linear.quantize
    for kind in ("column", "row"):
        for fusion in (False, True):
            for split in (False, True):
                layer, x, _ = tp_linear_and_input(kind, sequence_parallel, fusion, seq=S)
                runs = []
                for cls in (Fp8Gemms, RequantizingGemms):
                    layer.fp8 = cls(Fp8Config(recipe=recipe), kind, group)
                    layer.weight.grad = None
                    layer.weight.__dict__.pop("_fp8_cache", None)
                    if fusion:
                        layer.weight.main_grad = torch.zeros_like(layer.weight)
                    calls, saved = [], []

                    def counting(t, *args, **kwargs):
                        calls.append(tuple(t.shape))
                        return real_quantize(t, *args, **kwargs)

                    fp8_linear.quantize = counting
                    try:
                        # What the forward saves (a pass of its own: a saved-tensor hook's
                        # unpacked weight is not the parameter the split backward fills).
                        with torch.autograd.graph.saved_tensors_hooks(
                                lambda t: saved.append((t.dtype, t.numel())) or t,
                                lambda t: t):
                            layer(x.clone().requires_grad_())
                        calls.clear()
                        xi = x.clone().requires_grad_()
                        y, _ = layer(xi)
                        seed = torch.randn(y.shape, generator=torch.Generator().manual_seed(5))
                        if split:
                            store = WeightGradStore()
                            with deferring_weight_grads(store):
                                y.backward(seed)
                            store.flush()
                        else:
                            y.backward(seed)
                    finally:
                        fp8_linear.quantize = real_quantize
                    m_total = S * B
                    k = x.shape[-1]
                    inputs = sum(c in ((m_total, k), (k, m_total)) for c in calls)
                    wgrad = layer.weight.main_grad if fusion else layer.weight.grad
                    runs.append(dict(out=y.detach(), dx=xi.grad, dw=wgrad.clone(),
                                     input_quantizations=inputs, saved=saved,
                                     x_numel=x.numel()))
                results.append((kind, fusion, split, runs))
    return results


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
@pytest.mark.parametrize("tp,sp", [(1, False), (2, True)], ids=["tp1", "tp2-sp"])
def test_the_input_is_quantized_once_and_kept_in_fp8(recipe, tp, sp):
    per_rank = run_distributed(_run, world_size=tp, tp=tp, recipe=recipe,
                               sequence_parallel=sp)
    for results in per_rank:
        for kind, fusion, split, (kept, requantized) in results:
            case = (kind, fusion, split)
            for name in ("out", "dx", "dw"):
                assert torch.equal(kept[name], requantized[name]), (case, name)
            assert requantized["input_quantizations"] == 2, case
            high = {torch.float32, torch.bfloat16}
            x_numel = kept["x_numel"]
            saved_inputs = [dtype for dtype, n in kept["saved"] if n == x_numel]
            if recipe == "tensorwise":
                assert kept["input_quantizations"] == 1, case
                # this rank's rows of the gathered input (SP) or the whole x.T: in FP8 only
                assert saved_inputs == [torch.float8_e4m3fn], (case, kept["saved"])
            else:
                assert kept["input_quantizations"] == 2, case
                assert len(saved_inputs) == 1 and saved_inputs[0] in high, case
