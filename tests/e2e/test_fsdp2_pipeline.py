"""--use-torch-fsdp2 with pipeline parallelism through pretrain_llama.py (CPU, gloo, fp32):
each stage's model chunks sharded over that stage's DP group, against one process.

Layouts (4 microbatches of 1 per DP rank at DP 2: several in flight on the first stage):
  * PP2 x DP2, 1F1B, tied embeddings (ZeRO-3): the tied weight's two copies, on the first and
    the last stage, are both sharded over DP and their local rows summed over the embedding
    group (a wrong pairing of rows, or no sum, moves the loss from iteration 2 on);
  * PP2 x VPP2 x DP2, interleaved, tied (ZeRO-2, --no-reshard-after-forward): two FSDP2
    roots per rank, each holding microbatches in flight;
  * TP2 x PP2 x DP2 (8 ranks), sequence parallelism, untied (the issue's triple), and the
    same with HSDP (two instances), tied;
  * PP2 x DP2 under the zero-bubble schedules, ZB-H1 (tied, ZeRO-3) and ZB-V (untied,
    ZeRO-2): the deferred weight gradients reach the reduce-scatter held to the iteration's
    end.
The global norm is summed over every rank with the last stage's tied copy and TP duplicates
left out: a double count shows in the printed grad norm (and, with Adam, in the losses).
Checkpoints saved under FSDP2 x PP2 loading at other layouts, and the reverse: with the other
FSDP2 resharding cases in tests/e2e/test_fsdp2.py (one set of uninterrupted runs for all).
"""
import re

import pytest

from tests.e2e.runner import LLAMA, TINY, finish, parse_losses, start_script
from tests.shared_fixture import once_per_run

TOL = 1e-5  # the bound; these runs print the one-process digits
NORM_TOL = 1e-3 + 1e-9  # the log prints the grad norm to 3 decimals
TIED = [f for f in LLAMA if f != "--untie-embeddings-and-output-weights"]
BASE = TINY + ["--train-iters", "4", "--micro-batch-size", "1"]
PP2 = ["--use-torch-fsdp2", "--pipeline-model-parallel-size", "2"]


def _losses_and_norms(proc):
    losses, valid = parse_losses(proc)
    norms = [float(x) for x in re.findall(r"\| grad norm: ([0-9.E+-]+) \|", proc.stdout)]
    assert len(losses) == len(norms) == 4 and len(valid) == 2, proc.stdout[-2000:]
    return losses + valid, norms


@pytest.fixture(scope="module")
@once_per_run
def references():
    """One process, tied and untied (started together, run one after the other)."""
    started = {tied: start_script("pretrain_llama.py", BASE + (TIED if tied else LLAMA))
               for tied in (True, False)}
    return {tied: _losses_and_norms(finish(popen)) for tied, popen in started.items()}


def test_fsdp2_with_pipeline_parallelism_equals_one_process(references):
    runs = {"pp2 dp2 1f1b tied zero3": (4, True, PP2),
            "pp2 vpp2 dp2 interleaved tied zero2": (4, True, PP2 + [
                "--num-layers-per-virtual-pipeline-stage", "1", "--no-reshard-after-forward"]),
            "tp2 pp2 dp2 sp untied": (8, False, PP2 + [
                "--tensor-model-parallel-size", "2", "--sequence-parallel"]),
            # zero-bubble: every unit's gradients held unsharded until the last W, then
            # reduce-scattered once (fsdp.py); a W reduced without them moves the losses
            "pp2 dp2 zb-h1 tied zero3": (4, True, PP2 + ["--pipeline-schedule", "zb-h1"]),
            "pp2 dp2 zbv untied zero2": (4, False, PP2 + [
                "--pipeline-schedule", "zbv", "--no-reshard-after-forward"]),
            # HSDP: the two DP ranks are two instances of one (FSDP2's (2, 1) mesh): the
            # reduce-scatter is a copy and the all-reduce across instances does the averaging
            "tp2 pp2 dp2 hsdp tied": (8, True, PP2 + [
                "--tensor-model-parallel-size", "2", "--num-distributed-optimizer-instances",
                "2"])}
    started = {name: (tied, start_script("pretrain_llama.py", BASE + (TIED if tied else LLAMA)
                                         + extra, nproc=nproc))
               for name, (nproc, tied, extra) in runs.items()}
    for name, (tied, popen) in started.items():
        (losses, norms), (want, want_norms) = \
            _losses_and_norms(finish(popen, timeout=600)), references[tied]
        for a, b in zip(want, losses, strict=True):
            assert abs(a - b) <= TOL, (name, want, losses)
        for a, b in zip(want_norms, norms, strict=True):
            assert abs(a - b) <= NORM_TOL, (name, want_norms, norms)
