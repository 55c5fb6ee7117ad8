"""The schedule as a pure function: order of steps, warmup counts, activations in flight,
layer split over stages, and a replay of all ranks that would catch a deadlock or a message
landing in the wrong receive."""
import itertools

import pytest

from megatron.core.pipeline_parallel import simulate as simulate_module
from megatron.core.pipeline_parallel.layer_split import chunk_layer_range, stage_layer_counts
from megatron.core.pipeline_parallel.schedule_order import (
    BACKWARD,
    FORWARD,
    Step,
    check_schedule_settings,
    max_in_flight,
    num_warmup_steps,
    schedule_order,
)
from megatron.core.pipeline_parallel.simulate import ScheduleDeadlock, simulate


def _valid_settings(max_pp=8):
    for pp in (1, 2, 3, 4, max_pp):
        for vpp in (None, 2, 3):
            if vpp and pp < 2:
                continue
            for m in range(1, 3 * pp + 2):
                if vpp and m % pp:
                    continue
                yield pp, vpp, m


def test_1f1b_order_by_hand():
    # PP=4, 6 microbatches, rank 1: two warmup forwards, then 1F1B, then two backwards.
    F = lambda m: Step(FORWARD, m)  # noqa: E731
    B = lambda m: Step(BACKWARD, m)  # noqa: E731
    assert schedule_order(4, 1, 6) == [F(0), F(1), F(2), B(0), F(3), B(1), F(4), B(2), F(5),
                                       B(3), B(4), B(5)]
    assert schedule_order(4, 3, 2) == [F(0), B(0), F(1), B(1)]
    assert schedule_order(4, 0, 2) == [F(0), F(1), B(0), B(1)]  # fewer microbatches than PP


def test_interleaved_order_by_hand():
    # PP=2, VPP=2, 4 microbatches, rank 0: groups of PP microbatches walk through the chunks.
    order = schedule_order(2, 0, 4, virtual_size=2)
    forwards = [(s.microbatch, s.chunk) for s in order if s.kind == FORWARD]
    backwards = [(s.microbatch, s.chunk) for s in order if s.kind == BACKWARD]
    assert forwards == [(0, 0), (1, 0), (0, 1), (1, 1), (2, 0), (3, 0), (2, 1), (3, 1)]
    assert backwards == [(0, 1), (1, 1), (0, 0), (1, 0), (2, 1), (3, 1), (2, 0), (3, 0)]
    assert [s.kind for s in order[:5]] == [FORWARD] * 4 + [FORWARD]  # 4 warmup, then 1F1B
    assert order[5].kind == BACKWARD


def test_warmup_counts():
    assert [num_warmup_steps(4, r, 8) for r in range(4)] == [3, 2, 1, 0]
    assert [num_warmup_steps(4, r, 2) for r in range(4)] == [2, 2, 1, 0]
    # Megatron: (PP - rank - 1) * 2 + (VPP - 1) * PP, all forwards first when m == PP.
    assert [num_warmup_steps(4, r, 8, 2) for r in range(4)] == [10, 8, 6, 4]
    assert [num_warmup_steps(2, r, 2, 2) for r in range(2)] == [4, 4]
    assert num_warmup_steps(4, 3, 8, forward_only=True) == 8


@pytest.mark.parametrize("pp,vpp,m", list(_valid_settings()))
def test_every_step_once_and_in_flight_bounded(pp, vpp, m):
    chunks = vpp or 1
    for rank in range(pp):
        order = schedule_order(pp, rank, m, vpp)
        expected = {(k, mb, c) for k in (FORWARD, BACKWARD) for mb in range(m)
                    for c in range(chunks)}
        assert sorted((s.kind, s.microbatch, s.chunk) for s in order) == sorted(expected)
        done_forward = set()
        for step in order:  # each backward after its forward; per chunk in microbatch order
            if step.kind == FORWARD:
                done_forward.add((step.microbatch, step.chunk))
            else:
                assert (step.microbatch, step.chunk) in done_forward
        for c in range(chunks):
            backs = [s.microbatch for s in order if s.kind == BACKWARD and s.chunk == c]
            assert backs == sorted(backs)
        warmup = num_warmup_steps(pp, rank, m, vpp)
        assert max_in_flight(order) == min(warmup + 1, m * chunks)
        if vpp is None:
            assert max_in_flight(order) <= min(pp - rank, m) <= pp
        elif m > pp:  # Megatron's interleaved bound (with m == PP all forwards run first)
            assert max_in_flight(order) <= (pp - rank - 1) * 2 + (vpp - 1) * pp + 1
        forward_only = schedule_order(pp, rank, m, vpp, forward_only=True)
        assert [s.kind for s in forward_only] == [FORWARD] * (m * chunks)


