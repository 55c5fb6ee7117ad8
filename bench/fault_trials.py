"""Fault-injection trials: how often a job killed mid-run recovers to exactly the result of an
uninterrupted run, and how much work each fault costs.

Each trial runs pretrain_llama.py under `torchrun --standalone --max-restarts 2` on 4 CPU
processes (TP=2 x DP=2, 20 iterations, a checkpoint every 5, --save = --load) with one fault
from megatron/training/guards/fault_injection.py: a rank SIGKILLed at the start of an iteration, or
in the middle of writing a checkpoint. torchrun restarts the workers, the job resumes from its
latest complete checkpoint, and the final checkpoint (model, optimizer state, RNG) is
compared tensor by tensor with the uninterrupted run's. Work lost = iterations computed before
the fault that had to be computed again.

    python3 bench/fault_trials.py            # 10 trials, ~5 minutes on 2 cores
"""
import argparse
import os
import re
import subprocess
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir))
from megatron.training.checkpointing.offline import checkpoint_tensors  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ITERS, SAVE_INTERVAL = 20, 5
FLAGS = (f"--num-layers 4 --hidden-size 32 --num-attention-heads 4 --seq-length 16 "
         f"--max-position-embeddings 16 --micro-batch-size 2 --global-batch-size 8 "
         f"--train-iters {ITERS} --lr 1e-3 --lr-decay-style cosine --mock-data "
         f"--tokenizer-type NullTokenizer --vocab-size 64 --log-interval 1 --eval-interval 10 "
         f"--eval-iters 1 --hidden-dropout 0.1 --attention-dropout 0.1 "
         f"--dataloader-type cyclic --normalization RMSNorm --swiglu --ffn-hidden-size 48 "
         f"--position-embedding-type rope --disable-bias-linear "
         f"--untie-embeddings-and-output-weights --tensor-model-parallel-size 2 "
         f"--save-interval {SAVE_INTERVAL}").split()
# (kind, rank, iteration): ranks 0 and 1 are DP rank 0, the ones writing checkpoint files.
TRIALS = [("kill", 0, 3), ("kill", 1, 7), ("kill", 2, 9), ("kill", 3, 12), ("kill", 0, 16),
          ("kill", 3, 19), ("save", 0, 5), ("save", 1, 10), ("save", 0, 15), ("save", 1, 20)]


def run(root, fault=None):
    env = dict(os.environ, MEGATRON_DEVICE="cpu", OMP_NUM_THREADS="1")
    env.pop("MEGATRON_FAULT_INJECTION", None)
    if fault:
        env["MEGATRON_FAULT_INJECTION"] = fault
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--max-restarts", "2",
           "--nproc-per-node", "4", os.path.join(ROOT, "pretrain_llama.py"), *FLAGS,
           "--save", root, "--load", root]
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    return proc, time.perf_counter() - start


def final_state(root):
    return checkpoint_tensors(os.path.join(root, f"iter_{ITERS:07d}"))


def work_lost(stdout):
    """(iteration resumed from, iterations recomputed): iterations logged by the first attempt
    beyond the checkpoint the restarted one began from."""
    resumed = re.search(r"loaded checkpoint from \S+ at iteration (\d+)", stdout)
    fresh = [m.start() for m in re.finditer("no checkpoint yet: starting from scratch", stdout)]
    if resumed is not None:
        resumed_from, restart_at = int(resumed.group(1)), resumed.start()
    elif len(fresh) > 1:  # killed before the first checkpoint: started again from scratch
        resumed_from, restart_at = 0, fresh[1]
    else:
        return None, None
    done = [int(i) for i in re.findall(r" iteration +(\d+)/", stdout[:restart_at])]
    return resumed_from, (max(done) if done else 0) - resumed_from


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=len(TRIALS))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as work:
        proc, seconds = run(os.path.join(work, "reference"))
        assert proc.returncode == 0, proc.stderr[-3000:]
        want = final_state(os.path.join(work, "reference"))
        print(f"uninterrupted: {seconds:.1f} s, {len(want)} tensors in the final checkpoint")
        rows = []
        for n, (kind, rank, iteration) in enumerate(TRIALS[:args.trials]):
            root = os.path.join(work, f"trial{n}")
            fault = f"{kind}:{rank}:{iteration}"
            proc, seconds = run(root, fault)
            got = final_state(root) if proc.returncode == 0 else {}
            equal = bool(got) and got.keys() == want.keys() and all(
                torch.equal(got[k], want[k]) for k in want)
            restarted = "exitcode: -9" in proc.stderr
            resumed_from, lost = work_lost(proc.stdout)
            rows.append((fault, proc.returncode, restarted, resumed_from, lost, equal, seconds))
            print(f"{fault:>10}  exit {proc.returncode}  killed+restarted {restarted}  resumed "
                  f"from {resumed_from}  iterations recomputed {lost}  bitwise equal {equal}  "
                  f"{seconds:.1f} s", flush=True)
        ok = sum(r[5] for r in rows)
        losses = [r[4] for r in rows if r[4] is not None]
        print(f"\n{ok}/{len(rows)} trials finished bitwise equal to the uninterrupted run; "
              f"iterations recomputed per fault: mean {sum(losses) / max(len(losses), 1):.1f}, "
              f"max {max(losses, default=0)} (save interval {SAVE_INTERVAL})")


if __name__ == "__main__":
    main()
