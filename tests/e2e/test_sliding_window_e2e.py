"""pretrain_llama.py with sliding windows (a 6-key window at 16 tokens on layers 1 and 3,
full attention on 2 and 4) on a Qwen-shaped model (Qwen3's per-head q/k norms and a head dim
of its own, Qwen2's q/k/v biases, grouped-query attention): TP=2 x PP=2 x DP=2 on 8
processes gives one process's losses (fp32, 1e-5 as the other layouts), and the windows
change the losses (they ran)."""
from tests.e2e.runner import LLAMA, TINY, parse_losses, run_script

TOL = 1e-5
WINDOW = ["--window-size", "5,0", "--window-attn-skip-freq", "2"]
QWEN = ["--qk-layernorm", "--add-qkv-bias", "--kv-channels", "16", "--group-query-attention",
        "--num-query-groups", "2"]


def test_windowed_tp_pp_dp_equals_one_process():
    model = TINY + LLAMA + QWEN
    single, single_valid = parse_losses(run_script("pretrain_llama.py", model + WINDOW))
    parallel, parallel_valid = parse_losses(run_script(
        "pretrain_llama.py", model + WINDOW + [
            "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"],
        nproc=8))
    full, _ = parse_losses(run_script("pretrain_llama.py", model))
    assert len(single) == 6
    for a, b in zip(single + single_valid, parallel + parallel_valid, strict=True):
        assert abs(a - b) <= TOL, (single, parallel)
    assert max(abs(a - b) for a, b in zip(single, full)) > 10 * TOL, (single, full)
