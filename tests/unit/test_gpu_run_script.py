"""shtools/gpu_run.sh --dry-run: the prepared GPU run's steps, on CPU with tiny sizes, so the
script cannot rot between the rare sessions that have a GPU. Every step runs and succeeds
(the compiled bench is skipped: tests/unit/test_torch_compile.py compiles on CPU), the summary
holds each figure, and the output stays within what a lent machine sends back (8 files)."""
import pytest
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.slow  # starts processes: the full suite, not the quick tier
def test_dry_run_runs_every_step_and_summarises(tmp_path):
    out = tmp_path / "out"
    env = dict(os.environ, PYTHON=sys.executable, GPU_RUN_BUDGET_S="300")
    proc = subprocess.run(["bash", os.path.join(ROOT, "shtools", "gpu_run.sh"), str(out),
                           "--dry-run"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = (out / "summary.txt").read_text()
    for name in ("machine", "bench_fp8", "tests", "bench_eager", "pretrain"):
        assert re.search(rf"^{name}: rc=0 in \d+s", summary, re.M), (name, summary)
    assert "bench_compile: skipped in a dry run" in summary
    assert "probes: 8 OK, 0 failed" in summary
    # bench/fp8_step.py: every recipe through pretrain's model and train_step, from the same
    # weights (the first loss within FP8's rounding of fp32's, not equal to it); tokens/s =
    # micro batch 2 x sequence 32 x 4 micro batches / the median step.
    rows = re.findall(r"^ *(\S+(?: first| last)?): median step +([0-9.]+) ms .*\| tokens/s +"
                      r"([0-9.]+) .* first loss ([0-9.]+) \(fp32 ([0-9.]+)\)$", summary, re.M)
    assert [r[0] for r in rows] == ["fp32 first", "tensorwise", "rowwise", "blockwise",
                                    "fp32 last"], summary
    for name, ms, tokens_per_s, first, reference in rows:
        assert abs(float(tokens_per_s) - 256 / (float(ms) / 1e3)) <= 0.05 * float(
            tokens_per_s), name
        difference = abs(float(first) - float(reference))
        assert (difference == 0) if name.startswith("fp32") else (0 < difference < 1e-2), \
            (name, first, reference)
    for recipe in ("tensorwise", "rowwise", "blockwise"):  # where each FP8 step's time goes
        assert f"profile of one step, {recipe} (4 micro batches)" in summary, summary
    assert re.search(r"^=+ \d+ skipped", summary, re.M), summary  # the GPU tier: needs CUDA
    assert re.search(r"^pretrain: .*iteration +20/ +20 .*lm loss", summary, re.M), summary
    assert re.search(r"^ours: median step .* causal MFU", summary, re.M), summary
    assert re.search(r"^ratio ours/HF tokens/s: [0-9.]+$", summary, re.M), summary
    assert "profile of one step, ours (4 micro batches)" in summary
    files = sorted(p.name for p in out.iterdir())
    assert files == ["bench_eager.log", "bench_fp8.log", "machine.log", "pretrain.log",
                     "summary.txt", "tests.log", "tests.xml"], files


def test_no_output_directory_is_one_error_line():
    proc = subprocess.run(["bash", os.path.join(ROOT, "shtools", "gpu_run.sh"), "--dry-run"],
                          cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert proc.stderr.startswith("error: no output directory") and proc.stderr.count("\n") == 1
