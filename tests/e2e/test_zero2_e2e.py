"""--shard-gradients (ZeRO-2) through pretrain_llama.py at DP=2 on CPU.

The same arithmetic as the distributed optimizer without it (the same reduce-scatter, then an
exact copy of the shard): the printed losses are equal, not close; a run resumed from its
sharded checkpoint repeats the straight run bitwise."""
import pytest

from tests.e2e.runner import LLAMA, TINY, finish, parse_losses, start_script
from tests.e2e.test_checkpoint_resume import (
    _assert_bitwise,
    _flags,
    _iteration_losses,
    _straight_then_resume,
)

CASES = {"distributed_fp32": ["--use-distributed-optimizer"],
         "overlapped_bf16": ["--overlapped-distributed-optimizer", "--bf16",
                             "--accumulate-allreduce-grads-in-fp32"]}


@pytest.mark.parametrize("case", CASES)
def test_shard_gradients_gives_the_same_losses(case):
    flags = TINY + LLAMA + CASES[case]
    runs = [start_script("pretrain_llama.py", flags + extra, nproc=2)
            for extra in ([], ["--shard-gradients"])]  # started together: one import
    (want, want_valid), (got, got_valid) = (parse_losses(finish(run)) for run in runs)
    assert len(want) == 6 and len(want_valid) == 2
    assert (got, got_valid) == (want, want_valid)


def test_resume_with_shard_gradients_is_bitwise(tmp_path):
    flags = _flags("--use-distributed-optimizer", "--shard-gradients")
    first, second, straight, resumed = _straight_then_resume(tmp_path, flags, nproc=2)
    want, got = _iteration_losses(first), _iteration_losses(second)
    assert sorted(got) == ["3", "4"] and [got[i] for i in "34"] == [want[i] for i in "34"]
    _assert_bitwise(straight, resumed, 4)
