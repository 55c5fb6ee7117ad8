"""On CUDA tensors, each equal to one process through pretrain_llama.py's pretrain() (tiny
LLaMA, 6 iterations): TP=2, PP=2 (1F1B, interleaved, ZB-H1 with the gradient-accumulation
fusion), DP=2 with the distributed optimizer, ZeRO-2, FSDP2 and CPU offload, CP=2 (ring and
all-gather), and EP=2 routed experts (all-to-all, grouped GEMM).

Several ranks share the one GPU with gloo collectives on CUDA tensors (see harness.py: gloo
takes CUDA tensors for all_reduce, broadcast, all_gather[_into_tensor] and reduce_scatter_tensor,
not for send/recv, so pipeline messages are staged through host memory in these tests only).
The reference is one process on nccl, the backend's only run here. Left untested by this
file: nccl between ranks (its communicators, streams and p2p), CUDA-device p2p, and real
overlap of communication with compute across GPUs; those need one GPU per rank (docs/gpu.md).
"""
import pytest
import torch

from tests.distributed import run_distributed
from tests.e2e.runner import LLAMA, TINY, parse_losses, run_script
from tests.gpu.harness import last_stage_losses, pretrain_losses, run_on_gpu
from tests.unit.test_torch_compile import COMPILE_RTOL

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

# fp32 with TF32 off: the layouts differ only in the order of sums (as on CPU, tests/e2e).
FP32_TOL = 1e-5
# bf16 trains on one repeated batch with SGD (lr 0.5), so the loss falls far in 6 steps (4.17 ->
# 2.29 on CPU) and the tolerance is a share of that fall: bf16 (8 mantissa bits) rounds other
# partial sums in a TP all-reduce or a split GEMM than one GEMM does, moving a loss by ~1e-2
# (2e-3 at TP=2 on CPU), while on CPU at DP=2 a step that does nothing is off by the whole fall
# (1.88), a missing DP average (a doubled step) by 14% of it (0.26) and a stale parameter
# all-gather by 49% (0.91): tests/unit/test_gpu_harness.py plants each. Adam would hide the
# missing average (it is invariant to the gradients' scale).
BF16_TRAINING = ["--optimizer", "sgd", "--lr", "0.5"]
BF16_SHARE_OF_FALL = 0.05
BF16_MIN_FALL = 1.0
GLOBAL_BATCH = 8  # TINY's: the batch repeated


def assert_bf16_close(got, want, what=""):
    """Every iteration's loss within BF16_SHARE_OF_FALL of how far the reference's falls."""
    fall = want[0] - want[-1]
    assert len(got) == len(want) == 6 and fall >= BF16_MIN_FALL, (what, got, want)
    tolerance = BF16_SHARE_OF_FALL * fall
    for a, b in zip(got, want):
        assert abs(a - b) <= tolerance, (what, tolerance, got, want)


LAYOUTS = {
    "tp2": ["--tensor-model-parallel-size", "2"],
    "pp2_1f1b": ["--pipeline-model-parallel-size", "2"],
    "pp2_interleaved": ["--pipeline-model-parallel-size", "2",
                        "--num-layers-per-virtual-pipeline-stage", "1"],
    "dp2_distributed_optimizer": ["--use-distributed-optimizer", "--overlap-grad-reduce",
                                  "--overlap-param-gather"],
    "cp2_p2p": ["--context-parallel-size", "2"],
    "cp2_all_gather": ["--context-parallel-size", "2", "--cp-comm-type", "all_gather"],
    # the gradient-accumulation fusion (on by default) in the zero-bubble split backward
    "pp2_zb_h1": ["--pipeline-model-parallel-size", "2", "--pipeline-schedule", "zb-h1"],
    "dp2_fsdp2": ["--use-torch-fsdp2"],
    "dp2_zero2": ["--use-distributed-optimizer", "--shard-gradients"],
    "dp2_cpu_offload": ["--use-distributed-optimizer", "--optimizer-cpu-offload"],
    # routed experts: the all-to-all dispatch and the grouped GEMM
    "ep2_moe_grouped_gemm": ["--expert-model-parallel-size", "2"],
}
# Flags every run of a layout carries, its one-process reference included.
MODEL_FLAGS = {
    "ep2_moe_grouped_gemm": ["--num-experts", "4", "--moe-router-topk", "2",
                             "--moe-ffn-hidden-size", "16", "--moe-grouped-gemm",
                             "--moe-token-dispatcher-type", "alltoall",
                             "--moe-aux-loss-coeff", "0.01"],
}
BF16_LAYOUTS = ("tp2", "pp2_1f1b", "dp2_distributed_optimizer")


