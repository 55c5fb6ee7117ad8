"""Running the entry points as a user would (python or torchrun, CPU, one thread per process)
and reading Megatron's console lines back."""
import importlib.util
import os
import re
import signal
import subprocess
import sys

from tests.e2e.warm_launch import WARM_SCRIPTS, run_warm

# Set to launch every run for real (to compare with the warm pool, or to debug one).
COLD_ENV = "MEGATRON_TESTS_COLD_LAUNCH"
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = ("--num-layers 4 --hidden-size 32 --num-attention-heads 4 --seq-length 16 "
        "--max-position-embeddings 16 --micro-batch-size 2 --global-batch-size 8 "
        "--train-iters 6 --lr 1e-3 --lr-decay-style constant --mock-data "
        "--tokenizer-type NullTokenizer --vocab-size 64 --log-interval 1 --eval-interval 3 "
        "--eval-iters 1 --hidden-dropout 0 --attention-dropout 0 --num-workers 0").split()
# --num-workers 0: a tiny batch costs less to build than a loader worker process costs to fork
# and feed (about a quarter of an 8-rank tiny run's CPU); the worker path keeps its own tests
# (tests/unit/test_pretrain_loop.py, tests/e2e/test_exit_conditions.py, the SIGTERM cases).
LLAMA = ("--normalization RMSNorm --swiglu --ffn-hidden-size 48 --position-embedding-type rope "
         "--disable-bias-linear --untie-embeddings-and-output-weights").split()


class WarmStart:
    """A run start_script will do in the warm pool when ``finish`` asks for its result (runs
    started together then go one after another: on 2 cores overlapping them bought only the
    shared import time that the pool does not pay at all). Only clean runs belong there: one
    that exits non-zero fails the test, saying to launch it for real."""

    def __init__(self, script, flags, nproc):
        self.script, self.flags, self.nproc = script, list(flags), nproc

    def poll(self):
        """Popen's "not running" (a cleanup that kills what still runs leaves it alone)."""
        return 0


def _warm_eligible(script, torchrun_args, warm) -> bool:
    script = os.path.relpath(script, ROOT)  # a path under the checkout names the same script
    return bool(warm and not torchrun_args and script in WARM_SCRIPTS
                and not os.environ.get(COLD_ENV))


def load_tool(name):
    """A module of tools/ (a folder of scripts, not a package)."""
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "tools", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def start_script(script, flags, nproc=1, torchrun_args=None, warm=True):
    """Start ``python script flags`` (nproc 1) or ``torchrun --nproc-per-node nproc script
    flags`` (``torchrun_args`` replace ``--standalone``: rendezvous, restarts...). The
    training entry points, unless ``warm=False`` or given torchrun arguments, give a
    WarmStart instead, run by ``finish`` in the warm rank pool (warm_launch.py). A run meant
    to fail, or that a test signals or kills, is a real launch: ``warm=False``."""
    if _warm_eligible(script, torchrun_args, warm):
        return WarmStart(script, flags, nproc)
    return _launch(script, flags, nproc, torchrun_args)


def _launch(script, flags, nproc=1, torchrun_args=None):
    env = dict(os.environ, MEGATRON_DEVICE="cpu", OMP_NUM_THREADS="1")
    launcher = [sys.executable]
    if nproc > 1 or torchrun_args:
        launcher = [sys.executable, "-m", "torch.distributed.run",
                    *(torchrun_args or ["--standalone"]), "--nproc-per-node", str(nproc)]
    return subprocess.Popen(launcher + [os.path.join(ROOT, script)] + [str(f) for f in flags],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)


def finish(popen, timeout=300):
    """Wait for a started script; a CompletedProcess as subprocess.run returns. A WarmStart
    runs now in the pool; one that is not clean there is launched for real (warm_launch.py)."""
    if isinstance(popen, WarmStart):
        env = dict(os.environ, MEGATRON_DEVICE="cpu", OMP_NUM_THREADS="1")
        return run_warm(os.path.join(ROOT, popen.script), popen.flags, popen.nproc, env, ROOT,
                        timeout)
    try:
        stdout, stderr = popen.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(popen.pid, signal.SIGKILL)  # torchrun's workers too
        stdout, stderr = popen.communicate()
        raise AssertionError(f"timed out after {timeout} s:\n{stdout[-3000:]}{stderr[-3000:]}")
    return subprocess.CompletedProcess(popen.args, popen.returncode, stdout, stderr)


def run_script(script, flags, nproc=1, timeout=300, torchrun_args=None, warm=True):
    """Run to the end: in the warm pool where start_script says so (a clean run), else a real
    launch (``warm=False`` for a run meant to fail)."""
    return finish(start_script(script, flags, nproc, torchrun_args, warm), timeout)


def without(flags, *names):
    """``flags`` less each flag in ``names`` and its value."""
    out, skip = [], False
    for flag in flags:
        if skip:
            skip = False
        elif flag in names:
            skip = True
        else:
            out.append(flag)
    return out


def _ok(proc):
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


def parse_losses(proc):
    """(training 'lm loss' per logged interval, validation 'lm loss value's); asserts exit 0."""
    _ok(proc)
    return ([float(x) for x in re.findall(r"\| lm loss: ([0-9.E+-]+) \|", proc.stdout)],
            [float(x) for x in re.findall(r"lm loss value: ([0-9.E+-]+)", proc.stdout)])


def parse_iterations(proc):
    """[(iteration, train_iters, consumed_samples)] from the logged training lines."""
    _ok(proc)
    return [tuple(map(int, m)) for m in re.findall(
        r" iteration +(\d+)/ *(\d+) \| consumed samples: +(\d+) \|", proc.stdout)]


def checkpoint_tensors(root, iteration):
    """Every tensor of a saved iteration, for bitwise comparisons (see offline.py)."""
    from megatron.training.checkpointing.offline import checkpoint_tensors as tensors

    return tensors(os.path.join(str(root), f"iter_{iteration:07d}"))
