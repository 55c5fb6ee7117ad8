"""Bad multi-token prediction settings, as a user types them: one ``error:`` line naming the
flag and the fix, exit 2, no traceback, no iteration. (MTP composes with PP, untied embeddings
and CP: tests/unit/test_multi_token_prediction.py.)"""
import pytest

from tests.e2e.bad_inputs.harness import assert_clean_error, run
from tests.e2e.runner import LLAMA, TINY

CASES = [
    ("learned-positions-under-pp", ["--mtp-num-layers", "1", "--position-embedding-type",
                                    "learned_absolute", "--pipeline-model-parallel-size", "2"],
     ["--mtp-num-layers under pipeline parallelism looks the tokens up on the last stage, "
      "which has no copy of the learned position embeddings",
      "use --position-embedding-type rope (or none), or --pipeline-model-parallel-size 1."]),
    ("scale-alone", ["--mtp-loss-scaling-factor", "0.2"],
     ["--mtp-loss-scaling-factor has no effect without --mtp-num-layers D"]),
]


@pytest.mark.parametrize("extra,fragments", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_mtp_setting(extra, fragments):
    assert_clean_error(run("pretrain_llama.py", TINY + LLAMA + extra), 2, *fragments)
