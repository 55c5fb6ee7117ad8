"""--optimizer-cpu-offload through pretrain_llama.py: the same losses as without it.

On CPU the offloaded step runs the same fused CPU AdamW on the same fp32 values as the
step without offload, so the printed losses are equal, not just close."""
import pytest

from tests.e2e.runner import LLAMA, TINY, finish, parse_losses, start_script

CASES = {"plain_fp32": ([], 1),
         "distributed_bf16_dp2": (["--use-distributed-optimizer", "--bf16"], 2),
         # torch's CPUOffloadPolicy: the fp32 shards and their gradients on the host, the
         # inf check there too (fp16: the first steps overflow and are skipped alike)
         "fsdp2_fp16_dp2": (["--use-torch-fsdp2", "--fp16", "--initial-loss-scale", "1048576"],
                            2)}


@pytest.mark.parametrize("case", CASES)
def test_offload_gives_the_same_losses(case):
    flags, nproc = CASES[case]
    flags = TINY + LLAMA + flags
    runs = [start_script("pretrain_llama.py", flags + extra, nproc=nproc)
            for extra in ([], ["--optimizer-cpu-offload"])]  # started together: one import
    (want, want_valid), (got, got_valid) = (parse_losses(finish(run)) for run in runs)
    assert len(want) == (4 if "fp16" in case else 6) and len(want_valid) == 2  # 2 skipped
    assert (got, got_valid) == (want, want_valid)
