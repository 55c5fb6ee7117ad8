"""The zero-bubble orders (zb-h1, zbv) as pure functions: every step once and in a runnable
order, the V's messages, a strict-transport replay without deadlock, the bubble formulas
exactly (unit costs: floats of integers), the memory bounds, and 1F1B / interleaved
unchanged."""
import hashlib
import os

import pytest

from megatron.core.pipeline_parallel.schedule_order import (
    BACKWARD,
    FORWARD,
    WEIGHT,
    Step,
    check_schedule_settings,
    max_in_flight,
    schedule_order,
    virtual_stage,
)
from megatron.core.pipeline_parallel.simulate import (
    ACTIVATION,
    GRADIENT,
    Message,
    Op,
    communication_plan,
    is_first_stage,
    is_last_stage,
    simulate,
    step_messages,
    theoretical_bubble_zero,
    zero_bubble_idle,
)
from tests.e2e.runner import load_tool

SIZES = (2, 3, 4, 6)


def _grid(schedule):
    for p in SIZES:
        for m in ((p,) if schedule == "zb-h1" else ()) + (2 * p, 2 * p + 1, 3 * p, 4 * p):
            yield p, m


GRID = [("zb-h1", p, m) for p, m in _grid("zb-h1")] + [("zbv", p, m) for p, m in _grid("zbv")]


def _unit_timeline(p, m, schedule):
    return simulate(p, m, forward_cost=1.0, backward_cost=1.0, weight_cost=1.0,
                    schedule=schedule)


@pytest.mark.parametrize("schedule,p,m", GRID)
def test_every_step_once_in_dependency_order(schedule, p, m):
    chunks = 2 if schedule == "zbv" else 1
    timeline = _unit_timeline(p, m, schedule)
    ends = {}  # (kind, virtual stage, microbatch) -> (start, end)
    for rank in range(p):
        order = schedule_order(p, rank, m, schedule=schedule)
        assert [s for s, _, _ in timeline.steps[rank]] == order
        assert sorted((s.kind, s.chunk, s.microbatch) for s in order) == sorted(
            (k, c, b) for k in (FORWARD, BACKWARD, WEIGHT) for c in range(chunks)
            for b in range(m))
        position = {(s.kind, s.chunk, s.microbatch): i for i, s in enumerate(order)}
        for c in range(chunks):
            for b in range(m):
                assert position[(FORWARD, c, b)] < position[(BACKWARD, c, b)] \
                    < position[(WEIGHT, c, b)]
            # W's in the order of their B's (the weight-gradient store is FIFO per chunk)
            backs = [s.microbatch for s in order if s.kind == BACKWARD and s.chunk == c]
            weights = [s.microbatch for s in order if s.kind == WEIGHT and s.chunk == c]
            assert backs == weights == list(range(m))
        for step, start, end in timeline.steps[rank]:
            v = virtual_stage(step, p, rank, schedule)
            ends[(step.kind, v, step.microbatch)] = (start, end)
    last = p * chunks - 1
    for b in range(m):
        for v in range(last + 1):
            if v > 0:  # F of stage v after F of v-1; B of v after B of v+1
                assert ends[(FORWARD, v, b)][0] >= ends[(FORWARD, v - 1, b)][1]
            if v < last:
                assert ends[(BACKWARD, v, b)][0] >= ends[(BACKWARD, v + 1, b)][1]
        assert ends[(BACKWARD, last, b)][0] >= ends[(FORWARD, last, b)][1]


@pytest.mark.parametrize("schedule,p,m", GRID)
def test_memory_bounds(schedule, p, m):
    # zb-h1: at most p forwards waiting for their W (1F1B's peak); zbv: 2p half-size chunks.
    bound = 2 * p if schedule == "zbv" else p
    peaks = [max_in_flight(schedule_order(p, r, m, schedule=schedule)) for r in range(p)]
    assert max(peaks) == bound and all(peak <= bound for peak in peaks)


def test_max_in_flight_holds_memory_until_w():
    order = [Step(FORWARD, 0), Step(FORWARD, 1), Step(BACKWARD, 0), Step(FORWARD, 2),
             Step(WEIGHT, 0), Step(BACKWARD, 1), Step(WEIGHT, 1)]
    assert max_in_flight(order) == 3  # F0 F1 F2 alive until W0: B0 frees nothing
    assert max_in_flight(schedule_order(4, 0, 8)) == 4  # without W, B frees


def test_zb_h1_order_by_hand():
    F, B, W = (lambda k: Step(FORWARD, k)), (lambda k: Step(BACKWARD, k)), \
        (lambda k: Step(WEIGHT, k))
    # PP=2, 4 microbatches. Rank 0: 1F1B with W right after B. Rank 1: W one B late.
    assert schedule_order(2, 0, 4, schedule="zb-h1") == [
        F(0), F(1), B(0), W(0), F(2), B(1), W(1), F(3), B(2), W(2), B(3), W(3)]
    assert schedule_order(2, 1, 4, schedule="zb-h1") == [
        F(0), B(0), F(1), B(1), W(0), F(2), B(2), W(1), F(3), B(3), W(2), W(3)]


