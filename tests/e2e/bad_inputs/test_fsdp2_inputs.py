"""--use-torch-fsdp2 with what it does not compose with, under torchrun (the refusals that
need a pipeline, so more than one rank: world-size checks come first). One ``error:`` line,
from one rank, before iteration 1; the worker's exit code is 2 (torchrun's own is 1)."""
from tests.e2e.bad_inputs.harness import assert_clean_error, run_torchrun
from tests.e2e.runner import LLAMA, TINY


def test_fsdp2_refuses_the_zero_bubble_schedule():
    """FSDP2 reduce-scatters a layer's gradients when its B is done; the deferred W comes
    later, so the reduction would miss the weight gradients."""
    proc = run_torchrun("pretrain_llama.py", TINY + LLAMA + [
        "--use-torch-fsdp2", "--pipeline-model-parallel-size", "2",
        "--pipeline-schedule", "zb-h1"], nproc=2)
    assert_clean_error(proc, 1, "--use-torch-fsdp2 with --pipeline-schedule zb-h1 is not "
                       "supported", "use 1f1b or interleaved.", torchrun=True)
    assert "exitcode  : 2" in proc.stderr
