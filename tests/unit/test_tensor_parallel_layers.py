"""Tensor-parallel layers equal the unsharded torch ops on the gathered weights.

Every rank builds the same full tensors from one seed, loads its shard into the parallel layer,
and compares outputs and input/weight/bias gradients with nn.Linear / nn.Embedding /
F.cross_entropy on the full tensors. fp32; the sharded sums (all-reduce, reduce-scatter) add
partial products in another order, so results differ by rounding only: max abs error <= 1e-6.
Inputs and output gradients are scaled by 1/2 so that outputs and every gradient (a sum over
SEQ*BATCH=16 products) stay of order one, where fp32 rounding is ~1e-7.
"""
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron.core import parallel_state as ps
from megatron.core.model_parallel_config import ModelParallelConfig
from megatron.core.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    vocab_parallel_cross_entropy,
    vocab_size_with_padding,
)
from megatron.core.utils import init_method_normal
from tests.distributed import run_distributed

TOL = 1e-6
SEQ, BATCH, HIDDEN, FFN = 8, 2, 12, 16
TP_SIZES = [1, 2, 4]


def _err(a, b):
    assert a.shape == b.shape, (a.shape, b.shape)
    return (a - b).abs().max().item()


def _tp():
    return ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()


def _shard(t, dim):
    size, rank = _tp()
    return t.chunk(size, dim=dim)[rank]


def _reduce_sequence_parallel_grads(module):
    """What finalize_model_grads does: sum grads of params marked sequence_parallel over TP."""
    for p in module.parameters():
        if getattr(p, "sequence_parallel", False):
            dist.all_reduce(p.grad, group=ps.get_tensor_model_parallel_group())


def _reference_linear(in_features, out_features, seed):
    """Full input, weight, bias and output gradient, and nn.Linear's forward/backward on them."""
    g = torch.Generator().manual_seed(seed)
    x_full = torch.randn(SEQ, BATCH, in_features, generator=g) * 0.5
    w_full = torch.randn(out_features, in_features, generator=g) * 0.2
    b_full = torch.randn(out_features, generator=g) * 0.2
    dy_full = torch.randn(SEQ, BATCH, out_features, generator=g) * 0.5
    ref = torch.nn.Linear(in_features, out_features)
    with torch.no_grad():
        ref.weight.copy_(w_full)
        ref.bias.copy_(b_full)
    x_ref = x_full.clone().requires_grad_()
    y_ref = ref(x_ref)
    y_ref.backward(dy_full)
    return x_full, w_full, b_full, dy_full, ref, x_ref, y_ref


def _column_case(sequence_parallel, gather_output, skip_bias_add):
    x_full, w_full, b_full, dy_full, ref, x_ref, y_ref = _reference_linear(HIDDEN, FFN, 7)
    layer = ColumnParallelLinear(
        HIDDEN, FFN, config=ModelParallelConfig(sequence_parallel=sequence_parallel),
        init_method=init_method_normal(0.02), gather_output=gather_output,
        skip_bias_add=skip_bias_add)
    with torch.no_grad():
        layer.weight.copy_(_shard(w_full, 0))
        layer.bias.copy_(_shard(b_full, 0))
    x = (_shard(x_full, 0) if sequence_parallel else x_full).clone().requires_grad_()
    y, bias = layer(x)
    assert (bias is not None) == skip_bias_add
    if skip_bias_add:
        y = y + bias
    y.backward(dy_full if gather_output else _shard(dy_full, -1))
    return {
        "output": _err(y, y_ref if gather_output else _shard(y_ref, -1)),
        "input_grad": _err(x.grad, _shard(x_ref.grad, 0) if sequence_parallel else x_ref.grad),
        "weight_grad": _err(layer.weight.grad, _shard(ref.weight.grad, 0)),
        "bias_grad": _err(layer.bias.grad, _shard(ref.bias.grad, 0)),
    }


