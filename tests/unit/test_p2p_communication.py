"""p2p_communication: every tensor a stage receives is exactly the one its neighbour sent for
that purpose (activations from the previous stage, gradients from the next), with wrap-around
for the interleaved calls; and PipelineTrace's arithmetic and atomic file writing."""
import math
import os

import pytest
import torch
import torch.distributed as dist

from megatron.core import parallel_state as ps
from megatron.core.model_parallel_config import ModelParallelConfig
from megatron.core.pipeline_parallel import p2p_communication as p2p
from megatron.core.pipeline_parallel.trace import (
    BACKWARD, FORWARD, WAIT, PipelineTrace, load_trace)
from tests.distributed import run_distributed

SHAPE = (3, 2, 4)  # [seq, micro batch, hidden]
ACT, GRAD = 1, 2
PIPELINES = [2, 4]


def _payload(sender, kind, call=0, shape=SHAPE, dtype=torch.float32):
    """A tensor naming its sender, its kind (ACT/GRAD) and the call; exact in any float dtype."""
    base = 10000 * sender + 1000 * kind + 100 * call
    return (torch.arange(math.prod(shape)) + base).to(dtype).view(*shape)


def _stage():
    return ps.get_pipeline_model_parallel_rank(), ps.get_pipeline_model_parallel_world_size()


def _plain(t):
    return None if t is None else t.detach().clone()


def _assert_is(got, want):
    """got is exactly want: same shape, dtype and values (or both None)."""
    if want is None or got is None:
        assert got is None and want is None, (got, want)
        return
    assert got.shape == want.shape and got.dtype == want.dtype, (got.shape, got.dtype)
    assert torch.equal(got, want), (got.flatten()[:4], want.flatten()[:4])


def _counted(fn, *args):
    """fn(*args), and how many batches of sends/receives it posted (0: it did nothing)."""
    posted, real = [], dist.batch_isend_irecv

    def spy(ops):
        posted.append(len(ops))
        return real(ops)

    dist.batch_isend_irecv = spy
    try:
        return fn(*args), len(posted)
    finally:
        dist.batch_isend_irecv = real


# --- 1 and 5: the plain chain, with the configured pipeline dtype ----------------------------

def _chain(pipeline_dtype):
    r, _ = _stage()
    cfg = ModelParallelConfig(params_dtype=torch.float32, pipeline_dtype=pipeline_dtype)
    dtype = pipeline_dtype or torch.float32
    x, n_rf = _counted(p2p.recv_forward, SHAPE, cfg)
    leaf = None if x is None else (x.requires_grad, x.is_leaf)
    out = _payload(r, ACT, dtype=dtype).requires_grad_() * 1  # an activation inside a graph
    _, n_sf = _counted(p2p.send_forward, out, cfg)
    g, n_rb = _counted(p2p.recv_backward, SHAPE, cfg)
    _, n_sb = _counted(p2p.send_backward, _payload(r, GRAD, dtype=dtype), cfg)
    return _plain(x), leaf, _plain(g), [n_rf, n_sf, n_rb, n_sb]


@pytest.mark.parametrize("pipeline_dtype", [None, torch.float64])
@pytest.mark.parametrize("stages", PIPELINES)
def test_send_recv_chain(stages, pipeline_dtype):
    results = run_distributed(_chain, world_size=stages, pp=stages, pipeline_dtype=pipeline_dtype)
    dtype = pipeline_dtype or torch.float32
    for r, (x, leaf, g, batches) in enumerate(results):
        first, last = r == 0, r == stages - 1
        # The first stage receives no activation and the last stage sends none (and the
        # reverse for gradients): those calls post nothing at all.
        assert batches == [int(not first), int(not last), int(not last), int(not first)]
        _assert_is(x, None if first else _payload(r - 1, ACT, dtype=dtype))
        assert leaf == (None if first else (True, True))  # a leaf whose .grad goes back
        _assert_is(g, None if last else _payload(r + 1, GRAD, dtype=dtype))


# --- 2: the 1F1B steady-state pair -----------------------------------------------------------

def _one_f_one_b():
    r, _ = _stage()
    cfg = ModelParallelConfig()
    # Stage r's backward-send pairs with stage r-1's forward-send; going down the chain in
    # this order lets each pair complete before the next one starts.
    act, n_in = _counted(p2p.send_backward_recv_forward, _payload(r, GRAD), SHAPE, cfg)
    grad, n_out = _counted(p2p.send_forward_recv_backward, _payload(r, ACT), SHAPE, cfg)
    return _plain(act), _plain(grad), [n_in, n_out]


