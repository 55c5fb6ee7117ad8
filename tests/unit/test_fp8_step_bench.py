"""bench/fp8_step.py end to end on CPU with the tiny fp32 LLaMA: every recipe runs through
pretrain's model, optimizer and train_step, from the same weights (its first loss within FP8's
rounding of the high-precision one, not equal to it), and the figures agree with each
other."""
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.slow  # starts a process: the full suite, not the quick tier
def test_tiny_fp8_bench_runs_every_recipe_from_the_same_model():
    env = dict(os.environ, MEGATRON_DEVICE="cpu", OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "bench", "fp8_step.py"), "--tiny", "--steps", "2",
         "--warmup", "1", "--threads", "1", "--fp8-format", "hybrid"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = re.findall(r"^ *(\S+(?: first| last)?): median step +([0-9.]+) ms .*\| tokens/s +"
                      r"([0-9.]+) .* first loss ([0-9.]+) \(fp32 ([0-9.]+)\)$", proc.stdout,
                      re.M)
    assert [r[0] for r in rows] == ["fp32 first", "tensorwise", "rowwise", "blockwise",
                                    "fp32 last"], proc.stdout
    for name, ms, tokens_per_s, first, reference in rows:
        # tokens / s = micro batch 2 x sequence 32 / the median step
        assert abs(float(tokens_per_s) - 64 / (float(ms) / 1e3)) <= 0.05 * float(
            tokens_per_s), name
        difference = abs(float(first) - float(reference))
        # FP8 changes the loss of the same model by its rounding (~1e-4 here), fp32 not at all
        assert (difference == 0) if name.startswith("fp32") else (0 < difference < 1e-2), \
            (name, first, reference)