def _row_case(sequence_parallel, input_is_parallel, skip_bias_add):
    x_full, w_full, b_full, dy_full, ref, x_ref, y_ref = _reference_linear(FFN, HIDDEN, 8)
    layer = RowParallelLinear(
        FFN, HIDDEN, config=ModelParallelConfig(sequence_parallel=sequence_parallel),
        init_method=init_method_normal(0.02), input_is_parallel=input_is_parallel,
        skip_bias_add=skip_bias_add)
    with torch.no_grad():
        layer.weight.copy_(_shard(w_full, 1))
        layer.bias.copy_(b_full)
    x = (_shard(x_full, -1) if input_is_parallel else x_full).clone().requires_grad_()
    y, bias = layer(x)
    if skip_bias_add:
        y = y + bias
    y.backward(_shard(dy_full, 0) if sequence_parallel else dy_full)
    _reduce_sequence_parallel_grads(layer)
    tp_size, _ = _tp()
    assert getattr(layer.bias, "sequence_parallel", False) == (sequence_parallel and tp_size > 1)
    return {
        "output": _err(y, _shard(y_ref, 0) if sequence_parallel else y_ref),
        "input_grad": _err(x.grad, _shard(x_ref.grad, -1) if input_is_parallel else x_ref.grad),
        "weight_grad": _err(layer.weight.grad, _shard(ref.weight.grad, 1)),
        "bias_grad": _err(layer.bias.grad, ref.bias.grad),
    }


def _embedding_case(vocab, reduce_scatter_embeddings):
    tp_size, _ = _tp()
    padded = vocab_size_with_padding(vocab, 1, tp_size)
    g = torch.Generator().manual_seed(9)
    table = torch.randn(padded, HIDDEN, generator=g)
    ids = torch.randint(0, vocab, (BATCH, SEQ), generator=g)
    ids[0, :2] = torch.tensor([0, vocab - 1])  # both ends of the vocabulary
    dy_full = torch.randn(BATCH, SEQ, HIDDEN, generator=g)

    ref = torch.nn.Embedding(vocab, HIDDEN)
    with torch.no_grad():
        ref.weight.copy_(table[:vocab])
    y_ref = ref(ids)
    y_ref.backward(dy_full)
    ref_grad = torch.zeros(padded, HIDDEN)
    ref_grad[:vocab] = ref.weight.grad  # padding rows get no gradient

    layer = VocabParallelEmbedding(
        padded, HIDDEN, config=ModelParallelConfig(), init_method=init_method_normal(0.02),
        reduce_scatter_embeddings=reduce_scatter_embeddings)
    with torch.no_grad():
        layer.weight.copy_(_shard(table, 0))
    y = layer(ids)
    if reduce_scatter_embeddings:  # [s/tp, b, h]: this rank's sequence shard
        want, dy = _shard(y_ref.transpose(0, 1), 0), _shard(dy_full.transpose(0, 1), 0)
    else:
        want, dy = y_ref, dy_full
    y.backward(dy)
    return {"output": _err(y, want), "weight_grad": _err(layer.weight.grad, _shard(ref_grad, 0))}


def _cross_entropy_case(vocab, label_smoothing, fused):
    tp_size, _ = _tp()
    padded = vocab_size_with_padding(vocab, 1, tp_size)
    g = torch.Generator().manual_seed(10)
    logits = torch.randn(SEQ, BATCH, padded, generator=g)
    logits[..., vocab:] = 50.0  # padding columns: would dominate the softmax if counted
    target = torch.randint(0, vocab, (SEQ, BATCH), generator=g)
    target[0, 0], target[1, 0] = 0, vocab - 1
    dloss = torch.rand(SEQ, BATCH, generator=g)

    ref_logits = logits[..., :vocab].clone().requires_grad_()
    loss_ref = F.cross_entropy(ref_logits.reshape(-1, vocab), target.reshape(-1),
                               reduction="none", label_smoothing=label_smoothing)
    loss_ref = loss_ref.view(SEQ, BATCH)
    loss_ref.backward(dloss)
    ref_grad = torch.zeros(SEQ, BATCH, padded)
    ref_grad[..., :vocab] = ref_logits.grad

    local = _shard(logits, -1).clone().requires_grad_()
    # fused: the compiled path's functions, run eagerly here (test_fused_cross_entropy.py
    # compiles them).
    loss = vocab_parallel_cross_entropy(local, target, label_smoothing,
                                        vocab_size=vocab if padded != vocab else None,
                                        fused=fused, compile=False)
    loss.backward(dloss)
    return {"loss": _err(loss, loss_ref), "logits_grad": _err(local.grad, _shard(ref_grad, -1))}


