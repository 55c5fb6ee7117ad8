"""bench/moe.py's functions at a tiny size: what it times computes the same thing. Each
difference is the largest |ours - reference| over the tensor relative to the reference's
largest magnitude (bench.moe_common.max_diff).

- our MoELayer vs HF's MixtralSparseMoeBlock on the same weights: output, input gradient and
  every weight gradient within 1e-5 (fp32; the router's top-k-then-softmax vs HF's
  softmax-then-top-k-then-renormalise differ in rounding only);
- grouped GEMM vs the per-expert loop: within 1e-5 (different GEMM kernels);
- EP=2 with each dispatcher (2 gloo processes) vs HF's block on each rank's tokens: 1e-5;
- a small Mixtral step, our GPTModel vs MixtralForCausalLM: loss and every gradient 1e-5;
- the timing loop and its summary run end to end (1 repeat).
"""
import torch.distributed as dist

from bench.moe import experts_check, layer_check, main, parse_args
from bench.moe_dispatch import EP, dispatch_check, setup_rank
from bench.moe_model import mixtral_pair, model_check
from megatron.core import parallel_state
from tests.distributed import run_distributed

TINY = ["--tokens", "64", "--hidden", "32", "--ffn", "48", "--experts", "4", "--topk", "2",
        "--repeats", "1", "--warmup", "0"]
TOL = 1e-5


def test_layer_matches_hf():
    diffs = layer_check(parse_args(TINY))
    assert set(diffs) == {"output", "input grad", "weight1 grad", "weight2 grad", "router grad"}
    assert max(diffs.values()) <= TOL, diffs


def test_grouped_gemm_matches_loop():
    diffs = experts_check(parse_args(TINY))
    assert max(diffs.values()) <= TOL, diffs


def _dispatch_rank():
    parallel_state.initialize_model_parallel(expert_model_parallel_size=EP)
    try:
        args = parse_args(TINY)
        layers, block, x = setup_rank(args, dist.get_rank())
        return dispatch_check(args, layers, block, x)
    finally:
        parallel_state.destroy_model_parallel()


def test_ep2_dispatchers_match_hf():
    for diffs in run_distributed(_dispatch_rank, EP):
        assert set(diffs) == {"alltoall", "allgather"}
        assert max(diffs.values()) <= TOL, diffs


def _model_check():
    args = parse_args(TINY + ["--seq", "16", "--vocab", "64"])
    return model_check(args, *mixtral_pair(args))


def test_mixtral_step_matches_hf():
    diffs = run_distributed(_model_check, 1, tp=1)[0]
    assert max(diffs.values()) <= TOL, diffs


def test_bench_runs_end_to_end(capsys):
    main(["--parts", "layer,experts"] + TINY)
    out = capsys.readouterr().out
    assert "median ratio" in out and "HF Mixtral block (eager)" in out
