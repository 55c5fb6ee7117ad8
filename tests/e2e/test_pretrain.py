"""pretrain_llama.py / pretrain_gpt.py end to end on CPU: one process, and torchrun with
TP=2 x PP=2 x DP=2 on 8 processes, give the same per-iteration losses (fp32; the layouts
differ only in the order of sums, <= 1e-5 as in the models issue; the log prints 7 digits)."""
import pytest

from tests.e2e.runner import LLAMA, TINY, parse_losses, run_script

TOL = 1e-5


@pytest.mark.parametrize("script,flags", [("pretrain_llama.py", TINY + LLAMA),
                                          ("pretrain_gpt.py", TINY)])
def test_tp_pp_dp_on_8_processes_equals_one_process(script, flags):
    single, single_valid = parse_losses(run_script(script, flags))
    parallel, parallel_valid = parse_losses(run_script(script, flags + [
        "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"], nproc=8))
    assert len(single) == 6 and len(single_valid) == 2
    for a, b in zip(single + single_valid, parallel + parallel_valid, strict=True):
        assert abs(a - b) <= TOL, (single, parallel)


def test_bad_flags_fail_before_any_work_with_one_message():
    proc = run_script("pretrain_llama.py", TINY + LLAMA + ["--global-batch-size", "7"])
    assert proc.returncode == 2
    assert "global" in proc.stderr and "divisible" in proc.stderr, proc.stderr
    proc = run_script("pretrain_llama.py", TINY + LLAMA + ["--num-layer", "4"])
    assert proc.returncode == 2 and "did you mean" in proc.stderr, proc.stderr


def test_interleaved_on_4_processes_equals_one_process():
    flags = TINY + LLAMA
    single, single_valid = parse_losses(run_script("pretrain_llama.py", flags))
    proc = run_script("pretrain_llama.py", flags + [
        "--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1"],
        nproc=4)
    parallel, parallel_valid = parse_losses(proc)
    for a, b in zip(single + single_valid, parallel + parallel_valid, strict=True):
        assert abs(a - b) <= TOL, (single, parallel)


def test_tensorboard_holds_the_logged_values(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    flags = TINY + LLAMA + ["--tensorboard-dir", str(tmp_path),
                            "--log-validation-ppl-to-tensorboard",
                            "--log-batch-size-to-tensorboard"]
    losses, valid = parse_losses(run_script("pretrain_llama.py", flags))
    events = EventAccumulator(str(tmp_path))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"lm loss", "learning-rate", "batch-size", "loss-scale", "grad-norm",
            "lm loss validation", "lm loss validation ppl"} <= tags, tags
    logged = [e.value for e in events.Scalars("lm loss")]
    assert [e.step for e in events.Scalars("lm loss")] == list(range(1, 7))
    for got, printed in zip(logged, losses, strict=True):
        assert abs(got - printed) <= 1e-6 * abs(printed)  # printed with 7 digits
    assert [e.step for e in events.Scalars("lm loss validation")] == [3, 6]
    assert abs(events.Scalars("lm loss validation")[-1].value - valid[-1]) <= 1e-6 * valid[-1]
