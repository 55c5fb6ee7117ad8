"""OptimizerParamScheduler against closed-form lr / wd values written out here with `math`."""

import math

import pytest
import torch

from megatron.core.optimizer.optimizer_param_scheduler import OptimizerParamScheduler

INIT, MAX, MIN = 1e-4, 1e-2, 1e-3
W, D, WSD = 10, 110, 40  # warmup, decay end, WSD anneal length
LR_MULT, WD_MULT = 0.5, 0.0  # second group: half lr, no weight decay (Megatron's bias/norm group)
STYLES = [("constant", None), ("linear", None), ("cosine", None), ("inverse-square-root", None),
          ("WSD", "linear"), ("WSD", "cosine"), ("WSD", "exponential"), ("WSD", "minus_sqrt")]


def make_opt(cls=torch.optim.SGD):
    a, b = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(3))
    return cls([{"params": [a]}, {"params": [b], "lr_mult": LR_MULT, "wd_mult": WD_MULT}], lr=1.0)


def make(opt=None, style="linear", wsd_style=None, warmup=W, **kw):
    args = dict(init_lr=INIT, max_lr=MAX, min_lr=MIN, lr_warmup_steps=warmup, lr_decay_steps=D,
                lr_decay_style=style, start_wd=0.01, end_wd=0.1, wd_incr_steps=200,
                wd_incr_style="linear", wsd_decay_steps=WSD if style == "WSD" else None,
                lr_wsd_decay_style=wsd_style)
    args.update(kw)
    return OptimizerParamScheduler(opt if opt is not None else make_opt(), **args)


def ref_lr(s, style, wsd_style, warmup):
    """Megatron's schedule, one closed form per phase."""
    if warmup > 0 and s <= warmup:
        return INIT + (MAX - INIT) * s / warmup
    if style == "constant":
        return MAX
    if s > D:
        return MIN
    if style == "inverse-square-root":
        return max(MIN, MAX * math.sqrt(max(warmup, 1)) / math.sqrt(max(s, 1)))
    r = (s - warmup) / (D - warmup)
    if style == "linear":
        return MIN + (MAX - MIN) * (1 - r)
    if style == "cosine":
        return MIN + (MAX - MIN) * 0.5 * (math.cos(math.pi * r) + 1)
    if s <= D - WSD:  # WSD stable phase
        return MAX
    q = (s - (D - WSD)) / WSD
    coeff = {"linear": 1 - q, "cosine": 0.5 * (math.cos(math.pi * q) + 1),
             "exponential": 2 * 0.5 ** q - 1, "minus_sqrt": 1 - math.sqrt(q)}[wsd_style]
    return MIN + (MAX - MIN) * coeff


def check_groups(opt, lr, wd):
    g0, g1 = opt.param_groups
    assert g0["lr"] == pytest.approx(lr, rel=1e-12)
    assert g1["lr"] == pytest.approx(lr * LR_MULT, rel=1e-12)
    assert g0["weight_decay"] == pytest.approx(wd, rel=1e-12)
    assert g1["weight_decay"] == wd * WD_MULT


@pytest.mark.parametrize("warmup", [0, W])
@pytest.mark.parametrize("style,wsd_style", STYLES)
def test_lr_every_step_matches_closed_form(style, wsd_style, warmup):
    opt = make_opt(torch.optim.AdamW)
    sched = make(opt, style, wsd_style, warmup)
    for s in range(D + 15):
        assert sched.num_steps == s
        lr = ref_lr(s, style, wsd_style, warmup)
        assert sched.get_lr() == pytest.approx(lr, rel=1e-12), s
        check_groups(opt, lr, 0.01 + (0.1 - 0.01) * s / 200)
        sched.step(1)


@pytest.mark.parametrize("style,wsd_style", STYLES)
def test_boundaries(style, wsd_style):
    opt = make_opt()
    sched = make(opt, style, wsd_style)
    assert opt.param_groups[0]["lr"] == INIT  # constructor applied step(0)
    assert opt.param_groups[1]["lr"] == INIT * LR_MULT
    sched.step(W)
    assert sched.get_lr() == MAX  # exactly at warmup end
    sched.step(D - W)
    at_end = {"constant": MAX, "inverse-square-root": max(MIN, MAX * math.sqrt(W / D))}
    assert sched.get_lr() == pytest.approx(at_end.get(style, MIN), rel=1e-12, abs=1e-18)
    sched.step(1)
    assert sched.get_lr() == (MAX if style == "constant" else MIN)  # past decay end
    sched.step(10**6)
    assert sched.get_lr() == (MAX if style == "constant" else MIN)


