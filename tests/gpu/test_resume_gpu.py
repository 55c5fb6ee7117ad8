"""Save and resume on the GPU, and a CPU checkpoint resumed on the GPU, through
pretrain_llama.py's pretrain() in one process on nccl (tiny LLaMA, 4 iterations, saves at 2
and 4).

Bitwise on the GPU, in fp32 and bf16: the resumed run repeats the uninterrupted run's
arithmetic, provided the kernels do the same arithmetic every time. The runs use
deterministic algorithms and the math SDPA kernel (flash and memory-efficient attention
accumulate their backward with atomics, whose order varies) and cuBLAS's deterministic
workspace; an op with no deterministic version fails the test by name, which is the finding.
"""
import pytest
import torch

from tests.e2e.runner import LLAMA, TINY, checkpoint_tensors, parse_losses, run_script, without
from tests.gpu.harness import pretrain_losses, run_on_gpu
from tests.unit.test_torch_compile import COMPILE_RTOL

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

# CPU and CUDA kernels sum in other orders (TF32 off): fp32's tolerance across layouts.
CPU_TO_GPU_TOL = 1e-5


def _flags(*extra, dtype="fp32", dropout="0.1"):
    base = without(TINY, "--train-iters", "--eval-interval", "--hidden-dropout",
                   "--attention-dropout")
    return base + LLAMA + [
        "--train-iters", "4", "--eval-interval", "2", "--num-workers", "0",
        "--hidden-dropout", dropout, "--attention-dropout", dropout,
        *(["--bf16"] if dtype == "bf16" else []), *[str(e) for e in extra]]


def _on_gpu(argv, bitwise=True):
    (result,) = run_on_gpu(pretrain_losses, world_size=1, backend="nccl", argv=argv,
                           bitwise=bitwise)
    assert result["device"] == "cuda" and result["backend"] == "nccl", result
    return result["losses"]


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_resume_on_gpu_is_bitwise(gpu_env, tmp_path, dtype):
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    first = _on_gpu(_flags("--save", straight, "--save-interval", 2, dtype=dtype))
    second = _on_gpu(_flags("--load", straight, "--ckpt-step", 2, "--save", resumed,
                            dtype=dtype))
    assert len(first) == 4 and second == first[2:], (first, second)  # dropout streams too
    a, b = checkpoint_tensors(straight, 4), checkpoint_tensors(resumed, 4)
    assert a.keys() == b.keys() and a
    for key in a:
        assert torch.equal(a[key].cpu(), b[key].cpu()), key


def test_cpu_checkpoint_resumes_on_gpu(gpu_env, tmp_path, monkeypatch):
    saved = tmp_path / "cpu"
    # Dropout off: CPU and CUDA draw different random streams, not a resume question.
    flags = _flags(dropout="0")
    with monkeypatch.context() as m:
        m.setenv("MEGATRON_DIST_BACKEND", "gloo")  # the runner's process is a CPU run
        cpu_losses, _ = parse_losses(run_script(
            "pretrain_llama.py", flags + ["--save", str(saved), "--save-interval", "2"]))
    assert len(cpu_losses) == 4
    gpu_losses = _on_gpu(flags + ["--load", str(saved), "--ckpt-step", "2"], bitwise=False)
    assert len(gpu_losses) == 2, gpu_losses  # iterations 3 and 4: it resumed
    for a, b in zip(gpu_losses, cpu_losses[2:]):  # CPU eager, CUDA compiled (its default)
        assert abs(a - b) <= CPU_TO_GPU_TOL + COMPILE_RTOL * abs(b), (gpu_losses, cpu_losses)