def _flags(dtype):
    # No data-loader worker processes: the ranks are daemonic pool processes.
    return TINY + LLAMA + ["--num-workers", "0"] + (
        ["--bf16"] + BF16_TRAINING if dtype == "bf16" else [])


def _repeat(dtype):
    """pretrain_losses' repeat_batch for ``dtype``: bf16 trains on one batch over and over."""
    return GLOBAL_BATCH if dtype == "bf16" else None


@pytest.fixture(scope="module")
def references(gpu_env):
    """One process on nccl (TP=PP=DP=1), per dtype."""
    out = {}
    for dtype in ("fp32", "bf16"):
        (result,) = run_on_gpu(pretrain_losses, world_size=1, backend="nccl",
                               argv=_flags(dtype), repeat_batch=_repeat(dtype))
        out[dtype] = result
    return out


def test_single_process_runs_on_nccl_and_cuda(references):
    for dtype, result in references.items():
        assert result["backend"] == "nccl" and result["device"] == "cuda", (dtype, result)
        assert len(result["losses"]) == 6 and all(torch.isfinite(torch.tensor(
            result["losses"]))), result


def test_one_process_on_gpu_equals_the_cpu_run(references, monkeypatch):
    """The GPU reference itself (CUDA's default: compiled element-wise regions, the fused
    cross entropy) against the CPU run of the same flags, eager (CPU's default; compiling
    there costs a minute on a cold machine): fp32's tolerance plus compiled-vs-eager rounding
    (COMPILE_RTOL of the loss, tests/unit/test_torch_compile.py) (no dropout in TINY:
    the two devices draw other random streams), so a CUDA-only model bug cannot hide in a
    reference every layout is compared with."""
    with monkeypatch.context() as m:
        m.setenv("MEGATRON_DIST_BACKEND", "gloo")  # run_script's process is a CPU run
        cpu, _ = parse_losses(run_script("pretrain_llama.py", _flags("fp32")))
    gpu = references["fp32"]["losses"]
    assert len(cpu) == len(gpu) == 6
    for a, b in zip(gpu, cpu):  # CPU and CUDA sum in other orders; compiled regions too
        assert abs(a - b) <= FP32_TOL + COMPILE_RTOL * abs(b), (gpu, cpu)


def test_bf16_reference_close_to_the_cpu_fp32_run(references, monkeypatch):
    """The bf16 GPU reference, which every bf16 layout is compared with, against the same SGD
    training on the repeated batch in fp32 on CPU, at the layouts' bf16 tolerance (a share of
    the fall: bf16 rounding moves a loss by ~1e-2): a CUDA bf16 bug in the one-process run
    cannot hide. tests/unit/test_gpu_harness.py shows on CPU that a no-op step fails it."""
    with monkeypatch.context() as m:
        m.setenv("MEGATRON_DEVICE", "cpu")
        m.setenv("MEGATRON_DIST_BACKEND", "gloo")
        (cpu,) = run_distributed(pretrain_losses, world_size=1, argv=fp32_of_bf16_training(),
                                 repeat_batch=GLOBAL_BATCH)
    assert cpu["device"] == "cpu"
    assert_bf16_close(references["bf16"]["losses"], cpu["losses"], "bf16 GPU vs fp32 CPU")


def fp32_of_bf16_training():
    """The bf16 runs' flags and optimizer in fp32."""
    return _flags("fp32") + BF16_TRAINING


def _fp32_reference(references, layout):
    """The one-process losses for ``layout``: the shared reference, or one of its own model."""
    if layout not in MODEL_FLAGS:
        return references["fp32"]["losses"]
    (own,) = run_on_gpu(pretrain_losses, world_size=1, backend="nccl",
                        argv=_flags("fp32") + MODEL_FLAGS[layout])
    return own["losses"]


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_fp32_layout_equals_one_process(references, layout):
    want = _fp32_reference(references, layout)
    results = run_on_gpu(pretrain_losses, world_size=2,
                         argv=_flags("fp32") + MODEL_FLAGS.get(layout, []) + LAYOUTS[layout])
    assert all(r["device"] == "cuda" and r["backend"] == "gloo" for r in results), results
    got = last_stage_losses(results)
    assert len(got) == len(want) == 6
    for a, b in zip(got, want):
        assert abs(a - b) <= FP32_TOL, (layout, got, want)


@pytest.mark.parametrize("layout", BF16_LAYOUTS)
def test_bf16_layout_close_to_one_process(references, layout):
    results = run_on_gpu(pretrain_losses, world_size=2, argv=_flags("bf16") + LAYOUTS[layout],
                         repeat_batch=_repeat("bf16"))
    assert_bf16_close(last_stage_losses(results), references["bf16"]["losses"], layout)
