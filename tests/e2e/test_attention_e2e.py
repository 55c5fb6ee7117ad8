"""Attention end to end: a configuration that would run SDPA's math kernel on CUDA stops at
start with one message (before any process group or file), and packed documents
(--reset-attention-mask) train through the per-document path."""
import math

from tests.e2e.bad_inputs.harness import run as run_forked
from tests.e2e.runner import TINY, parse_losses, run_script


def test_math_attention_on_cuda_fails_at_start_with_one_error_line():
    # fp32 rules out flash; head dim 36 / 4 = 9 is not a multiple of 4 (memory-efficient).
    flags = [f for f in TINY] + ["--device", "cuda"]
    flags[flags.index("--hidden-size") + 1] = "36"
    proc = run_forked("pretrain_gpt.py", flags)  # as a launch, from a warm fork server
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: attention would fall back to "
                                                   "SDPA's math kernel on CUDA"), proc.stderr
    assert "head dim 9" in lines[0] and "--allow-math-attention" in lines[0]
    assert "Traceback" not in proc.stderr


def test_packed_documents_train():
    proc = run_script("pretrain_gpt.py", TINY + ["--reset-attention-mask",
                                                  "--reset-position-ids", "--eod-mask-loss"])
    losses, valid = parse_losses(proc)
    assert len(losses) == 6 and all(math.isfinite(x) for x in losses + valid), proc.stderr
