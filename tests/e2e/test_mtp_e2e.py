"""pretrain_llama.py with multi-token prediction (--mtp-num-layers 2): with tied embeddings at
TP=2 (SP) x PP=2 x DP=2 on 8 processes, and with untied ones at PP=2 (the last stage's copy
of the embedding; 1F1B, and zbv: both copies on rank 0), at CP=2 (also all-gather with
packed documents) and at PP=2 x CP=2, the losses, each depth's logged loss and (untied) the
gradient norms equal one process's (fp32, 1e-5 relative: TP, SP, CP and the two embedding
copies' gradient sum re-associate sums; norms are logged with 3 decimals), and the depths
change the training (their gradient reaches the model)."""
import re

import pytest

from tests import nccl_faithful
from tests.e2e.runner import LLAMA, TINY, parse_losses, run_script, without

MTP = ["--mtp-num-layers", "2", "--mtp-loss-scaling-factor", "0.3"]
TIED = [f for f in LLAMA if f != "--untie-embeddings-and-output-weights"]


def _mtp_losses(proc):
    return [float(x) for x in re.findall(r"mtp_\d loss: ([0-9.E+-]+)", proc.stdout)]


# Grad norms are printed with 3 decimals: sums re-associated over ranks may move the last one
# by a unit (and the float error of the subtraction).
NORM_UNIT = 1e-3 + 1e-9


def _grad_norms(proc):
    return [float(x) for x in re.findall(r"\| grad norm: ([0-9.]+) \|", proc.stdout)]


def test_mtp_tp_pp_dp_equals_one_process():
    single = run_script("pretrain_llama.py", TINY + TIED + MTP)
    parallel = run_script("pretrain_llama.py", TINY + TIED + MTP + [
        "--tensor-model-parallel-size", "2", "--sequence-parallel",
        "--pipeline-model-parallel-size", "2"], nproc=8)
    plain, _ = parse_losses(run_script("pretrain_llama.py", TINY + TIED))
    (want, want_valid), (got, got_valid) = parse_losses(single), parse_losses(parallel)
    assert len(want) == 6 and got == pytest.approx(want, rel=1e-5)
    assert got_valid == pytest.approx(want_valid, rel=1e-5)
    want_mtp, got_mtp = _mtp_losses(single), _mtp_losses(parallel)
    assert len(want_mtp) == 12 and got_mtp == pytest.approx(want_mtp, rel=1e-5)
    assert want[0] == pytest.approx(plain[0], rel=1e-6)  # the first step's main loss alike
    assert max(abs(a - b) for a, b in zip(want[1:], plain[1:])) > 1e-4  # then MTP's gradient


def test_mtp_untied_under_pp_and_under_cp_equals_one_process():
    single = run_script("pretrain_llama.py", TINY + LLAMA + MTP)
    (want, want_valid), want_mtp = parse_losses(single), _mtp_losses(single)
    assert len(want) == 6 and len(want_mtp) == 12 and len(_grad_norms(single)) == 6
    pp2, cp2 = ["--pipeline-model-parallel-size", "2"], ["--context-parallel-size", "2"]
    for parallel, nproc in ((pp2, 2), (pp2 + ["--pipeline-schedule", "zbv"], 2), (cp2, 2),
                            (pp2 + cp2, 4)):
        proc = run_script("pretrain_llama.py", TINY + LLAMA + MTP + parallel, nproc=nproc)
        got, got_valid = parse_losses(proc)
        assert got == pytest.approx(want, rel=1e-5), parallel
        assert got_valid == pytest.approx(want_valid, rel=1e-5), parallel
        assert _mtp_losses(proc) == pytest.approx(want_mtp, rel=1e-5), parallel
        assert _grad_norms(proc) == pytest.approx(_grad_norms(single), abs=NORM_UNIT), parallel


def test_mtp_with_packed_documents_under_cp_all_gather_equals_one_process():
    packed = ["--reset-attention-mask", "--reset-position-ids", "--eod-mask-loss"]
    single = run_script("pretrain_llama.py", TINY + LLAMA + MTP + packed)
    proc = run_script("pretrain_llama.py", TINY + LLAMA + MTP + packed + [
        "--context-parallel-size", "2", "--cp-comm-type", "all_gather"], nproc=2)
    (want, want_valid), (got, got_valid) = parse_losses(single), parse_losses(proc)
    assert len(want) == 6 and got == pytest.approx(want, rel=1e-5)
    assert got_valid == pytest.approx(want_valid, rel=1e-5)
    assert len(_mtp_losses(single)) == 12
    assert _mtp_losses(proc) == pytest.approx(_mtp_losses(single), rel=1e-5)
    assert _grad_norms(proc) == pytest.approx(_grad_norms(single), abs=NORM_UNIT)


@pytest.fixture
def nccl_faithful_ranks(monkeypatch):
    """The rank pool's groups poison an async collective's output until wait()
    (tests/nccl_faithful.py): a read before the wait is NaN, not last step's value."""
    monkeypatch.setenv(nccl_faithful.ENV, "1")


@pytest.mark.slow
@pytest.mark.parametrize("model", [LLAMA, TIED], ids=["untied", "tied"])
def test_mtp_under_the_overlapped_param_gather_equals_the_plain_gather(nccl_faithful_ranks,
                                                                        model):
    """The last stage's embedding copy is read outside its owner's forward (MTP's lookups):
    without param_sync.gathered() its rows were one step stale on gloo (a race on nccl)."""
    flags = without(TINY, "--train-iters", "--eval-interval") + model + MTP + [
        "--train-iters", "3", "--eval-interval", "100",
        "--pipeline-model-parallel-size", "2"]
    plain = run_script("pretrain_llama.py", flags + [
        "--use-distributed-optimizer", "--ddp-bucket-size", "1000"], nproc=4)
    want = (parse_losses(plain)[0], _mtp_losses(plain))
    assert len(want[0]) == 3 and len(want[1]) == 6
    for overlapped in (["--use-distributed-optimizer", "--ddp-bucket-size", "1000",
                        "--overlap-param-gather"],
                       ["--overlapped-distributed-optimizer", "--reduce-bucket-size", "1000"]):
        proc = run_script("pretrain_llama.py", flags + overlapped, nproc=4)
        assert (parse_losses(proc)[0], _mtp_losses(proc)) == want, overlapped
