"""Mixture-of-experts training through pretrain_llama.py equals one process (CPU, gloo, fp32):
EP x TP x DP with SP, EP x PP x DP interleaved, gpt-oss's layer, a tiny DeepSeek-V3 at
CP x EP x DP and at TP x EP x PP, and expert TP without dense TP under 1F1B.

Each parallel run and its one-process reference are started together on the same flags and
global batch: 10 iterations, the training and validation losses and the MoE layers' logged
aux/z losses within 1e-5 relative. Not bitwise: TP splits the attention/shared-expert GEMM
sums and SP splits the aux-loss sums over ranks; with EP alone the printed losses agree to
the last digit."""
import re

import pytest

from tests.e2e.runner import LLAMA, TINY, finish, parse_losses, start_script

MOE = ("--train-iters 10 --eval-interval 5 --num-experts 4 --moe-router-topk 2 "
       "--moe-ffn-hidden-size 16 --moe-aux-loss-coeff 0.01 --moe-z-loss-coeff 0.001").split()
# A tiny DeepSeek-V3: MLA with the query latent, a dense first layer, grouped sigmoid routing
# (2 groups of 2 experts, one kept) with the expert bias, scaled gates, a shared expert, one MTP
# depth, untied embeddings.
DEEPSEEK = ["--multi-latent-attention", "--q-lora-rank", "12", "--kv-lora-rank", "16",
            "--qk-head-dim", "8", "--qk-pos-emb-head-dim", "4", "--v-head-dim", "8",
            "--qk-layernorm", "--rotary-interleaved", "--moe-layer-freq", "[0,1,1,1]",
            "--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias",
            "--moe-router-num-groups", "2", "--moe-router-group-topk", "1",
            "--moe-router-topk-norm", "--moe-router-topk-scaling-factor", "2.5",
            "--moe-shared-expert-intermediate-size", "16", "--mtp-num-layers", "1",
            "--moe-grouped-gemm"]
CASES = {
    # alltoall, grouped GEMM, Qwen2-MoE's gated shared expert, expert TP = TP = 2 with SP
    "ep2_tp2_dp2": (8, ["--moe-grouped-gemm", "--moe-shared-expert-intermediate-size", "24",
                        "--moe-shared-expert-gate"],
                    ["--expert-model-parallel-size", "2", "--tensor-model-parallel-size", "2",
                     "--sequence-parallel"]),
    # interleaved (DP=2: two microbatches): allgather, capacity dropping, expert bias, seq
    # aux loss, the distributed optimizer over expert-DP
    "ep2_pp2_vpp2_dp2": (4, ["--moe-token-dispatcher-type", "allgather",
                             "--moe-expert-capacity-factor", "1.0",
                             "--moe-router-enable-expert-bias",
                             "--moe-router-load-balancing-type", "seq_aux_loss"],
                         ["--expert-model-parallel-size", "2",
                          "--pipeline-model-parallel-size", "2",
                          "--num-layers-per-virtual-pipeline-stage", "1",
                          "--use-distributed-optimizer"]),
    # gpt-oss's layer (biased experts and router, clamped quick-GeGLU, learned attention sinks,
    # alternating 5-token windows, YaRN) at TP 2 x PP 2 x DP 2 with EP 2 (expert TP 1)
    "gpt_oss_tp2_pp2_dp2": (8, ["--quick-geglu", "--glu-linear-offset", "1",
                                "--activation-func-clamp-value", "0.5", "--moe-router-bias",
                                "--moe-grouped-gemm", "--softmax-type", "learnable",
                                "--window-size", "5,0", "--window-attn-skip-freq", "2",
                                "--rope-type", "yarn", "--rotary-scaling-factor", "4",
                                "--original-max-position-embeddings", "8",
                                "--no-yarn-correction-range-round-to-int", "--add-qkv-bias"],
                            ["--expert-model-parallel-size", "2",
                             "--expert-tensor-parallel-size", "1",
                             "--tensor-model-parallel-size", "2", "--sequence-parallel",
                             "--pipeline-model-parallel-size", "2"]),
    # a tiny DeepSeek-V3 at CP 2 x EP 2 (expert-DP 2 over the DP x CP ranks, the distributed
    # optimizer): each CP rank routes its chunks (counts and loss shares summed over CP); MTP
    # shifts its tokens along the whole sequence
    "deepseek_cp2_ep2_dp2": (4, DEEPSEEK, ["--context-parallel-size", "2",
                                           "--expert-model-parallel-size", "2",
                                           "--use-distributed-optimizer"]),
    # the same at TP 2 x EP 2 x PP 2 (MTP's copy of the untied embedding on the last stage)
    "deepseek_tp2_ep2_pp2": (8, DEEPSEEK, ["--expert-model-parallel-size", "2",
                                           "--tensor-model-parallel-size", "2",
                                           "--sequence-parallel",
                                           "--pipeline-model-parallel-size", "2"]),
    # 1F1B with expert TP but no dense TP, the overlapped distributed optimizer
    "ep2_etp2_pp2": (8, [], ["--expert-model-parallel-size", "2",
                             "--expert-tensor-parallel-size", "2",
                             "--pipeline-model-parallel-size", "2",
                             "--overlapped-distributed-optimizer"]),
}


def _moe_losses(proc):
    return [float(x) for x in re.findall(r"(?:load balancing|z) loss: ([0-9.E+-]+)",
                                         proc.stdout)]


def _grad_norms(proc):
    """The printed global norms: each expert and each dense weight counted once."""
    return [float(x) for x in re.findall(r"\| grad norm: ([0-9.]+) \|", proc.stdout)]


@pytest.mark.parametrize("case", [pytest.param(c, marks=[pytest.mark.quick] if c == "ep2_tp2_dp2"
                                                 else []) for c in CASES])
def test_expert_parallel_run_equals_one_process(case):
    nproc, model, layout = CASES[case]
    llama = LLAMA
    if case.startswith("gpt_oss"):  # biases everywhere; its gated MLP is quick-GeGLU
        llama = [f for f in LLAMA if f not in ("--disable-bias-linear", "--swiglu")]
    flags = TINY + llama + MOE + model
    runs = [start_script("pretrain_llama.py", flags),
            start_script("pretrain_llama.py", flags + layout, nproc=nproc)]
    (one, parallel) = [finish(run, timeout=400) for run in runs]
    (want, want_valid), (got, got_valid) = parse_losses(one), parse_losses(parallel)
    assert len(want) == 10 and len(want_valid) == 2
    assert got == pytest.approx(want, rel=1e-5) and got_valid == pytest.approx(want_valid,
                                                                                rel=1e-5)
    want_moe, got_moe = _moe_losses(one), _moe_losses(parallel)
    assert len(want_moe) == 20 and got_moe == pytest.approx(want_moe, rel=1e-5)
    assert len(_grad_norms(one)) == 10 and _grad_norms(parallel) == _grad_norms(one)
