"""bench/context_parallel.py end to end with tiny sizes (2 gloo processes), and its overlap
arithmetic on a hand-made timeline."""
import os
import re
import subprocess
import sys

import pytest

from bench.context_parallel_trace import DKV_TAG, KV_TAG, Exchange, RingTrace, ring_overlap
from tests.shared_fixture import once_per_run

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
B, HQ, HKV, D, SEQ = 1, 4, 2, 16, 64
# CP=2 against CP=1 on the same inputs: the same sums in another order (per-block softmax
# merged by log-sum-exp, grads summed over blocks and ranks), so fp32 rounding only; measured
# max |diff| ~3e-7 here (~1e-6 at seq 2048), far below any real error (which is O(0.1)).
MAX_DIFF = 1e-5


def saved_bytes(name):
    """Per rank: q, out (+ k, v of its tokens, or the gathered K/V), lse; fp32."""
    s = SEQ if name == "cp1" else SEQ // 2
    kv_tokens = SEQ if name == "all_gather" else s
    return 2 * B * HQ * s * D * 4 + 2 * B * HKV * kv_tokens * D * 4 + B * HQ * s * 4


@pytest.fixture(scope="module")
@once_per_run
def output():
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "bench", "context_parallel.py"), "--seqs", str(SEQ),
         "--batch", str(B), "--heads", str(HQ), "--kv-heads", str(HKV), "--head-dim", str(D),
         "--steps", "2", "--warmup", "1", "--trace-steps", "1", "--exchange-reps", "2"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


@pytest.mark.slow  # starts processes: the full suite, not the quick tier
def test_cp2_computes_what_cp1_computes(output):
    checks = re.findall(r"check (\w+) vs CP=1, max \|diff\| out/dq/dk/dv: (.*)", output)
    assert [name for name, _ in checks] == ["p2p", "all_gather"], output
    for _, errors in checks:
        values = [float(e) for e in errors.split()]
        assert len(values) == 4 and max(values) < MAX_DIFF, output


@pytest.mark.slow  # starts processes: the full suite, not the quick tier
def test_saved_bytes_match_the_kernels_formulas(output):
    rows = re.findall(r"(\w+) rank (\d): [0-9.]+ \[[0-9.]+ (ok|MISMATCH)\]", output)
    assert sorted((n, r) for n, r, _ in rows) == [
        ("all_gather", "0"), ("all_gather", "1"), ("cp1", "0"), ("p2p", "0"), ("p2p", "1")]
    assert all(flag == "ok" for _, _, flag in rows), output
    # The script's own formula is checked against the one here through the printed ratios
    # (MiB are rounded to 0.01, too coarse at this size; the ratio has 3 decimals).
    for name in ("p2p", "all_gather"):
        ratio = float(re.search(rf"{name}/cp1, larger rank: saved ([0-9.]+)", output).group(1))
        assert ratio == pytest.approx(saved_bytes(name) / saved_bytes("cp1"), abs=5e-4)


@pytest.mark.slow  # starts processes: the full suite, not the quick tier
def test_ratios_are_of_the_printed_medians(output):
    medians = {}
    for label, name in (("CP=1 SDPA, 1 proc", "cp1"), ("CP=2 p2p", "p2p"),
                        ("CP=2 all_gather", "all_gather")):
        line = re.search(rf"{re.escape(label)}: +([0-9.]+) \(([0-9.]+)-([0-9.]+)\)", output)
        median, low, high = map(float, line.groups())
        assert 0 < low <= median <= high, output
        medians[name] = median
    for a, b in (("cp1", "p2p"), ("cp1", "all_gather"), ("all_gather", "p2p")):
        ratio = float(re.search(rf"time {a}/{b}: ([0-9.]+);", output).group(1))
        # medians are printed to 0.1 ms: relative rounding up to 0.05 / median each
        tol = 0.05 / medians[a] + 0.05 / medians[b] + 1e-3
        assert ratio == pytest.approx(medians[a] / medians[b], rel=tol), output


@pytest.mark.slow  # starts processes: the full suite, not the quick tier
def test_ring_timeline_has_the_rings_shape(output):
    """CP=2: forward posts one K/V hop; backward one K/V hop and two dK/dV hops, the last of
    which has no block left to hide behind."""
    for rank in (0, 1):
        for phase, count, bare in (("forward", 1, 0), ("backward", 3, 1)):
            line = re.search(rf"rank {rank} +{phase}: (\d+) exchanges, window ([0-9.]+) ms, "
                             rf"hidden ([0-9.]+) ms .* with no compute in window (\d+)", output)
            assert line, output
            assert int(line.group(1)) == count and int(line.group(4)) == bare, output
            assert float(line.group(3)) <= float(line.group(2)) + 0.05, output
        assert re.search(rf"all_gather rank {rank}: 2 blocking collectives", output), output


def test_overlap_arithmetic():
    """Hand-made timeline (seconds): forward computes 1..4 and 5..6; one exchange posted at 0,
    waited 4..4.5 (hidden 3 of its 4.5 s window, exposed 0.5); backward: an exchange posted at
    10 with nothing computed until its wait returns at 11."""
    trace = RingTrace(origin=0.0)
    trace.phases = {"forward": (0.0, 7.0), "backward": (10.0, 12.0)}
    trace.computes = [("block_forward", 1.0, 4.0), ("block_forward", 5.0, 6.0),
                      ("block_backward", 11.5, 11.8)]
    trace.exchanges = [Exchange(KV_TAG, "forward", 0.0, 4.0, 4.5, True),
                       Exchange(DKV_TAG, "backward", 10.0, 10.2, 11.0, False)]
    forward = ring_overlap(trace, "forward")
    assert forward["window"] == pytest.approx(4.5)
    assert forward["hidden"] == pytest.approx(3.0)
    assert forward["exposed"] == pytest.approx(0.5)
    assert forward["compute"] == pytest.approx(4.0)
    assert (forward["exchanges"], forward["unhidden_exchanges"]) == (1, 0)
    assert forward["arrived_before_wait"] == 1
    assert forward["unhidden_exposed"] == 0.0
    backward = ring_overlap(trace, "backward")
    assert backward["hidden"] == 0.0 and backward["unhidden_exchanges"] == 1
    assert backward["exposed"] == backward["unhidden_exposed"] == pytest.approx(0.8)
    assert backward["compute"] == pytest.approx(0.3)