def _assert_close(results):
    for rank, errors in enumerate(results):
        for name, err in errors.items():
            assert err <= TOL, f"rank {rank}: {name} max abs error {err:.3g} > {TOL}"


@pytest.mark.parametrize("tp", TP_SIZES)
@pytest.mark.parametrize("sequence_parallel,gather_output,skip_bias_add", [
    (False, False, False), (False, True, False), (False, False, True), (True, False, False)])
def test_column_parallel_linear(tp, sequence_parallel, gather_output, skip_bias_add):
    _assert_close(run_distributed(_column_case, world_size=tp, tp=tp,
                                  sequence_parallel=sequence_parallel,
                                  gather_output=gather_output, skip_bias_add=skip_bias_add))


@pytest.mark.parametrize("tp", TP_SIZES)
@pytest.mark.parametrize("sequence_parallel,input_is_parallel,skip_bias_add", [
    (False, True, False), (False, False, False), (False, True, True), (True, True, False)])
def test_row_parallel_linear(tp, sequence_parallel, input_is_parallel, skip_bias_add):
    _assert_close(run_distributed(_row_case, world_size=tp, tp=tp,
                                  sequence_parallel=sequence_parallel,
                                  input_is_parallel=input_is_parallel,
                                  skip_bias_add=skip_bias_add))


@pytest.mark.parametrize("tp", TP_SIZES)
@pytest.mark.parametrize("vocab", [16, 13])  # divisible by every TP size / by none but 1
@pytest.mark.parametrize("reduce_scatter_embeddings", [False, True])
def test_vocab_parallel_embedding(tp, vocab, reduce_scatter_embeddings):
    _assert_close(run_distributed(_embedding_case, world_size=tp, tp=tp, vocab=vocab,
                                  reduce_scatter_embeddings=reduce_scatter_embeddings))


@pytest.mark.parametrize("tp", TP_SIZES)
@pytest.mark.parametrize("vocab", [16, 13])
@pytest.mark.parametrize("label_smoothing", [0.0, 0.1])
@pytest.mark.parametrize("fused", [False, True])
def test_vocab_parallel_cross_entropy(tp, vocab, label_smoothing, fused):
    _assert_close(run_distributed(_cross_entropy_case, world_size=tp, tp=tp, vocab=vocab,
                                  label_smoothing=label_smoothing, fused=fused))


def _inplace_matches_copy():
    g = torch.Generator().manual_seed(11)
    logits = torch.randn(SEQ, BATCH, 16, generator=g)
    target = torch.randint(0, 13, (SEQ, BATCH), generator=g)
    results = []
    for inplace in (False, True):
        x = _shard(logits, -1).clone().requires_grad_()
        before = x.detach().clone()
        feed = x * 1.0  # a non-leaf the function may overwrite
        loss = vocab_parallel_cross_entropy(feed, target, 0.1, vocab_size=13, inplace=inplace)
        loss.sum().backward()
        results.append((loss.detach(), x.grad, torch.equal(x.detach(), before),
                        torch.equal(feed.detach(), before)))
    (loss_a, grad_a, leaf_a, feed_a), (loss_b, grad_b, leaf_b, feed_b) = results
    return (torch.equal(loss_a, loss_b), torch.equal(grad_a, grad_b), leaf_a and leaf_b,
            feed_a, feed_b)


