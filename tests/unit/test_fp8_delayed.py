"""FP8 delayed scaling (fp8/delayed.py): the scale a history gives and the cast with it equal
a plain-torch reference bit for bit, the history rolls once per step over the step's
microbatches, the first step is current (tensorwise) scaling; and a TP 1 and a TP 2 linear
over several optimizer steps cast each step's operands with the scales of the previous steps'
whole-tensor amaxes (asserted value by value), TP 2 with TP 1's exact scales and within
tests/unit/test_fp8_linear.py's fp32 bound of its outputs and gradients."""
import pytest
import torch

from megatron.core import parallel_state as ps
from megatron.core.fp8 import Fp8Config
from megatron.core.fp8.delayed import DelayedScaling, delayed_states, step_delayed_scaling
from megatron.core.fp8.linear import Fp8Gemms
from megatron.core.fp8.quantize import TENSORWISE, quantize
from tests.distributed import run_distributed
from tests.unit.test_fp8_linear import _close, fp8_layer_as_the_model_builds_it

E4M3 = torch.float8_e4m3fn


def _reference_encode(history, algo, dtype, margin):
    """Plain torch: the amax ``algo`` picks from the python list ``history`` (most recent
    last), max_fp8 / amax / 2^margin in fp32, 1 for an amax of 0."""
    amax = torch.tensor(history[-1] if algo == "most_recent" else max(history),
                        dtype=torch.float32)
    if amax == 0:
        return torch.tensor(1.0)
    return torch.finfo(dtype).max / amax / 2.0 ** margin


@pytest.mark.parametrize("algo", ["most_recent", "max"])
def test_a_history_casts_as_the_plain_torch_reference(algo):
    """Five steps of two microbatches, a window of 3 and a margin of 1: each cast is the
    reference's bytes and decode scale; the history holds the last three steps' microbatch
    maxima; values past the history's amax saturate."""
    margin, window, dtype = 1, 3, E4M3
    state = DelayedScaling(window, algo)
    seen = []  # each step's amax, the reference history
    g = torch.Generator().manual_seed(0)
    for step, factors in enumerate([(1.0, 3.0), (0.5, 0.25), (8.0, 1.0), (2.0, 2.0),
                                    (0.1, 0.2)]):
        encode = state.encode("input", dtype, margin, torch.device("cpu"))
        assert (encode is None) == (step == 0)  # the first step: current scaling
        step_amax = 0.0
        for f in factors:
            x = torch.randn(16, 32, generator=g) * f
            if step == 0:
                want = quantize(x, dtype, TENSORWISE, margin)  # tensorwise, as the first step
                q = want
            else:
                ref = _reference_encode(seen[-window:], algo, dtype, margin)
                assert torch.equal(encode, ref), (step, encode, ref)
                top = torch.finfo(dtype).max
                data = (x * ref).clamp(-top, top).to(dtype)
                q = quantize(x, dtype, TENSORWISE, margin, encode=encode)
                assert torch.equal(q.data.view(torch.uint8), data.view(torch.uint8)), step
                assert torch.equal(q.scale, torch.reciprocal(ref))
            state.record("input", x.abs().max())
            step_amax = max(step_amax, x.abs().max().item())
        seen.append(step_amax)
        step_delayed_scaling([state])
        want_history = list(reversed(seen[-window:])) + [0.0] * (window - len(seen[-window:]))
        assert state.history[0].tolist() == want_history, (state.history, seen)
        assert state.steps == step + 1
    # step 3 (factors 2, 2) after step 2's 8: the max algo's scale kept x inside the range;
    # most_recent's too. A tensor above the history's amax saturates at max_fp8.
    big = torch.full((2, 2), 1e6)
    q = quantize(big, dtype, TENSORWISE, margin,
                 encode=state.encode("input", dtype, margin, torch.device("cpu")))
    assert torch.equal(q.data.float(), torch.full((2, 2), torch.finfo(dtype).max))


