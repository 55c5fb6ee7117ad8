"""Bad multi-token prediction settings, as a user types them: one ``error:`` line naming the
flag and the fix, exit 2, no traceback, no iteration. (MTP under context parallelism, a
config rule: tests/unit/test_multi_token_prediction.py.)"""
import pytest

from tests.e2e.bad_inputs.harness import assert_clean_error, run
from tests.e2e.runner import LLAMA, TINY

CASES = [
    ("untied-under-pp", ["--mtp-num-layers", "1", "--pipeline-model-parallel-size", "2"],
     ["--mtp-num-layers under pipeline parallelism needs tied embeddings",
      "drop --untie-embeddings-and-output-weights or use --pipeline-model-parallel-size 1."]),
    ("scale-alone", ["--mtp-loss-scaling-factor", "0.2"],
     ["--mtp-loss-scaling-factor has no effect without --mtp-num-layers D"]),
]


@pytest.mark.parametrize("extra,fragments", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_mtp_setting(extra, fragments):
    assert_clean_error(run("pretrain_llama.py", TINY + LLAMA + extra), 2, *fragments)
