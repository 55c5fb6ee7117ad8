"""Tests that fake CUDA (tests/unit/test_device.py) leave nothing behind for the next test of
the same process. Under pytest 9.2, monkeypatch could not undo its setattr of
torch.backends.cuda.matmul.allow_tf32 (a special module object), skipped the rest of the undo
list, and the faked device leaked: test_fused_elementwise then failed with "Torch not compiled
with CUDA enabled" on a fresh machine although it passes alone. Run here in one process, in
that order."""
import pytest
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.slow  # starts processes: the full suite, not the quick tier
def test_device_tests_leak_nothing_into_the_next_file():
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
         "tests/unit/test_device.py", "tests/unit/test_fused_elementwise.py",
         "tests/unit/test_timers.py"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
        env=dict(os.environ, MEGATRON_DEVICE="cpu"))
    assert proc.returncode == 0, proc.stdout[-4000:]
    assert " failed" not in proc.stdout and " error" not in proc.stdout, proc.stdout[-4000:]