@pytest.mark.parametrize("tp", [1, 2])
def test_cross_entropy_inplace_equals_copy(tp):
    for same_loss, same_grad, leaves_intact, copy_kept, inplace_kept in run_distributed(
            _inplace_matches_copy, world_size=tp, tp=tp):
        assert same_loss and same_grad and leaves_intact
        assert copy_kept and not inplace_kept  # inplace really reuses the caller's buffer


def _vectorized_vs_chunked(label_smoothing):
    """fp32 logits over 140 rows (3 chunks of 64), the model's in-place call."""
    from tests.allocation_tracker import track_allocations
    tp_size, _ = _tp()
    g = torch.Generator().manual_seed(12)
    logits = torch.randn(70, 2, 32, generator=g)
    target = torch.randint(0, 30, (70, 2), generator=g)
    dloss = torch.rand(70, 2, generator=g)
    out = {}
    for vectorized in (False, True):
        x = _shard(logits, -1).clone().requires_grad_()
        feed = x * 1.0  # non-leaf logits the function overwrites, as the model's
        with track_allocations() as track:
            loss = vocab_parallel_cross_entropy(feed, target, label_smoothing, vocab_size=30,
                                                inplace=True, vectorized=vectorized)
            (grad,) = torch.autograd.grad(loss, feed, dloss)
        track.finish()
        largest = max(e[2] for e in track.events if e[0] == "alloc")
        out[vectorized] = (loss.detach(), grad, track.peak_temporary + track.kept, largest,
                           grad.data_ptr() == feed.data_ptr())
    return out, x.numel() * 4


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("label_smoothing", [0.0, pytest.param(0.1, marks=pytest.mark.slow)])
def test_cross_entropy_vectorized_equals_chunked(tp, label_smoothing):
    """One pass over all rows (the default; CUDA's launch count) gives bitwise the chunked
    numbers, and in the same memory: the gradient is the logits buffer itself, and nothing
    else of the logits' size is allocated (peak bytes of every aten allocation, CPU)."""
    for out, logits_bytes in run_distributed(_vectorized_vs_chunked, world_size=tp, tp=tp,
                                             label_smoothing=label_smoothing):
        (loss_c, grad_c, peak_c, largest_c, _), (loss_v, grad_v, peak_v, largest_v, in_place) = \
            out[False], out[True]
        assert torch.equal(loss_v, loss_c) and torch.equal(grad_v, grad_c)
        assert in_place and largest_v < logits_bytes
        assert peak_v <= peak_c


def _autocast_case():
    config = ModelParallelConfig()
    torch.manual_seed(3)
    layers = [ColumnParallelLinear(16, 24, config=config, init_method=init_method_normal(0.02),
                                   bias=False),
              RowParallelLinear(24, 16, config=config, init_method=init_method_normal(0.02),
                                bias=False)]
    x = torch.randn(5, 2, 16)
    grads = []
    for ours in (True, False):
        inp = x.clone().requires_grad_()
        weights = [layer.weight.detach().clone().requires_grad_() for layer in layers]
        with torch.autocast("cpu", dtype=torch.bfloat16):
            if ours:
                for layer, w in zip(layers, weights):
                    layer.weight = torch.nn.Parameter(w)
                h = layers[1](layers[0](inp)[0])[0]
                weights = [layer.weight for layer in layers]
            else:
                h = F.linear(F.linear(inp, weights[0]), weights[1])
        h.float().sum().backward()
        grads.append([inp.grad] + [w.grad for w in weights])
    return grads


def test_linear_layers_under_autocast_match_f_linear():
    """Under torch.autocast the forward GEMMs run in bf16; the backward must too (it used to
    fail on a bf16 gradient times the fp32 weight), giving autograd's F.linear gradients."""
    ours, ref = run_distributed(_autocast_case, world_size=1, tp=1)[0]
    for a, b in zip(ours, ref):
        assert a.dtype == b.dtype == torch.float32 and torch.equal(a, b)
