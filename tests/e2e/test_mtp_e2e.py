"""pretrain_llama.py with multi-token prediction (--mtp-num-layers 2, tied embeddings): at
TP=2 (SP) x PP=2 x DP=2 on 8 processes the losses and each depth's logged loss equal one
process's (fp32, 1e-5 relative: TP and SP re-associate sums), and the depths change the
training (their gradient reaches the model)."""
import re

import pytest

from tests.e2e.runner import LLAMA, TINY, parse_losses, run_script

MTP = ["--mtp-num-layers", "2", "--mtp-loss-scaling-factor", "0.3"]
TIED = [f for f in LLAMA if f != "--untie-embeddings-and-output-weights"]


def _mtp_losses(proc):
    return [float(x) for x in re.findall(r"mtp_\d loss: ([0-9.E+-]+)", proc.stdout)]


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
