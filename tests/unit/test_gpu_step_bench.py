"""bench/gpu_step.py end to end on CPU with its tiny fp32 LLaMA: both models are the same model
(same initial loss) and the printed figures agree with each other and with logging/flops.py."""
import math
import os
import re
import subprocess
import sys

import pytest

from megatron.training.logging.flops import num_floating_point_operations

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# Same weights (converted from HF's), same batch, fp32: the two differ only in the order of
# their arithmetic (fused QKV, RoPE and cross-entropy written differently), a few fp32 ulps
# of a loss near ln(256) = 5.5 (measured 4.8e-7); a model with other weights is ~1e-3 away.
LOSS_TOL = 1e-5
PEAK_TFLOPS = 100.0


def _run(*extra):
    env = dict(os.environ, MEGATRON_DEVICE="cpu", OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "bench", "gpu_step.py"), "--tiny", "--steps", "2",
         "--warmup", "1", "--threads", "1", "--peak-tflops", str(PEAK_TFLOPS), *extra],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


@pytest.mark.slow  # starts processes: the full suite, not the quick tier
@pytest.mark.parametrize("microbatches", [3])
def test_tiny_run_same_model_and_sane_figures(microbatches):
    """With several micro batches a step is their gradient accumulation: the reported loss is
    their mean (the same batch each time, so the same initial loss), the FLOPs and tokens
    scale with them. (One micro batch is the same path with one pass: its own run cost a
    Python start and both models' builds for no line of the bench this one leaves out.)"""
    out = _run("--num-microbatches", str(microbatches))
    ours, hf = map(float, re.search(r"initial loss: ours ([0-9.]+) HF ([0-9.]+)", out).groups())
    assert abs(ours - hf) <= LOSS_TOL, out
    assert abs(ours - math.log(256)) < 0.1, out  # an untrained model: near uniform over 256

    found = re.search(r"model FLOPs per step: ([0-9.e+]+) .*; causal: ([0-9.e+]+)", out)
    flops, causal = map(float, found.groups())
    # --tiny: 2 layers, hidden 64, ffn 176, 4 heads, 2 groups, vocab 256, seq 32, batch 2.
    shape = (2, 64, 176, 4, 2, 32, 256, 2 * microbatches)
    expected = num_floating_point_operations(*shape, swiglu=True)
    assert math.isclose(flops, expected, rel_tol=1e-6), out
    expected = num_floating_point_operations(*shape, swiglu=True, causal=True)
    assert math.isclose(causal, expected, rel_tol=1e-6), out

    rates = {}
    for name in ("ours", "HF"):
        line = re.search(rf"{name}: median step +([0-9.]+) ms \| tokens/s +([0-9.]+) \| "
                         rf"TFLOP/s +([0-9.]+) \| MFU +([0-9.]+) % \| "
                         rf"causal MFU +([0-9.]+) % \| peak memory (\S+)", out)
        assert line, out
        ms, rate, tflops, mfu_percent, causal_percent = map(float, line.groups()[:5])
        assert ms > 0 and rate > 0, out
        # ms is printed to 0.01: its rounding alone is up to 0.005 / ms relative.
        printed = 0.005 / ms + 1e-4
        tokens = 2 * 32 * microbatches
        assert math.isclose(rate, tokens / (ms / 1e3), rel_tol=printed), out
        assert math.isclose(tflops, flops / (ms / 1e3) / 1e12, rel_tol=1e-2 + printed,
                            abs_tol=1e-4)
        assert math.isclose(mfu_percent, 100 * tflops / PEAK_TFLOPS, rel_tol=1e-2,
                            abs_tol=1e-4), out
        assert math.isclose(causal_percent, mfu_percent * causal / flops, rel_tol=1e-2,
                            abs_tol=1e-4), out
        assert line.group(6) == "n/a", out  # no allocator statistics on CPU
        rates[name] = rate
    ratio = float(re.search(r"ratio ours/HF tokens/s: ([0-9.]+)", out).group(1))
    assert math.isclose(ratio, rates["ours"] / rates["HF"], rel_tol=1e-3), out


@pytest.mark.slow  # starts processes: the full suite, not the quick tier
def test_bad_flag_is_one_error_line():
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "bench", "gpu_step.py"), "--tiny", "--vocab", "100"],
        cwd=ROOT, env=dict(os.environ, MEGATRON_DEVICE="cpu"), capture_output=True, text=True,
        timeout=60)
    assert proc.returncode != 0
    assert "multiple of 128" in proc.stderr and "Traceback" not in proc.stderr
