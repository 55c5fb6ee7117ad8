"""How a run stops on a user's mistake: one ``error:`` line, from one rank, and an exit code;
no Python traceback (set MEGATRON_TRACEBACK=1 to see it when debugging).

Entry points and tools call ``report_error`` / ``exit_with_error``; the caller decides the
code (2: the input was wrong before any work, as argparse does; 1: a failure during the run).
"""
import datetime
import gc
import os
import sys
import traceback
from typing import NoReturn, Optional, Union

import torch.distributed as dist

TRACEBACK_ENV = "MEGATRON_TRACEBACK"


def is_reporting_rank() -> bool:
    """Rank 0 of the job (before torch.distributed starts, torchrun's RANK says which)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank() == 0
    return int(os.environ.get("RANK", "0")) == 0


def error_report_key(restart: str = "0") -> str:
    """The store key counting which rank reports a job attempt's error."""
    return f"megatron/error_reported/{restart}"


def _first_to_report() -> bool:
    """Whether this rank reports the job's error. Before torch.distributed starts every rank
    sees the same flags and files, so rank 0 speaks. After, an error may be raised on some
    ranks only (a data-reading rank, one stage): the first rank to get here speaks, decided
    by an atomic counter in the job's store; if the store cannot answer (its host is gone),
    this rank speaks rather than nobody."""
    if not (dist.is_available() and dist.is_initialized()):
        return is_reporting_rank()
    try:
        store = dist.distributed_c10d._get_default_store()
        store.set_timeout(datetime.timedelta(seconds=10))  # never the run's long timeout
        restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        return store.add(error_report_key(restart), 1) == 1
    except Exception:  # noqa: BLE001 (any store failure: speak)
        return True


def report_error(error: Union[str, BaseException], prog: Optional[str] = None) -> None:
    """Print ``[prog: ]error: <message>`` once for the job (see ``_first_to_report``); with
    MEGATRON_TRACEBACK set, the traceback of the exception being handled first (every rank)."""
    if os.environ.get(TRACEBACK_ENV) and sys.exc_info()[0] is not None:
        traceback.print_exc()
    if _first_to_report():
        prefix = f"{prog}: " if prog else ""
        message = " ".join(str(error).split("\n"))  # one line, whatever the exception held
        print(f"{prefix}error: {message}", file=sys.stderr, flush=True)


def shutdown_distributed() -> None:
    """Tear the process groups down before the interpreter does: left to interpreter exit,
    gloo's worker threads can abort the process (SIGABRT, "terminate called without an
    active exception", pytorch/pytorch#190489). Collective: every rank calls it at the same
    point (the end of training, or an error all ranks agreed on)."""
    if dist.is_available() and dist.is_initialized():
        from megatron.core import parallel_state

        # Our own references to the groups go first, then the groups; the last holders (a
        # model's buckets, FSDP2's meshes) may sit in reference cycles: collected now, so
        # every gloo group is torn down while the interpreter is whole, not during its
        # finalization (where a worker thread's last tensor crashes it: the abort above).
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()
        gc.collect()


def exit_with_error(error: Union[str, BaseException], code: int,
                    prog: Optional[str] = None, shutdown: bool = True) -> NoReturn:
    """``report_error`` then exit with ``code``. ``shutdown``: every rank reached this point
    together (an agreed error), so the process groups can be torn down first."""
    report_error(error, prog)
    if shutdown:
        shutdown_distributed()
    sys.exit(code)
