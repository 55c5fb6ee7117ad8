"""Megatron's cross-rank timer report (--timing-log-option), exact on a fake clock."""
from tests.distributed import run_distributed


def _report(option):
    import torch.distributed as dist

    from megatron.training.logging.timers import Timers

    now = [0.0]
    timers = Timers(log_level=2, log_option=option, clock=lambda: now[0])
    timer = timers("forward-backward", log_level=1)
    timer.start()
    now[0] += 0.5 * (dist.get_rank() + 1)  # rank 0: 500 ms, rank 1: 1000 ms
    timer.stop()
    if dist.get_rank() == 1:  # a timer only one rank has is reported for that rank
        timers("optimizer", log_level=1).start()
        now[0] += 0.25
        timers("optimizer").stop()
    return timers.log_string(["forward-backward", "optimizer", "never-made"], normalizer=2)


def test_max_minmax_and_all_across_ranks():
    label = "forward-backward ".ljust(48, ".")
    optimizer = "optimizer ".ljust(48, ".")
    for line in run_distributed(_report, world_size=2, option="minmax"):
        assert line == ("(min, max) time across ranks (ms):\n"
                        f"    {label}: (250.00, 500.00)\n    {optimizer}: (125.00, 125.00)")
    for line in run_distributed(_report, world_size=2, option="max"):
        assert line == (f"max time across ranks (ms):\n    {label}: 500.00\n"
                        f"    {optimizer}: 125.00")
    for line in run_distributed(_report, world_size=2, option="all"):
        assert line == ("times across ranks (ms):\n  forward-backward:\n     rank  0: 250.00\n"
                        "     rank  1: 500.00\n  optimizer:\n     rank  1: 125.00")