@pytest.mark.parametrize("stages", PIPELINES)
def test_1f1b_combined_calls(stages):
    for r, (act, grad, batches) in enumerate(run_distributed(_one_f_one_b, world_size=stages,
                                                             pp=stages)):
        first, last = r == 0, r == stages - 1
        assert batches == [int(not first), int(not last)]
        _assert_is(act, None if first else _payload(r - 1, ACT))
        _assert_is(grad, None if last else _payload(r + 1, GRAD))


# --- 3: interleaved calls, wrapping around the ring ------------------------------------------

def _ring(one_way):
    r, _ = _stage()
    cfg = ModelParallelConfig()
    fwd = p2p.send_forward_recv_forward(_payload(r, ACT, call=1), True, SHAPE, cfg)
    bwd = p2p.send_backward_recv_backward(_payload(r, GRAD, call=2), True, SHAPE, cfg)
    if one_way:  # even stages send both kinds, odd stages only receive both
        sends = r % 2 == 0
        both = p2p.send_forward_backward_recv_forward_backward(
            _payload(r, ACT, call=3) if sends else None,
            _payload(r, GRAD, call=3) if sends else None,
            not sends, not sends, SHAPE, cfg)
    else:
        both = p2p.send_forward_backward_recv_forward_backward(
            _payload(r, ACT, call=3), _payload(r, GRAD, call=3), True, True, SHAPE, cfg)
    return _plain(fwd), _plain(bwd), [_plain(t) for t in both]


@pytest.mark.parametrize("one_way", [False, True], ids=["exchange", "one_way"])
@pytest.mark.parametrize("stages", PIPELINES)
def test_interleaved_calls_wrap_around(stages, one_way):
    # With 2 stages prev and next are the same peer, which sends an activation and a gradient
    # in one batch: each must land in the matching receive.
    for r, (fwd, bwd, (from_prev, from_next)) in enumerate(
            run_distributed(_ring, world_size=stages, pp=stages, one_way=one_way)):
        prev, nxt = (r - 1) % stages, (r + 1) % stages
        _assert_is(fwd, _payload(prev, ACT, call=1))
        _assert_is(bwd, _payload(nxt, GRAD, call=2))
        sender_only = one_way and r % 2 == 0
        _assert_is(from_prev, None if sender_only else _payload(prev, ACT, call=3))
        _assert_is(from_next, None if sender_only else _payload(nxt, GRAD, call=3))


# --- 4: variable sequence lengths ------------------------------------------------------------

def _act_shape(sender, _stages):
    return (1 + sender, 2, 4)


def _grad_shape(sender, stages):  # unlike any activation's, so a mix-up cannot go unseen
    return (1 + stages + sender, 2, 4)


def _variable_lengths():
    r, n = _stage()
    cfg = ModelParallelConfig(variable_seq_lengths=True)
    x = p2p.recv_forward(None, cfg)
    p2p.send_forward(_payload(r, ACT, shape=_act_shape(r, n)), cfg)
    both = p2p.send_forward_backward_recv_forward_backward(
        _payload(r, ACT, call=1, shape=_act_shape(r, n)),
        _payload(r, GRAD, call=1, shape=_grad_shape(r, n)), True, True, None, cfg)
    return _plain(x), [_plain(t) for t in both]


@pytest.mark.parametrize("stages", PIPELINES)
def test_variable_seq_lengths(stages):
    for r, (x, (from_prev, from_next)) in enumerate(
            run_distributed(_variable_lengths, world_size=stages, pp=stages)):
        prev, nxt = (r - 1) % stages, (r + 1) % stages
        _assert_is(x, None if r == 0 else _payload(r - 1, ACT, shape=_act_shape(r - 1, stages)))
        _assert_is(from_prev, _payload(prev, ACT, call=1, shape=_act_shape(prev, stages)))
        _assert_is(from_next, _payload(nxt, GRAD, call=1, shape=_grad_shape(nxt, stages)))


# --- 6: errors -------------------------------------------------------------------------------

def _error_of(fn, *args):
    try:
        fn(*args)
    except Exception as exc:  # noqa: BLE001 - the test inspects it
        return type(exc).__name__, str(exc)
    return None


