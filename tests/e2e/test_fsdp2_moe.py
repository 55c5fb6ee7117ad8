"""--use-torch-fsdp2 with mixture of experts through pretrain_llama.py (CPU, gloo, fp32): a tiny
Mixtral-style MoE (grouped GEMM, top-2 of 4 experts, the aux-loss-free expert bias, the
per-sequence aux loss, the z-loss) whose routed experts are sharded over expert-DP (the ranks
holding the same experts) and everything else over DP (x CP), against one process on the same
global batch (4 microbatches at DP 1). Not bitwise: the reduce-scatters and the norm sum in
other orders, so losses, MoE losses and grad norms agree within 1e-5 relative.

What the layouts catch: an expert gradient divided by FSDP2's default (the expert-DP size: 2,
4, 2 below) instead of DDP's DP x CP (4, 8, 4) changes every grad norm (Adam hides it in the
losses); experts broadcast over DP instead of expert-DP (EP rank 1 would start from EP rank
0's experts) changes the losses; an expert shard left out of or counted twice in the norm
changes the norms. CP2 x EP2 cuts 2 local experts over expert-DP 4 (two ranks hold none);
TP2 (SP) composes expert TP 2; PP2 gives each stage's chunk its own expert meshes.
Checkpoints: FSDP2's expert rows under their global expert names, loaded at another EP (and
expert TP) and back, continue as an uninterrupted run of the target layout.
"""
import re

import pytest

from tests.e2e.runner import LLAMA, TINY, finish, parse_losses, run_script, start_script
from tests.e2e.test_checkpoint_resume import _flags, _iteration_losses
from tests.e2e.test_fsdp2 import uninterrupted_runs
from tests.shared_fixture import once_per_run

MOE = ("--train-iters 4 --eval-interval 2 --num-experts 4 --moe-router-topk 2 "
       "--moe-ffn-hidden-size 16 --moe-aux-loss-coeff 0.01 --moe-z-loss-coeff 0.001 "
       "--moe-grouped-gemm").split()
# Adam's eps near the gradients' size makes the step feel their scale (at 1e-8 Adam divides
# a mis-scaled expert gradient out again, and only the 3-digit grad norm would show it).
FLAGS = TINY + LLAMA + MOE + ["--moe-router-enable-expert-bias",
                              "--moe-router-load-balancing-type", "seq_aux_loss",
                              "--adam-eps", "1e-2", "--lr", "1e-2"]
TOL = 1e-6 + 1e-12  # one unit in the printed 7th digit (as test_fsdp2.py)
FSDP2_EP2 = ["--use-torch-fsdp2", "--expert-model-parallel-size", "2"]
TP2_SP = ["--tensor-model-parallel-size", "2", "--sequence-parallel"]  # expert TP 2 too


def _moe_losses(proc):
    return [float(x) for x in re.findall(r"(?:load balancing|z) loss: ([0-9.E+-]+)",
                                         proc.stdout)]


def _grad_norms(proc):
    return [float(x) for x in re.findall(r"\| grad norm: ([0-9.]+) \|", proc.stdout)]


def test_fsdp2_with_expert_parallelism_equals_one_process():
    layouts = {"ep2 edp2": (4, FSDP2_EP2),
               "ep4 edp1": (4, ["--use-torch-fsdp2", "--expert-model-parallel-size", "4"]),
               "cp2 ep2 edp4": (8, FSDP2_EP2 + ["--context-parallel-size", "2"]),
               "tp2 sp etp2 ep2 edp2": (8, FSDP2_EP2 + TP2_SP),
               "pp2 ep2 edp2": (8, FSDP2_EP2 + ["--pipeline-model-parallel-size", "2"])}
    one = start_script("pretrain_llama.py", FLAGS)
    started = {name: start_script("pretrain_llama.py", FLAGS + extra, nproc=nproc)
               for name, (nproc, extra) in layouts.items()}
    one = finish(one, timeout=400)
    (want, want_valid) = parse_losses(one)
    assert len(want) == 4 and len(_grad_norms(one)) == 4
    for name, popen in started.items():
        proc = finish(popen, timeout=400)
        got, got_valid = parse_losses(proc)
        for a, b in zip(want + want_valid, got + got_valid, strict=True):
            assert abs(a - b) <= TOL, (name, want + want_valid, got + got_valid)
        assert _moe_losses(proc) == pytest.approx(_moe_losses(one), rel=1e-5), name
        assert _grad_norms(proc) == pytest.approx(_grad_norms(one), rel=1e-5), name


# --- checkpoints: FSDP2's expert rows under their global expert names ----------------------
RESHARD_TOL = 1e-5  # other layouts sum in other orders (test_fsdp2.py's resharding bound)
CKPT_LAYOUTS = {"fsdp2 ep2": (4, FSDP2_EP2),
                "distributed ep4": (4, ["--use-distributed-optimizer",
                                        "--expert-model-parallel-size", "4"]),
                "ddp ep1 dp2": (2, []),
                "fsdp2 tp2 ep2": (8, FSDP2_EP2 + TP2_SP)}


def _ckpt_flags():
    return _flags(*MOE[4:], dropout="0", loader="single")  # 4 iterations, saved at 2


@pytest.fixture(scope="module")
@once_per_run
def straight_runs(tmp_path_factory):
    return uninterrupted_runs(tmp_path_factory.mktemp("fsdp2_moe_reshard"), _ckpt_flags(),
                              CKPT_LAYOUTS)


@pytest.mark.parametrize("saved,target", [("fsdp2 ep2", "distributed ep4"),
                                          ("ddp ep1 dp2", "fsdp2 ep2"),
                                          ("fsdp2 tp2 ep2", "ddp ep1 dp2")])
def test_fsdp2_moe_checkpoint_loads_at_another_expert_layout(straight_runs, tmp_path, saved,
                                                             target):
    root, _ = straight_runs[saved]
    nproc, extra = CKPT_LAYOUTS[target]
    proc = run_script("pretrain_llama.py", _ckpt_flags() + extra + [
        "--load", root, "--ckpt-step", "2"], nproc)
    got, want = _iteration_losses(proc), straight_runs[target][1]
    assert "resharded from" in proc.stdout
    assert sorted(got) == ["3", "4"]
    for i in "34":
        assert abs(float(got[i]) - float(want[i])) <= RESHARD_TOL, (got, want)