def test_the_first_step_is_tensorwise_and_the_state_round_trips():
    x = torch.randn(64, 128, generator=torch.Generator().manual_seed(1))
    w = torch.randn(32, 128, generator=torch.Generator().manual_seed(2))
    delayed = Fp8Gemms(Fp8Config(recipe="delayed", amax_history_len=4,
                                 amax_compute_algo="max"))
    current = Fp8Gemms(Fp8Config(recipe="tensorwise"))
    assert torch.equal(delayed.forward(x, w), current.forward(x, w))
    state = delayed.delayed
    step_delayed_scaling([state])
    saved = state.state_dict()
    other = DelayedScaling(4, "max")
    other.load_state_dict(saved)
    assert torch.equal(other.history, state.history) and other.steps == 1
    assert other.history[:, 0].tolist() == [x.abs().max().item(), w.abs().max().item(), 0.0]
    with pytest.raises(ValueError, match="--fp8-amax-history-len"):
        DelayedScaling(2, "max").load_state_dict(saved)


@pytest.mark.parametrize("kwargs", [dict(amax_history_len=0), dict(amax_compute_algo="mean")])
def test_bad_delayed_settings_are_refused(kwargs):
    with pytest.raises(ValueError, match="--fp8-amax"):
        Fp8Config(recipe="delayed", **kwargs)


STEPS = 4
X_FACTORS = [(1.0, 3.0), (0.5, 0.25), (4.0, 1.0), (2.0, 2.0)]  # per step, per microbatch
G_FACTORS = [(1.0, 0.5), (2.0, 8.0), (0.25, 1.0), (1.0, 1.0)]
W_FACTORS = [1.5, 0.5, 3.0, 1.0]  # the "optimizer step": the weight scaled in place


def _delayed_steps(kind, fp8_config):
    """One delayed-scaling layer built as the model builds it (use_fp8), STEPS steps of two
    microbatches, the same full tensors on every rank: per step the (shape, dtype, encode) of
    every cast, the whole tensors' amaxes (plain torch; whole only at TP 1), and the outputs
    and gradients gathered to whole tensors; and the final histories."""
    import megatron.core.fp8.linear as linear
    from megatron.core.tensor_parallel.mappings import (
        _gather_along_last_dim as gather_along_last_dim,
    )

    tp, rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    layer, x0, seed0 = fp8_layer_as_the_model_builds_it(kind, fp8_config)
    calls, real = [], linear.quantize

    def spy(x, dtype, scaling, margin, reduce, compile, transpose, encode=None):
        calls[-1].append((tuple(x.shape), dtype, None if encode is None else encode.clone()))
        return real(x, dtype, scaling, margin, reduce, compile, transpose, encode)

    linear.quantize = spy
    steps = []
    try:
        for step in range(STEPS):
            calls.append([])
            amax = {"weight": layer.weight.detach().abs().max(), "input": 0.0, "grad": 0.0}
            outs = []
            for xf, gf in zip(X_FACTORS[step], G_FACTORS[step]):
                x, seed = x0 * xf, seed0 * gf
                amax["input"] = max(amax["input"], x.abs().max())
                amax["grad"] = max(amax["grad"], seed.abs().max())
                xi = (x.chunk(tp, dim=2)[rank] if kind == "row" else x).requires_grad_()
                layer.weight.grad = None
                y, _ = layer(xi)
                y.backward(seed if kind == "row" else seed.chunk(tp, dim=2)[rank])
                wg, xg, y = layer.weight.grad, xi.grad, y.detach()
                if tp > 1 and kind == "column":
                    y = gather_along_last_dim(y)
                    wg = gather_along_last_dim(wg.t().contiguous()).t()
                elif tp > 1:
                    wg, xg = gather_along_last_dim(wg), gather_along_last_dim(xg)
                outs.append((y, xg, wg))
            with torch.no_grad():
                layer.weight.mul_(W_FACTORS[step])
            step_delayed_scaling(delayed_states([layer]),
                                 [ps.get_tensor_model_parallel_group()])
            steps.append((calls[-1], amax, outs))
    finally:
        linear.quantize = real
    return steps, layer.fp8.delayed.history


DELAYED = [("column", Fp8Config(format="hybrid", recipe="delayed", margin=1,
                                amax_history_len=2, amax_compute_algo="max")),
           ("row", Fp8Config(format="e4m3", recipe="delayed", amax_history_len=3,
                             amax_compute_algo="most_recent"))]


