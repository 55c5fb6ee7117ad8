"""A CUDA run whose context-parallel attention would take the fp32 reference block kernel
(attention dropout, packed documents, fp32, an odd head dim) at more than 4096 tokens per rank
stops at config time with one error naming the cause and the fix, unless
--allow-math-attention; CPU keeps working. CUDA is faked as tests/unit/test_device.py does."""
import pytest

from megatron.core import device
from megatron.training.arguments import ConfigError, build_configs, parse_args
from tests.unit.test_arguments import small


# --- the reference kernel at long local sequences is refused on CUDA ---------------------

def _cp_argv(*extra, seq=16384, dtype=("--bf16",)):
    return small("--context-parallel-size", "2", "--seq-length", str(seq),
                 "--max-position-embeddings", str(seq), *dtype, *extra)


def _refusal(argv):
    try:
        build_configs(parse_args(argv), world_size=2)
    except ConfigError as error:
        return str(error)
    return None


@pytest.fixture
def fake_cuda(monkeypatch):
    monkeypatch.setattr(device, "device_type", lambda: "cuda")


def test_reference_kernel_at_long_local_sequences_is_refused_on_cuda(fake_cuda):
    dropout = _refusal(_cp_argv("--attention-dropout", "0.1"))
    assert dropout is not None and "\n" not in dropout
    for part in ("fp32 reference attention kernel", "attention dropout 0.1",
                 "8192 tokens per rank", "--attention-dropout 0", "--allow-math-attention",
                 "raise --context-parallel-size"):
        assert part in dropout, dropout
    # 4 heads x 8192^2 x 4 bytes of scores per block and sample
    assert "1.1 GB" in dropout, dropout
    packed = _refusal(_cp_argv("--attention-dropout", "0", "--reset-attention-mask"))
    assert "packed documents" in packed and "--reset-attention-mask" in packed, packed
    fp32 = _refusal(_cp_argv("--attention-dropout", "0", dtype=()))
    assert "float32" in fp32 and "--bf16" in fp32, fp32


def test_what_the_reference_kernel_check_lets_through(fake_cuda, monkeypatch):
    assert _refusal(_cp_argv("--attention-dropout", "0")) is None  # the flash kernel runs
    assert _refusal(_cp_argv("--attention-dropout", "0.1", "--allow-math-attention")) is None
    assert _refusal(_cp_argv("--attention-dropout", "0.1", seq=8192)) is None  # 4096 per rank
    monkeypatch.setattr(device, "device_type", lambda: "cpu")  # CPU keeps working
    assert _refusal(_cp_argv("--attention-dropout", "0.1", "--reset-attention-mask")) is None