def _receive_without_shape():
    return _error_of(p2p.communicate, None, None, True, False, None, ModelParallelConfig())


def test_receive_without_shape_is_a_clear_error():
    for kind, message in run_distributed(_receive_without_shape, world_size=2, pp=2, timeout=60):
        assert kind == "ValueError"
        assert "tensor_shape" in message and "variable_seq_lengths" in message


def _send_flat_with_variable_lengths():
    config = ModelParallelConfig(variable_seq_lengths=True)
    return _error_of(p2p.communicate, torch.zeros(6, 4), None, False, False, None, config)


def test_variable_lengths_need_3d_tensors():
    for kind, message in run_distributed(_send_flat_with_variable_lengths, world_size=2, pp=2,
                                         timeout=60):
        assert kind == "ValueError" and "[sequence, micro batch, hidden]" in message


def _single_stage():
    cfg = ModelParallelConfig()
    return (_error_of(p2p.communicate, None, None, True, False, SHAPE, cfg),
            _error_of(p2p.communicate, None, None, False, True, SHAPE, cfg),
            p2p.communicate(_payload(0, ACT), _payload(0, GRAD), False, False, SHAPE, cfg),
            p2p.recv_forward(SHAPE, cfg), p2p.recv_backward(SHAPE, cfg))


def test_single_stage_has_nothing_to_receive():
    (err_prev, err_next, sent, fwd, bwd), = run_distributed(_single_stage, world_size=1, pp=1)
    for kind, message in (err_prev, err_next):
        assert kind == "RuntimeError" and "one stage" in message
    assert sent == (None, None) and fwd is None and bwd is None


# --- 7: PipelineTrace ------------------------------------------------------------------------

def test_trace_spans_record_kind_microbatch_chunk_in_time_order():
    trace = PipelineTrace(rank=5, pipeline_rank=1)
    with trace.span(FORWARD, microbatch=0, chunk=1):
        pass
    with trace.span(WAIT):
        pass
    with pytest.raises(KeyError), trace.span(BACKWARD, microbatch=0, chunk=1):
        raise KeyError("a failing step is still recorded")
    assert [(e["kind"], e.get("microbatch", "-"), e.get("chunk", "-")) for e in trace.events
            ] == [(FORWARD, 0, 1), (WAIT, "-", "-"), (BACKWARD, 0, 1)]
    times = [t for e in trace.events for t in (e["start"], e["end"])]
    assert times == sorted(times) and times[0] >= 0


def test_trace_bubble_fraction():
    trace = PipelineTrace()
    assert trace.bubble_fraction() == 0.0
    trace.events = [
        {"kind": FORWARD, "start": 0.5, "end": 1.5, "microbatch": 0, "chunk": 0},
        {"kind": WAIT, "start": 1.5, "end": 3.0},
        {"kind": BACKWARD, "start": 3.0, "end": 5.0, "microbatch": 0, "chunk": 0},
        # idle gap 5.0 -> 6.0
        {"kind": FORWARD, "start": 6.0, "end": 7.5, "microbatch": 1, "chunk": 0},
    ]
    busy = 1.0 + 2.0 + 1.5
    assert trace.busy_time() == pytest.approx(busy)
    assert trace.bubble_fraction() == pytest.approx(1 - busy / (7.5 - 0.5))


def test_trace_write_is_atomic_and_round_trips(tmp_path):
    directory = tmp_path / "traces"  # write creates it
    path = directory / "trace_rank3.json"
    trace = PipelineTrace(rank=3, pipeline_rank=1, info={"iteration": 2, "virtual_size": None})
    trace.events = [{"kind": FORWARD, "start": 0.1, "end": 1 / 3, "microbatch": 2, "chunk": 1},
                    {"kind": WAIT, "start": 1 / 3, "end": 2.000000000000001}]
    trace.write(str(path))
    assert load_trace(str(path)) == {"rank": 3, "pipeline_rank": 1, "iteration": 2,
                                     "virtual_size": None, "clock_origin": trace.clock_origin,
                                     "events": trace.events}
    assert os.listdir(directory) == ["trace_rank3.json"]

    good = load_trace(str(path))
    trace.events = trace.events + [{"kind": WAIT, "start": 3.0, "end": object()}]
    with pytest.raises(TypeError):  # not JSON: the old file stays whole, no temp file left
        trace.write(str(path))
    assert load_trace(str(path)) == good
    assert os.listdir(directory) == ["trace_rank3.json"]