@pytest.mark.parametrize("kind,fp8_config", DELAYED, ids=["column-max2", "row-recent3"])
def test_a_delayed_linear_scales_from_earlier_steps_and_tp2_matches_tp1(kind, fp8_config):
    (one, one_history), = run_distributed(_delayed_steps, world_size=1, tp=1, kind=kind,
                                          fp8_config=fp8_config)
    weight_shape = (512, 256) if kind == "column" else (256, 512)
    k = weight_shape[1]
    history = {"input": [], "weight": [], "grad": []}  # whole tensors' step amaxes
    for step, (calls, amax, _) in enumerate(one):
        for shape, dtype, encode in calls:
            if step == 0:
                assert encode is None  # the first step: current scaling
                continue
            op = "weight" if shape == weight_shape else "input" if shape[1] == k else "grad"
            want = _reference_encode(
                history[op][-fp8_config.amax_history_len:], fp8_config.amax_compute_algo,
                fp8_config.gradient_dtype if op == "grad" else E4M3, fp8_config.margin)
            assert torch.equal(encode, want), (step, op, encode, want)
        assert len(calls) >= 5  # input, weight (once a step), grad; input, grad
        for op in history:
            history[op].append(float(amax[op]))
    for i, op in enumerate(("input", "weight", "grad")):
        want = list(reversed(history[op]))[:fp8_config.amax_history_len]
        assert one_history[i].tolist() == want, (op, one_history[i], want)
    for two, two_history in run_distributed(_delayed_steps, world_size=2, tp=2, kind=kind,
                                            fp8_config=fp8_config):
        assert torch.equal(two_history, one_history)  # MAX over TP: the whole tensors'
        for (calls2, _, outs2), (calls1, _, outs1) in zip(two, one, strict=True):
            # the same scales as one process, cast for cast
            assert len(calls2) == len(calls1)
            for (_, _, e2), (_, _, e1) in zip(calls2, calls1):
                assert (e2 is None and e1 is None) or torch.equal(e2, e1)
            for got_mb, want_mb in zip(outs2, outs1, strict=True):
                for name, got, want in zip(("output", "input grad", "weight grad"), got_mb,
                                           want_mb):
                    assert _close(got, want), (name, ((got - want).abs().max()
                                                      / want.abs().max()).item())


def _histories_across_a_pipeline_cut():
    """A 4-layer model's histories, saved by name from one process, restored into the two
    stages of PP 2 (layers 1-2 and 3-4: built here in one process): every stage finds its own
    layers' histories, by global layer number, and no other."""
    from megatron.core.fp8.delayed import capture_histories, named_states, restore_histories
    from megatron.core.models import LlamaModel, llama_config

    config = llama_config(num_layers=4, hidden_size=64, num_attention_heads=4,
                          ffn_hidden_size=128,
                          fp8=Fp8Config(recipe="delayed", amax_history_len=2))
    whole = LlamaModel(config, 128)
    for i, state in enumerate(named_states([whole]).values()):  # distinct histories
        state.history.fill_(float(i + 1))
        state.steps = 3
    saved = capture_histories([whole])
    stages = [LlamaModel(config, 128, pre_process=s == 0, post_process=s == 1,
                         layer_range=(2 * s, 2 * s + 2)) for s in range(2)]
    restored = [restore_histories([stage], saved) for stage in stages]
    names = [sorted(named_states([stage])) for stage in stages]
    values = [{n: s.history[0, 0].item() for n, s in named_states([stage]).items()}
              for stage in stages]
    steps = {s.steps for stage in stages for s in named_states([stage]).values()}
    return saved, restored, names, values, steps


def test_histories_are_saved_by_name_and_restored_at_another_pipeline_cut():
    from tests.distributed import run_distributed

    (saved, restored, names, values, steps), = run_distributed(
        _histories_across_a_pipeline_cut, world_size=1, tp=1)
    assert restored == [True, True] and steps == {3}
    assert len(saved) == 16 and sorted(names[0] + names[1]) == sorted(saved)
    assert all("decoder.layers[1]." in n or "decoder.layers[2]." in n for n in names[0])
    assert all("decoder.layers[3]." in n or "decoder.layers[4]." in n for n in names[1])
    for stage in values:
        for name, value in stage.items():
            assert value == saved[name]["history"][0][0]