@pytest.mark.parametrize("schedule,p,m", GRID)
def test_bubble_equals_the_formula(schedule, p, m):
    timeline = _unit_timeline(p, m, schedule)
    busy = 3 * m * (2 if schedule == "zbv" else 1)
    idle = [timeline.end_time - sum(e - s for _, s, e in timeline.steps[r]) for r in range(p)]
    expected = zero_bubble_idle(p, schedule)
    assert idle == [expected] * p  # exact: sums of unit costs
    assert timeline.bubble_fraction() == pytest.approx(
        theoretical_bubble_zero(p, m, schedule), abs=1e-12)
    assert timeline.end_time == busy + expected


@pytest.mark.parametrize("p", SIZES)
def test_zb_h1_bubble_is_a_third_of_1f1b(p):
    m = 2 * p
    ours = _unit_timeline(p, m, "zb-h1")
    one_f_one_b = simulate(p, m, forward_cost=1.0, backward_cost=2.0)  # B + W as one step
    assert one_f_one_b.end_time - 3 * m == 3 * (p - 1)  # (p-1)(F+B+W)
    assert ours.end_time - 3 * m == p - 1  # (p-1)(F+B-W)


@pytest.mark.parametrize("schedule", ["zb-h1", "zbv"])
@pytest.mark.parametrize("p", [2, 4])
@pytest.mark.parametrize("forward_only", [False, True])
@pytest.mark.parametrize("by_kind", [True, False])
def test_replay_has_no_deadlock_and_messages_match(schedule, p, forward_only, by_kind):
    for m in (p, 2 * p, 2 * p + 1):
        if schedule == "zbv" and m < 2 * p:
            with pytest.raises(ValueError, match="at least 2 x pipeline size"):
                simulate(p, m, schedule=schedule)
            continue
        for costs in ((1.0, 1.0, 1.0), (1.0, 2.0, 0.0), (1.0, 1.5, 0.5), (2.0, 1.0, 3.0)):
            timeline = simulate(p, m, forward_only=forward_only, forward_cost=costs[0],
                                backward_cost=costs[1], weight_cost=costs[2],
                                schedule=schedule, channels_by_kind=by_kind)
            assert all(timeline.steps[r] for r in range(p))
        # every receive has exactly one send, same message, from the right peer
        sends, recvs = [], []
        for rank in range(p):
            for ops, _ in communication_plan(p, rank, m, None, forward_only, schedule):
                for op in ops:
                    (sends if op.send else recvs).append(
                        ((rank, op.peer) if op.send else (op.peer, rank), op.message))
        assert sorted(sends, key=repr) == sorted(recvs, key=repr)
        assert len(set(map(repr, sends))) == len(sends)


def test_v_messages_and_local_hand_overs():
    p = 4
    F, B, W = (lambda c: Step(FORWARD, 5, c)), (lambda c: Step(BACKWARD, 5, c)), \
        (lambda c: Step(WEIGHT, 5, c))

    def msgs(step, rank):
        return step_messages(step, p, rank, None, "zbv")

    # rank 1: chunk 0 = stage 1 (from rank 0, to rank 2), chunk 1 = stage 6 (from 2, to 0)
    assert msgs(F(0), 1) == (Op(False, 0, Message(ACTIVATION, 5, 1)),
                             Op(True, 2, Message(ACTIVATION, 5, 2)))
    assert msgs(F(1), 1) == (Op(False, 2, Message(ACTIVATION, 5, 6)),
                             Op(True, 0, Message(ACTIVATION, 5, 7)))
    assert msgs(B(1), 1) == (Op(False, 0, Message(GRADIENT, 5, 6)),
                             Op(True, 2, Message(GRADIENT, 5, 5)))
    assert msgs(B(0), 1) == (Op(False, 2, Message(GRADIENT, 5, 1)),
                             Op(True, 0, Message(GRADIENT, 5, 0)))
    # the last rank hands over locally between its chunks (stages 3 and 4)
    assert msgs(F(0), 3) == (Op(False, 2, Message(ACTIVATION, 5, 3)), None)
    assert msgs(F(1), 3) == (None, Op(True, 2, Message(ACTIVATION, 5, 5)))
    assert msgs(B(1), 3) == (Op(False, 2, Message(GRADIENT, 5, 4)), None)
    assert msgs(B(0), 3) == (None, Op(True, 2, Message(GRADIENT, 5, 2)))
    # rank 0 holds the first stage and the loss
    assert msgs(F(0), 0) == (None, Op(True, 1, Message(ACTIVATION, 5, 1)))
    assert msgs(F(1), 0) == (Op(False, 1, Message(ACTIVATION, 5, 7)), None)
    assert msgs(B(1), 0) == (None, Op(True, 1, Message(GRADIENT, 5, 6)))
    assert msgs(B(0), 0) == (Op(False, 1, Message(GRADIENT, 5, 0)), None)
    for rank in range(p):
        for c in (0, 1):
            assert msgs(W(c), rank) == (None, None)
            assert step_messages(Step(WEIGHT, 0), p, rank, None, "zb-h1") == (None, None)
    assert [virtual_stage(F(c), p, r, "zbv") for r in range(p) for c in (0, 1)] == \
        [0, 7, 1, 6, 2, 5, 3, 4]
    firsts = [(r, c) for r in range(p) for c in (0, 1) if is_first_stage(F(c), p, r, "zbv")]
    lasts = [(r, c) for r in range(p) for c in (0, 1)
             if is_last_stage(F(c), p, r, None, "zbv")]
    assert firsts == [(0, 0)] and lasts == [(0, 1)]
    assert is_last_stage(F(0), p, 3) and is_last_stage(F(1), p, 3, 2)
    assert not is_last_stage(F(0), p, 3, 2)


