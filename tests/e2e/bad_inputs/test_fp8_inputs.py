"""Bad FP8 settings, as a user types them: one ``error:`` line naming the flag and the fix,
exit 2, no traceback, no iteration. (FP8 on a GPU older than sm89 and sizes cuBLAS cannot
tile are CUDA-only: tests/unit/test_fp8_checks.py calls the same check with those devices;
the FP8 flags' ranges and dependencies go through the tables tests/unit/test_arguments.py
and test_flag_dependencies.py check as a whole.)"""
import pytest

from tests.e2e.bad_inputs.harness import assert_clean_error, run
from tests.e2e.runner import LLAMA, TINY

FLAGS = TINY + LLAMA

CASES = [
    ("hybrid-with-blockwise", ["--fp8-format", "hybrid", "--fp8-recipe", "blockwise"],
     ["--fp8-format hybrid is not available with --fp8-recipe blockwise",
      "use --fp8-format e4m3"]),
    ("recipe-without-format", ["--fp8-recipe", "rowwise"],
     ["--fp8-recipe has no effect without --fp8-format e4m3|hybrid"]),
    ("history-without-delayed", ["--fp8-format", "e4m3", "--fp8-recipe", "blockwise",
                                 "--fp8-amax-history-len", "16"],
     ["--fp8-amax-history-len has no effect without --fp8-recipe delayed"]),
    ("history-of-zero", ["--fp8-format", "e4m3", "--fp8-recipe", "delayed",
                         "--fp8-amax-history-len", "0"], ["--fp8-amax-history-len"]),
    ("unknown-amax-algo", ["--fp8-format", "e4m3", "--fp8-recipe", "delayed",
                           "--fp8-amax-compute-algo", "mean"],
     ["--fp8-amax-compute-algo", "most_recent", "max"]),
    ("delayed-with-experts", ["--fp8-format", "e4m3", "--fp8-recipe", "delayed",
                              "--num-experts", "4", "--moe-router-topk", "2"],
     ["--fp8-recipe delayed does not cover the MoE experts' GEMMs yet"]),
    ("param-gather-without-distributed-optimizer", ["--fp8-format", "e4m3",
                                                    "--fp8-param-gather"],
     ["--fp8-param-gather has no effect without --use-distributed-optimizer"]),
    ("param-gather-rowwise", ["--fp8-format", "e4m3", "--fp8-recipe", "rowwise",
                              "--use-distributed-optimizer", "--fp8-param-gather"],
     ["--fp8-param-gather gathers weights quantized with their tensor's or 128 x 128",
      "use --fp8-recipe tensorwise, blockwise or delayed, not rowwise"]),
    ("param-gather-fsdp2", ["--fp8-format", "e4m3", "--use-torch-fsdp2",
                            "--fp8-param-gather"],
     ["--fp8-param-gather with --use-torch-fsdp2 is not built yet"]),
]


@pytest.mark.parametrize("extra,fragments", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_fp8_setting(extra, fragments):
    assert_clean_error(run("pretrain_llama.py", FLAGS + extra), 2, *fragments)
