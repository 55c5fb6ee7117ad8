"""Bad sliding-window settings, as a user types them: one ``error:`` line naming the flag and
the fix, exit 2, no traceback, no iteration. (A negative left size: the same check,
tests/unit/test_sliding_window.py; --window-attn-skip-freq alone: the dependency table.)"""
import pytest

from tests.e2e.bad_inputs.harness import assert_clean_error, run
from tests.e2e.runner import LLAMA, TINY

CASES = [
    ("right-context", ["--window-size", "4,2"],
     ["--window-size 4,2: only causal windows are supported", "e.g. --window-size 4,0"]),
    ("not-two-integers", ["--window-size", "4096"],
     ["--window-size: '4096' is not LEFT,RIGHT (two integers, e.g. 4095,0)"]),
]


@pytest.mark.parametrize("extra,fragments", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_window_setting(extra, fragments):
    assert_clean_error(run("pretrain_llama.py", TINY + LLAMA + extra), 2, *fragments)
