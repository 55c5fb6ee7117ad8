"""bench/pipeline.py end to end with tiny sizes (2 gloo processes): every schedule runs and is
printed, the gradient check passes, and the printed numbers are those of the traces it wrote
and of the formulas (never timings)."""
import glob
import json
import os
import re
import statistics
import subprocess
import sys

import pytest

from bench.pipeline import all_schedules
from tests.shared_fixture import once_per_run

pytestmark = pytest.mark.slow  # runs bench/pipeline.py: the full suite, not the quick tier

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
M = 8  # microbatches; PP = 2
SCHEDULES = all_schedules()


@pytest.fixture(scope="module")
@once_per_run
def run(tmp_path_factory):
    traces = tmp_path_factory.mktemp("traces")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "bench", "pipeline.py"), "--layers", "4",
         "--hidden", "32", "--heads", "4", "--groups", "2", "--ffn", "64", "--vocab", "128",
         "--seq", "8", "--micro-batch-size", "1", "--microbatches", str(M), "--steps", "1",
         "--warmup", "1", "--trace-steps", "2", "--trace-dir", str(traces)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout, str(traces)


def _rows(output, kind):
    return dict(re.findall(rf"^  {kind} +(\S+): (.*)$", output, re.M))


def test_every_schedule_is_printed(run):
    output, _ = run
    assert {"1f1b", "zb-h1", "zbv", "torch-1f1b", "torch-zb", "torch-zbv"} <= set(SCHEDULES)
    for kind in ("check", "speed", "bubble"):
        assert list(_rows(output, kind)) == SCHEDULES, (kind, output)
    assert len(re.findall(r"^target: ", output, re.M)) == 4, output


def test_gradient_check_passed(run):
    output, _ = run
    checks = _rows(output, "check")
    assert all(row.endswith("PASSED") for row in checks.values()), output
    # Ours: the same arithmetic as 1F1B in every schedule (B/W splitting changes no sum).
    for name in ("zb-h1", "zbv"):
        assert "max |diff| 0.000e+00" in checks[name] and "bitwise True" in checks[name]
    losses = {float(re.search(r"mean loss (\S+)", row).group(1)) for row in checks.values()}
    assert max(losses) - min(losses) <= 1e-5, losses


def _trace_bubble(events):
    span = events[-1]["end"] - events[0]["start"]
    busy = sum(e["end"] - e["start"] for e in events if e["kind"] != "wait")
    return 1 - busy / span


def test_printed_bubbles_are_the_traces(run):
    output, traces = run
    for name, row in _rows(output, "bubble").items():
        per_rank = []
        for rank in (0, 1):
            files = sorted(glob.glob(os.path.join(traces, name, "step*",
                                                  f"trace_rank{rank:05d}.json")))
            assert len(files) == 2, (name, files)
            bubbles = [_trace_bubble(json.load(open(f))["events"]) for f in files]
            per_rank.append(statistics.median(bubbles))
            printed = float(re.search(rf"rank{rank} (\S+)", row).group(1))
            assert printed == pytest.approx(per_rank[-1], abs=5.1e-5), (name, row)
        mean = float(re.search(r"mean (\S+)", row).group(1))
        assert mean == pytest.approx(statistics.mean(per_rank), abs=5.1e-5), (name, row)


def test_theory_is_the_formulas(run):
    output, _ = run
    theory = {n: re.search(r"theory (\S+)", row).group(1)
              for n, row in _rows(output, "bubble").items()}
    # 1F1B (p-1)/(m+p-1); ZB-H1 (p-1)/(3m+p-1); ZB-V (p-1)/(6m+p-1), F=B=W.
    assert float(theory["1f1b"]) == float(theory["torch-1f1b"]) == round(1 / (M + 1), 3)
    assert float(theory["zb-h1"]) == round(1 / (3 * M + 1), 3)
    assert float(theory["zbv"]) == round(1 / (6 * M + 1), 3)
    assert all(theory[n] == "-" for n in SCHEDULES if n.startswith("torch-") and
               n != "torch-1f1b")


def test_traces_hold_the_schedules_steps(run):
    """Every traced step holds each microbatch's forward and backward on every chunk; W steps
    exactly under the zero-bubble schedules (ours and torch's), one per B."""
    _, traces = run
    for name in SCHEDULES:
        for path in glob.glob(os.path.join(traces, name, "step*", "trace_rank*.json")):
            events = json.load(open(path))["events"]
            steps = {}
            for e in events:
                if e["kind"] != "wait":
                    steps.setdefault(e["kind"], []).append((e["microbatch"], e["chunk"]))
            chunks = 2 if name in ("zbv", "torch-zbv", "torch-dualpipev") else 1
            want = sorted((mb, c) for mb in range(M) for c in range(chunks))
            assert sorted(steps["backward"]) == want, (name, path)
            assert set(steps["forward"]) == set(want), (name, path)  # + the loss's span
            zero_bubble = name in ("zb-h1", "zbv", "torch-zb", "torch-zbv")
            if zero_bubble:
                assert sorted(steps["weight"]) == want, (name, path)
            elif name == "1f1b" or name == "torch-1f1b":
                assert "weight" not in steps, (name, path)


def test_ratios_are_of_the_printed_medians(run):
    output, _ = run
    medians = {n: float(re.search(r"median +(\S+) ms", row).group(1))
               for n, row in _rows(output, "speed").items()}
    for n, row in _rows(output, "speed").items():
        ratio = float(re.search(r"x1f1b +(\S+)", row).group(1))
        assert ratio == pytest.approx(medians["1f1b"] / medians[n], rel=2e-3, abs=2e-3)
