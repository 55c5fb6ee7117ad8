"""guards/errors.py: one error line for the whole job, whichever ranks raised it."""
import contextlib
import io
import os
import uuid

from tests.distributed import run_distributed


def _report(reporting_ranks, round_id):
    import torch.distributed as dist

    from megatron.training.guards.errors import report_error

    os.environ["TORCHELASTIC_RESTART_COUNT"] = round_id  # a fresh counter for this case
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        if dist.get_rank() in reporting_ranks:
            report_error(f"bad input seen by rank {dist.get_rank()}")
    dist.barrier()
    return err.getvalue()


def _lines(outputs):
    return [line for out in outputs for line in out.splitlines()]


def test_an_error_raised_on_one_rank_only_is_reported_by_that_rank():
    """Before, only rank 0 printed: an error on rank 1 alone exited without a line."""
    outputs = run_distributed(_report, world_size=2, reporting_ranks=[1],
                              round_id=uuid.uuid4().hex)
    assert outputs == ["", "error: bad input seen by rank 1\n"]


def test_an_error_raised_on_every_rank_is_reported_once():
    outputs = run_distributed(_report, world_size=2, reporting_ranks=[0, 1],
                              round_id=uuid.uuid4().hex)
    lines = _lines(outputs)
    assert len(lines) == 1 and lines[0] in ("error: bad input seen by rank 0",
                                            "error: bad input seen by rank 1"), outputs