def test_hand_computed_values():
    # Numbers worked out by hand, not through ref_lr: midpoint of the decay, midpoint of WSD anneal.
    mid = W + (D - W) // 2
    for style, want in [("linear", MIN + (MAX - MIN) * 0.5), ("cosine", MIN + (MAX - MIN) * 0.5)]:
        sched = make(style=style)
        sched.step(mid)
        assert sched.get_lr() == pytest.approx(want, rel=1e-12)
    half = D - WSD // 2
    for wsd_style, coeff in [("linear", 0.5), ("cosine", 0.5), ("exponential", math.sqrt(2) - 1),
                             ("minus_sqrt", 1 - math.sqrt(0.5))]:
        sched = make(style="WSD", wsd_style=wsd_style)
        sched.step(half)
        assert sched.get_lr() == pytest.approx(MIN + (MAX - MIN) * coeff, rel=1e-12)
        sched = make(style="WSD", wsd_style=wsd_style)
        sched.step(D - WSD)  # last stable step: min + 1.0 * (max - min), so only to rounding
        assert sched.get_lr() == pytest.approx(MAX, rel=1e-12)


def test_inverse_square_root_floor_and_no_warmup():
    sched = make(style="inverse-square-root", min_lr=MAX / 5, lr_decay_steps=10_000)
    sched.step(W * 4)
    assert sched.get_lr() == pytest.approx(MAX / 2, rel=1e-12)  # sqrt(10 / 40)
    sched.step(W * 26)
    assert sched.get_lr() == MAX / 5  # sqrt(10 / 300) < 1/5: floored at min_lr exactly
    sched = make(style="inverse-square-root", warmup=0)
    assert sched.get_lr() == MAX  # warmup and step both treated as 1
    sched.step(4)
    assert sched.get_lr() == pytest.approx(MAX / 2, rel=1e-12)


@pytest.mark.parametrize("wd_style", ["linear", "cosine", "constant"])
def test_weight_decay_increment(wd_style):
    start, end, n = 0.02, 0.2, 50
    if wd_style == "constant":
        start = end
    opt = make_opt()
    sched = make(opt, start_wd=start, end_wd=end, wd_incr_steps=n, wd_incr_style=wd_style)
    for s in range(n + 5):
        r = min(s / n, 1.0)
        coeff = {"linear": r, "cosine": 0.5 * (math.cos(math.pi * (1 - r)) + 1),
                 "constant": 1}[wd_style]
        want = start + coeff * (end - start)
        assert sched.get_wd() == pytest.approx(want, rel=1e-12)
        check_groups(opt, ref_lr(s, "linear", None, W), want)
        sched.step(1)
    assert sched.get_wd() == end


def test_sample_based_increments():
    # Sample-based schedules: the loop passes the global batch size as the increment.
    gbs = 32
    opt = make_opt()
    sched = make(opt, "cosine", lr_warmup_steps=10 * gbs, lr_decay_steps=100 * gbs,
                 wd_incr_steps=120 * gbs)
    for it in range(1, 110):
        sched.step(gbs)
        s = it * gbs
        r = (s - 10 * gbs) / (90 * gbs)
        want = (INIT + (MAX - INIT) * s / (10 * gbs) if s <= 10 * gbs else
                MIN + (MAX - MIN) * 0.5 * (math.cos(math.pi * r) + 1) if s <= 100 * gbs else MIN)
        check_groups(opt, want, 0.01 + 0.09 * min(s / (120 * gbs), 1))


