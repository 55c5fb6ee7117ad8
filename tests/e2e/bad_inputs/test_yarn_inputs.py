"""Bad YaRN settings, as a user types them: one ``error:`` line naming the flag and the fix,
exit 2, no traceback, no iteration. (Every YaRN flag without --rope-type yarn and each range:
tests/unit/test_flag_dependencies.py, tests/unit/test_rope_yarn.py.)"""
import pytest

from tests.e2e.bad_inputs.harness import assert_clean_error, run
from tests.e2e.runner import LLAMA, TINY

CASES = [
    ("factor-without-yarn", ["--rotary-scaling-factor", "4"],
     ["--rotary-scaling-factor has no effect without --rope-type yarn: add --rope-type yarn "
      "or drop --rotary-scaling-factor."]),
    ("yarn-and-llama3", ["--rope-type", "yarn", "--use-rope-scaling"],
     ["--use-rope-scaling (LLaMA-3.1) and --rope-type yarn both rescale the rotary "
      "frequencies; give one."]),
]


@pytest.mark.parametrize("extra,fragments", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_yarn_setting(extra, fragments):
    assert_clean_error(run("pretrain_llama.py", TINY + LLAMA + extra), 2, *fragments)
