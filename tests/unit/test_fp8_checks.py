"""megatron/core/fp8/checks.py: FP8 refused at start on a GPU without FP8 tensor cores and for
sizes the CUDA kernels cannot tile (16 for tensorwise/rowwise, 128 for blockwise), each one
line naming the size and the fix; CPU takes any size; no FP8, nothing checked."""
import dataclasses

from megatron.core.fp8 import Fp8Config
from megatron.core.fp8.checks import fp8_unsupported_reason
from megatron.core.models import llama_config


def _config(recipe="tensorwise", **sizes):
    kwargs = dict(num_layers=2, hidden_size=256, num_attention_heads=2, num_query_groups=1,
                  ffn_hidden_size=512, fp8=Fp8Config(recipe=recipe))
    kwargs.update(sizes)
    return llama_config(**kwargs)


def test_an_a100_is_refused_an_h100_is_not():
    reason = fp8_unsupported_reason(_config(), "cuda", (8, 0), 4096)
    assert reason.startswith("--fp8-format needs FP8 tensor cores (compute capability 8.9")
    assert "this GPU is sm80" in reason and "Drop --fp8-format" in reason
    assert fp8_unsupported_reason(_config(), "cuda", (9, 0), 4096) is None
    assert fp8_unsupported_reason(_config(), "cuda", (8, 9), 4096) is None


def test_sizes_the_kernels_cannot_tile_are_named():
    reason = fp8_unsupported_reason(_config(ffn_hidden_size=520), "cuda", (9, 0), 4096)
    assert reason.startswith("--ffn-hidden-size per TP rank is 520, which FP8 cannot tile: "
                             "cuBLAS's FP8 GEMMs need multiples of 16"), reason
    reason = fp8_unsupported_reason(_config(), "cuda", (9, 0), 4100)
    assert "tokens per microbatch" in reason and "4100" in reason
    # Blockwise: 128-wide tiles; the QKV rows per rank here are (2 + 2) x 128 = 512: fine,
    # the hidden size 192 is not.
    assert fp8_unsupported_reason(_config("blockwise"), "cuda", (9, 0), 4096) is None
    reason = fp8_unsupported_reason(_config("blockwise", hidden_size=192, kv_channels=128),
                                    "cuda", (9, 0), 4096)
    assert reason.startswith("--hidden-size is 192") and "multiples of 128" in reason


def test_cpu_and_runs_without_fp8_are_not_checked():
    assert fp8_unsupported_reason(_config(ffn_hidden_size=520), "cpu", None, 4100) is None
    plain = dataclasses.replace(_config(ffn_hidden_size=520), fp8=None)
    assert fp8_unsupported_reason(plain, "cuda", (8, 0), 4100) is None
