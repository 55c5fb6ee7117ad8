"""pretrain_llama.py with sliding windows (a 6-key window at 16 tokens on layers 1 and 3,
full attention on 2 and 4): TP=2 x PP=2 x DP=2 on 8 processes gives one process's losses
(fp32, 1e-5 as the other layouts), and the windows change the losses (they ran)."""
from tests.e2e.runner import LLAMA, TINY, parse_losses, run_script

TOL = 1e-5
WINDOW = ["--window-size", "5,0", "--window-attn-skip-freq", "2"]


def test_windowed_tp_pp_dp_equals_one_process():
    single, single_valid = parse_losses(run_script("pretrain_llama.py", TINY + LLAMA + WINDOW))
    parallel, parallel_valid = parse_losses(run_script(
        "pretrain_llama.py", TINY + LLAMA + WINDOW + [
            "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"],
        nproc=8))
    full, _ = parse_losses(run_script("pretrain_llama.py", TINY + LLAMA))
    assert len(single) == 6
    for a, b in zip(single + single_valid, parallel + parallel_valid, strict=True):
        assert abs(a - b) <= TOL, (single, parallel)
    assert max(abs(a - b) for a, b in zip(single, full)) > 10 * TOL, (single, full)