def _encode(order):
    return " ".join(f"{s.kind}{s.microbatch}" + (f".{s.chunk}" if s.chunk else "")
                    for s in order)


def test_1f1b_and_interleaved_unchanged():
    # today's orders and plans (taken from the code before zero-bubble schedules existed)
    expected = {(2, 3, None, 0): "F0 F1 B0 F2 B1 B2", (2, 3, None, 1): "F0 B0 F1 B1 F2 B2",
                (4, 6, None, 0): "F0 F1 F2 F3 B0 F4 B1 F5 B2 B3 B4 B5",
                (4, 6, None, 3): "F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5",
                (2, 4, 2, 0): "F0 F1 F0.1 F1.1 F2 B0.1 F3 B1.1 F2.1 B0 F3.1 B1 B2.1 B3.1 B2 B3",
                (2, 4, 2, 1): "F0 F1 F0.1 B0.1 F1.1 B1.1 F2 B0 F3 B1 F2.1 B2.1 F3.1 B3.1 B2 B3"}
    for (p, m, v, r), order in expected.items():
        named = "interleaved" if v else "1f1b"
        assert _encode(schedule_order(p, r, m, v)) == order
        assert _encode(schedule_order(p, r, m, v, schedule=named)) == order

    def digest(plans):
        return hashlib.sha256(repr(plans).encode()).hexdigest()

    assert digest([communication_plan(4, r, 8, 2) for r in range(4)]) == \
        "5a7f8e7f5dc28f5bd4fd7e18db8df1d7b218e1fee689e4148f253abec6694df3"
    assert digest([communication_plan(4, r, 6, schedule="1f1b") for r in range(4)]) == \
        "bae21ccd6f29bdd29f53c4960711235e0510d2fad572e05e6342482b3e7d800e"
    assert simulate(4, 8, 2).end_time == 57.0
    assert simulate(4, 8, 2, weight_cost=5.0).end_time == 57.0  # no W steps: no effect


@pytest.mark.parametrize("args,match", [
    ((4, 7, None, "zbv"), "zbv schedule needs at least 2 x pipeline size = 8 microbatches"),
    ((1, 4, None, "zbv"), "zbv schedule needs pipeline-model-parallel size >= 2"),
    ((4, 8, 3, "zbv"), "exactly 2 model chunks per rank"),
    ((4, 8, 2, "zb-h1"), "zb-h1 schedule runs one model chunk per rank"),
    ((4, 8, 2, "1f1b"), "drop --num-layers-per-virtual-pipeline-stage"),
    ((4, 8, None, "interleaved"), "add --num-layers-per-virtual-pipeline-stage"),
    ((4, 8, None, "gpipe"), "unknown pipeline schedule 'gpipe'"),
])
def test_bad_schedule_settings(args, match):
    with pytest.raises(ValueError, match=match):
        check_schedule_settings(*args)
    with pytest.raises(ValueError, match=match):
        schedule_order(args[0], 0, args[1], args[2], schedule=args[3])


def test_good_schedule_settings():
    check_schedule_settings(4, 8, 2, "zbv")  # the executor's virtual size 2 is accepted
    check_schedule_settings(4, 8, None, "zbv")
    check_schedule_settings(4, 2, None, "zb-h1")  # fewer microbatches than stages: runs
    check_schedule_settings(4, 8, 2, "interleaved")


@pytest.mark.parametrize("schedule", ["zb-h1", "zbv"])
def test_plot_draws_the_planned_zero_bubble_orders(tmp_path, capsys, schedule):
    plot_pipeline = load_tool("plot_pipeline")
    out = tmp_path / f"{schedule}.png"
    assert plot_pipeline.main(["--planned", "--schedule", schedule, "--pipeline-size", "2",
                               "--num-microbatches", "4", "--backward-cost", "1",
                               "--out", str(out)]) == 0
    assert os.listdir(tmp_path) == [out.name] and out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    printed = capsys.readouterr().out
    bubble = f"{theoretical_bubble_zero(2, 4, schedule):.1%}"
    assert f"simulated bubble {bubble}, theoretical {bubble}" in printed
    timeline = plot_pipeline.build_timeline(plot_pipeline.parse_args(
        ["--planned", "--schedule", schedule, "--pipeline-size", "2", "--num-microbatches",
         "4", "--backward-cost", "1", "--out", "x.png"]))
    kinds = {bar.kind for row in timeline.rows for bar in row}
    assert kinds == {"forward", "backward", "weight"}
