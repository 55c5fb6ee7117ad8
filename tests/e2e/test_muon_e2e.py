"""pretrain_llama.py with --optimizer muon end to end on CPU: TP=2 x PP=2 x DP=2 with sequence
parallelism on 8 processes gives the one-process losses (fp32; the layouts differ in the order
of sums, which Newton-Schulz amplifies a little: <= 1e-5, the log's 7 digits), and Muon is
really in use (the losses are not Adam's). Checkpoints hold the momentum by parameter name:
a resumed run is bitwise the uninterrupted one, a TP=2 x DP=2 save (distributed optimizer)
loads at TP=1 x DP=4 and into one process's replicated optimizer, and loading it with another
--optimizer is refused in one line. MuonClip (--qk-clip) at TP=2 x DP=2 with the distributed
optimizer gives the one-process losses and max attention logits."""
import re

import pytest
import torch

from tests.e2e.bad_inputs.harness import assert_clean_error, run
from tests.e2e.runner import LLAMA, TINY, checkpoint_tensors, parse_losses, run_script, without
from tests.shared_fixture import once_per_run

TOL = 1e-5
MATRICES = ("linear_qkv.weight", "linear_proj.weight", "linear_fc1.weight", "linear_fc2.weight")
MUON = TINY + LLAMA + ["--optimizer", "muon", "--muon-use-nesterov",
                       "--muon-extra-scale-factor", "0.2"]


@pytest.mark.parametrize("optimizer", [[], ["--use-distributed-optimizer"]],
                         ids=["replicated", "distributed"])
def test_muon_tp_pp_dp_on_8_processes_equals_one_process(optimizer):
    single, single_valid = parse_losses(run_script("pretrain_llama.py", MUON))
    adam, _ = parse_losses(run_script("pretrain_llama.py", TINY + LLAMA))
    parallel, parallel_valid = parse_losses(run_script("pretrain_llama.py", MUON + [
        "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
        "--sequence-parallel", *optimizer], nproc=8))
    assert len(single) == 6 and len(single_valid) == 2
    for a, b in zip(single + single_valid, parallel + parallel_valid, strict=True):
        assert abs(a - b) <= TOL, (single, parallel)
    # the step is Muon's: far from Adam's losses (the same first loss, then 100x TOL apart)
    assert single[0] == adam[0] and max(abs(a - b) for a, b in zip(single, adam)) > 100 * TOL


# --- checkpoints: the momentum by parameter name ---------------------------------------------

def _resume_flags(*extra):
    base = without(TINY, "--train-iters", "--eval-interval")
    return base + LLAMA + ["--optimizer", "muon", "--muon-use-nesterov", "--train-iters", "4",
                           "--eval-interval", "2", "--dataloader-type", "single", *extra]


def _iteration_losses(proc):
    """{iteration: the printed loss text} (compared as text: equal digits, not close)."""
    parse_losses(proc)  # exit status
    return dict(re.findall(r" iteration +(\d+)/.*?\| lm loss: ([0-9.E+-]+) \|", proc.stdout))


@pytest.fixture(scope="module")
@once_per_run
def muon_saved_at_tp2_dp2(tmp_path_factory):
    """4 iterations at TP=2 x DP=2 with the distributed optimizer, saved at 2 and 4."""
    root = tmp_path_factory.mktemp("muon") / "saved"
    flags = _resume_flags("--tensor-model-parallel-size", "2", "--use-distributed-optimizer")
    proc = run_script("pretrain_llama.py", flags + ["--save", root, "--save-interval", "2"],
                      nproc=4)
    return flags, root, _iteration_losses(proc)


def test_muon_resume_at_tp2_dp2_is_bitwise(muon_saved_at_tp2_dp2, tmp_path):
    flags, straight, want = muon_saved_at_tp2_dp2
    resumed = tmp_path / "resumed"
    proc = run_script("pretrain_llama.py", flags + ["--load", straight, "--ckpt-step", "2",
                                                    "--save", resumed], nproc=4)
    got = _iteration_losses(proc)
    assert sorted(got) == ["3", "4"] and [got[i] for i in "34"] == [want[i] for i in "34"]
    a, b = checkpoint_tensors(straight, 4), checkpoint_tensors(resumed, 4)
    momenta = [k for k in a if "momentum_buffer" in k]
    # one momentum per matrix of the 4 layers (qkv, proj, fc1, fc2), none for the rest
    assert momenta and all(any(m in k for m in MATRICES) for k in momenta), momenta
    assert {m for k in momenta for m in MATRICES if m in k} == set(MATRICES)
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key


@pytest.mark.parametrize("optimizer,nproc", [(["--use-distributed-optimizer"], 4), ([], 1)],
                         ids=["tp1-dp4-distributed", "tp1-dp1-replicated"])