@pytest.mark.parametrize("by_kind", [True, False])
def test_no_deadlock_and_messages_match(by_kind):
    for pp, vpp, m in _valid_settings():
        for forward_only in (False, True):
            simulate(pp, m, vpp, forward_only, channels_by_kind=by_kind)


def test_simulated_bubble_is_the_theoretical_one():
    for pp, vpp, m in [(2, None, 8), (4, None, 8), (4, None, 3), (4, 2, 8), (4, 4, 16)]:
        theory = (pp - 1) / (m * (vpp or 1) + pp - 1)
        assert simulate(pp, m, vpp).bubble_fraction() == pytest.approx(theory, abs=1e-12)


def test_replay_catches_a_deadlock(monkeypatch):
    # One round per step (no pairing of steady-state forward and backward) hangs interleaving.
    monkeypatch.setattr(simulate_module, "step_units",
                        lambda order, warmup, paired: [[step] for step in order])
    with pytest.raises(ScheduleDeadlock, match="stuck"):
        simulate(4, 8, 2)


def test_replay_catches_a_mismatched_message(monkeypatch):
    # Sends posted activation first but receives gradient first: on a two-rank pipeline,
    # where activations and gradients share one channel, a gradient lands in an activation's
    # receive.
    monkeypatch.setattr(simulate_module, "_canonical", lambda ops: sorted(
        ops, key=lambda op: (op.message.kind == "activation") != op.send))
    with pytest.raises(ScheduleDeadlock, match="would be matched with"):
        simulate(2, 4, 2, channels_by_kind=False)


@pytest.mark.parametrize("pp,vpp,m,match", [
    (2, None, 0, "microbatches must be >= 1"),
    (4, 2, 6, "multiple of the pipeline-model-parallel size"),
    (1, 2, 2, "needs pipeline-model-parallel size >= 2"),
])
def test_bad_schedule_settings(pp, vpp, m, match):
    with pytest.raises(ValueError, match=match):
        check_schedule_settings(pp, m, vpp)
    with pytest.raises(ValueError, match=match):
        schedule_order(pp, 0, m, vpp)


def test_layer_split_even_and_uneven():
    assert stage_layer_counts(8, 4) == [2, 2, 2, 2]
    assert stage_layer_counts(10, 4, first_stage_layers=1, last_stage_layers=3) == [1, 3, 3, 3]
    assert stage_layer_counts(7, 3, last_stage_layers=1) == [3, 3, 1]
    assert stage_layer_counts(5, 2, first_stage_layers=2, last_stage_layers=3) == [2, 3]
    # Virtual chunk c of rank r is slice c * PP + r of the model.
    ranges = {(r, c): chunk_layer_range(8, 2, r, c, virtual_size=2)
              for r, c in itertools.product(range(2), range(2))}
    assert ranges == {(0, 0): (0, 2), (1, 0): (2, 4), (0, 1): (4, 6), (1, 1): (6, 8)}
    uneven = [chunk_layer_range(12, 3, r, c, 2, first_stage_layers=2, last_stage_layers=6)
              for c in range(2) for r in range(3)]
    assert uneven == [(0, 1), (1, 3), (3, 6), (6, 7), (7, 9), (9, 12)]


def test_layer_split_accounting_for_embedding_and_loss():
    # 6 layers + embedding + loss = 8 "layers" over 4 stages: the ends hold one layer fewer.
    assert stage_layer_counts(6, 4, account_for_embedding=True, account_for_loss=True) == \
        [1, 2, 2, 1]
    assert stage_layer_counts(7, 4, account_for_loss=True) == [2, 2, 2, 1]
    # With virtual stages only the first and the last virtual stage are lighter.
    ranges = [chunk_layer_range(14, 2, r, c, 2, account_for_embedding=True,
                                account_for_loss=True) for c in range(2) for r in range(2)]
    assert ranges == [(0, 3), (3, 7), (7, 11), (11, 14)]


@pytest.mark.parametrize("args,match", [
    (dict(num_layers=5, pipeline_size=2), "cannot be split evenly over 2"),
    (dict(num_layers=6, pipeline_size=2, virtual_size=2), "do not split evenly over 2 virtual"),
    (dict(num_layers=4, pipeline_size=2, first_stage_layers=0), "at least 1"),
    (dict(num_layers=4, pipeline_size=1, last_stage_layers=2), "need pipeline"),
    (dict(num_layers=6, pipeline_size=3, first_stage_layers=3, last_stage_layers=3),
     "cannot be split evenly over 1"),
    (dict(num_layers=6, pipeline_size=4, account_for_loss=True), "cannot be split evenly"),
    (dict(num_layers=2, pipeline_size=4, account_for_embedding=True, account_for_loss=True),
     "no transformer layer"),
    (dict(num_layers=7, pipeline_size=4, account_for_loss=True, first_stage_layers=1),
     "not both"),
])
def test_bad_layer_splits(args, match):
    with pytest.raises(ValueError, match=match):
        stage_layer_counts(**args)