def test_per_group_max_min_lr():
    a = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([{"params": [a], "max_lr": 2 * MAX, "min_lr": 0.0}], lr=1.0)
    sched = make(opt, "linear")
    sched.step(W + (D - W) // 2)
    assert opt.param_groups[0]["lr"] == pytest.approx(MAX, rel=1e-12)


def test_state_dict_round_trip_resumes_identically(tmp_path):
    opt_a = make_opt(torch.optim.AdamW)
    a = make(opt_a, "WSD", "minus_sqrt", wd_incr_style="cosine")
    a.step(37)
    torch.save(a.state_dict(), tmp_path / "sched.pt")
    sd = torch.load(tmp_path / "sched.pt", weights_only=True)
    assert all(isinstance(v, (int, float, str, type(None))) for v in sd.values())
    opt_b = make_opt(torch.optim.AdamW)
    b = make(opt_b, "WSD", "minus_sqrt", wd_incr_style="cosine",
             use_checkpoint_opt_param_scheduler=False)
    b.load_state_dict(sd)
    assert b.num_steps == 37
    for _ in range(100):
        assert [(g["lr"], g["weight_decay"]) for g in opt_a.param_groups] == \
               [(g["lr"], g["weight_decay"]) for g in opt_b.param_groups]
        a.step(1)
        b.step(1)


def test_override_use_checkpoint_and_mismatch():
    src = make(style="cosine")
    src.step(50)
    sd = src.state_dict()
    other = dict(style="linear", max_lr=2 * MAX, min_lr=0.0, lr_decay_steps=210)

    opt = make_opt()
    b = make(opt, override_opt_param_scheduler=True, **other)
    b.load_state_dict(sd)  # own values win, step count from the checkpoint
    got = (b.max_lr, b.lr_decay_style, b.lr_decay_steps, b.num_steps)
    assert got == (2 * MAX, "linear", 210, 50)
    assert opt.param_groups[0]["lr"] == pytest.approx(2 * MAX * (1 - 40 / 200), rel=1e-12)

    opt = make_opt()
    c = make(opt, use_checkpoint_opt_param_scheduler=True, **other)
    c.load_state_dict(sd)  # checkpoint values win
    assert (c.max_lr, c.lr_decay_style, c.lr_decay_steps, c.min_lr) == (MAX, "cosine", D, MIN)
    assert opt.param_groups[0]["lr"] == pytest.approx(ref_lr(50, "cosine", None, W), rel=1e-12)

    d = make(style="linear", use_checkpoint_opt_param_scheduler=False)
    with pytest.raises(ValueError, match="lr_decay_style.*--override-opt_param-scheduler.*"
                                         "--use-checkpoint-opt_param-scheduler"):
        d.load_state_dict(sd)
    assert d.num_steps == 0 and d.lr_decay_style == "linear"  # untouched by the failed load
    e = make(style="cosine", use_checkpoint_opt_param_scheduler=False)
    e.load_state_dict(sd)  # equal values load fine
    assert e.num_steps == 50


def test_old_checkpoint_key_names():
    old = {"start_lr": MAX, "min_lr": MIN, "warmup_iter": W, "end_iter": D,
           "decay_style": "linear", "num_iters": 60}
    opt = make_opt()
    sched = make(opt, "linear", use_checkpoint_opt_param_scheduler=False)
    sched.load_state_dict(old)
    assert sched.num_steps == 60
    check_groups(opt, ref_lr(60, "linear", None, W), 0.01 + 0.09 * 60 / 200)


@pytest.mark.parametrize("kw,flag", [
    (dict(min_lr=2 * MAX), "--min-lr"),
    (dict(min_lr=-1.0), "--min-lr"),
    (dict(init_lr=2 * MAX), "--lr-warmup-init"),
    (dict(lr_decay_steps=0), "--lr-decay-iters"),
    (dict(lr_warmup_steps=D), "--lr-warmup-iters"),
    (dict(style="poly"), "--lr-decay-style"),
    (dict(style="WSD", wsd_style="linear", wsd_decay_steps=None), "--lr-wsd-decay-iters"),
    (dict(style="WSD", wsd_style="linear", wsd_decay_steps=D + 1), "--lr-wsd-decay-iters"),
    (dict(style="WSD", wsd_style="square"), "--lr-wsd-decay-style"),
    (dict(wd_incr_style="constant"), "--start-weight-decay"),
    (dict(wd_incr_style="step"), "--weight-decay-incr-style"),
    (dict(start_wd=-0.1), "--start-weight-decay"),
    (dict(end_wd=-0.1), "--end-weight-decay"),
    (dict(wd_incr_steps=0), "--train-iters"),
    (dict(override_opt_param_scheduler=True, use_checkpoint_opt_param_scheduler=True),
     "exclusive"),
])
def test_value_errors(kw, flag):
    with pytest.raises(ValueError, match=flag):
        make(**kw)
