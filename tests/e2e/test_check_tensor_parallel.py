"""tools/check_tensor_parallel.py end to end: torchrun launches it on 2 CPU processes; the TP=2
model must match its unsharded twin at every step and learn."""
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_tensor_parallel_self_check_with_torchrun():
    env = dict(os.environ, MEGATRON_DEVICE="cpu", OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
         "--standalone", os.path.join(ROOT, "tools", "check_tensor_parallel.py"),
         "--steps", "30"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "OK: tensor parallelism (TP=2, gloo) matches the unsharded model" in proc.stdout
    losses = [float(m) for m in re.findall(r"loss TP=2: ([0-9.]+)", proc.stdout)]
    assert len(losses) == 30
    assert losses[-1] < 0.5 * losses[0], losses  # it learns the rule, not just runs


def test_refuses_to_run_without_torchrun():
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "check_tensor_parallel.py")],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "launch with torchrun" in proc.stderr