def test_muon_checkpoint_reshards(muon_saved_at_tp2_dp2, tmp_path, optimizer, nproc):
    flags, root, want = muon_saved_at_tp2_dp2
    flags = without(flags, "--tensor-model-parallel-size")
    flags = [f for f in flags if f != "--use-distributed-optimizer"] + optimizer
    proc = run_script("pretrain_llama.py", flags + [
        "--load", root, "--ckpt-step", "2", "--save", tmp_path / "again"], nproc=nproc)
    got = _iteration_losses(proc)
    assert "resharded from TP=2" in proc.stdout
    assert sorted(got) == ["3", "4"]
    for i in "34":
        assert abs(float(got[i]) - float(want[i])) <= TOL, (got, want)


def test_switching_optimizer_on_load_is_refused(muon_saved_at_tp2_dp2):
    flags, root, _ = muon_saved_at_tp2_dp2
    adam = [f for f in without(flags, "--optimizer", "--tensor-model-parallel-size")
            if f not in ("--muon-use-nesterov", "--use-distributed-optimizer")]  # 1 process
    assert_clean_error(run("pretrain_llama.py", adam + ["--load", root, "--ckpt-step", "2"]),
                       1, "the optimizer checkpoint is of --optimizer muon, this run uses "
                       "--optimizer adam", "--no-load-optim")


def test_muon_experts_ep2_tp2_dp2_distributed_equals_one_process():
    """Routed experts (E matrices per stacked weight) at EP 2 x expert-TP 2 (gathered over
    it, gate and up apart) x DP 2, the distributed optimizer sharding the experts' momentum
    over expert-DP; the router and the shared-expert gate on AdamW."""
    from tests.e2e.test_moe import MOE
    flags = MUON + MOE + ["--moe-grouped-gemm", "--moe-shared-expert-intermediate-size", "24",
                          "--moe-shared-expert-gate"]
    want, want_valid = parse_losses(run_script("pretrain_llama.py", flags))
    got, got_valid = parse_losses(run_script("pretrain_llama.py", flags + [
        "--expert-model-parallel-size", "2", "--tensor-model-parallel-size", "2",
        "--sequence-parallel", "--use-distributed-optimizer"], nproc=8))
    assert len(want) == 10 and len(want_valid) == 2
    assert got == pytest.approx(want, rel=1e-5) and got_valid == pytest.approx(want_valid,
                                                                                rel=1e-5)


def test_muon_latent_attention_tp2_dp2_distributed_equals_one_process():
    """Multi-latent attention's projections (low-rank, some replicated over TP, some column-
    or row-parallel) are Muon matrices too; --muon-split-qkv leaves them alone (no fused QKV)."""
    from tests.e2e.test_latent_attention_e2e import MLA
    flags = MUON + MLA + ["--muon-split-qkv"]
    want, want_valid = parse_losses(run_script("pretrain_llama.py", flags))
    got, got_valid = parse_losses(run_script("pretrain_llama.py", flags + [
        "--tensor-model-parallel-size", "2", "--sequence-parallel",
        "--use-distributed-optimizer"], nproc=4))
    assert len(want) == 6 and len(want_valid) == 2
    for a, b in zip(want + want_valid, got + got_valid, strict=True):
        assert abs(a - b) <= TOL, (want, got)


# --- MuonClip: --qk-clip ---------------------------------------------------------------------

# At init std 0.2 the heads' largest logits are ~5-6 (at 0.02: ~0.06, where the clip changes
# the losses by less than TOL); tau 2 clips every iteration.
WIDE = MUON + ["--init-method-std", "0.2"]
QK_CLIP = WIDE + ["--qk-clip", "--qk-clip-threshold", "2"]


def _max_logits(proc):
    return [float(x) for x in re.findall(r"\| max attention logit: (-?[0-9.]+) \|",
                                         proc.stdout)]


@pytest.mark.slow
def test_muon_qk_clip_tp2_dp2_distributed_equals_one_process():
    """The maxima all-reduced over DP and the clip applied to the distributed optimizer's
    main shards (then all-gathered) at TP=2 x DP=2: the one-process losses within TOL and max
    logits within the printed digit; the clip is active (from iteration 2 the losses are not
    an unclipped run's and the logits stay far below its)."""
    single = run_script("pretrain_llama.py", QK_CLIP)
    parallel = run_script("pretrain_llama.py", QK_CLIP + [
        "--tensor-model-parallel-size", "2", "--use-distributed-optimizer"], nproc=4)
    free = run_script("pretrain_llama.py", WIDE + ["--log-max-attention-logit"])
    (want, want_valid), (got, got_valid) = parse_losses(single), parse_losses(parallel)
    assert len(want) == 6 and len(want_valid) == 2
    for a, b in zip(want + want_valid, got + got_valid, strict=True):
        assert abs(a - b) <= TOL, (want, got)
    logits, free_logits = _max_logits(single), _max_logits(free)
    assert len(logits) == len(free_logits) == 6
    assert all(abs(a - b) <= 1.001e-3 for a, b in zip(logits, _max_logits(parallel),
                                                       strict=True))
    unclipped, _ = parse_losses(free)
    assert want[0] == unclipped[0] and logits[0] == free_logits[0] > 2  # before any clip
    assert min(abs(a - b) for a, b in zip(want[1:], unclipped[1:])) > 100 * TOL
    assert max(logits[1:]) < min(free_logits[1:])
