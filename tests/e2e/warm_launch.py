"""Run an entry point (``pretrain_llama.py``...) in the warm rank pool of tests/distributed.py
instead of a torchrun launch: the script runs as ``__main__`` inside already-started ranks,
with the environment torchrun would give it (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_*), its
argv, the test's environment and the checkout as working directory; its stdout and stderr
(file descriptors 1 and 2, so C-level output too) are captured per rank and joined in rank
order, as torchrun's one console would show them. A launch costs about 1.7 s of CPU for
torchrun and 2.3 s per rank for importing torch; here it costs neither.

Only clean runs belong in the pool: a run that exits non-zero or raises on any rank fails
the test, saying to launch it for real (``warm=False``), so exit codes, error lines and what
torchrun prints are always a real launch's (a relaunch after a failed warm attempt would
find what that attempt left behind).
"""
import multiprocessing
import os
import signal
import subprocess
import sys
import tempfile
import warnings

from tests.script_main import run_as_main

# Entry points that run whole in a rank: their main() tears nothing down that the pool needs
# (shutdown_distributed is made a no-op for the run).
WARM_SCRIPTS = ("pretrain_llama.py", "pretrain_gpt.py", "tools/checkpoint/verify.py")


class WarmRunFailed(Exception):
    """The script exited non-zero or raised on this rank (message: its code and output)."""


def _run_in_rank(script_path: str, argv, env: dict, cwd: str, nproc: int):
    """The task each pool rank runs: the script as __main__; returns (code, stdout, stderr)."""
    import torch
    import torch.distributed as dist
    from megatron.training.guards import errors

    rank = dist.get_rank()
    saved_env, saved_argv, saved_cwd = dict(os.environ), list(sys.argv), os.getcwd()
    saved_path = list(sys.path)  # scripts put their checkout first, as tools do
    saved_signals = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    saved_shutdown = errors.shutdown_distributed
    outputs = [tempfile.TemporaryFile(mode="w+b") for _ in range(2)]
    saved_fds = [os.dup(1), os.dup(2)]
    os.environ.clear()
    os.environ.update(env, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(nproc),
                      LOCAL_WORLD_SIZE=str(nproc), GROUP_RANK="0")
    sys.argv = [script_path] + [str(a) for a in argv]
    os.chdir(cwd)
    errors.shutdown_distributed = lambda: None  # the pool keeps its process group
    # Pool ranks are daemonic processes, which multiprocessing forbids to start children; the
    # script's data loader workers are its own to start and to end, as in a launch.
    process_config = multiprocessing.current_process()._config
    was_daemon = process_config.get("daemon")
    process_config["daemon"] = False
    # A spawned rank inherits "spawn" as its start method; under torchrun the script's loader
    # workers fork (Linux's default), which costs no torch import per worker.
    start_method = multiprocessing.get_start_method(allow_none=True)
    multiprocessing.set_start_method("fork", force=True)
    if hasattr(warnings, "_filters_mutated"):
        warnings._filters_mutated()  # once-per-process warnings print again, as in a launch
    sys.stdout.flush()
    sys.stderr.flush()
    for fd, out in zip((1, 2), outputs):
        os.dup2(out.fileno(), fd)
    try:
        code = run_as_main(script_path)
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        for fd, saved in zip((1, 2), saved_fds):
            os.dup2(saved, fd)
            os.close(saved)
        errors.shutdown_distributed = saved_shutdown
        process_config["daemon"] = was_daemon
        multiprocessing.set_start_method(start_method, force=True)
        for signum, handler in saved_signals.items():
            signal.signal(signum, handler)
        os.chdir(saved_cwd)
        sys.argv = saved_argv
        sys.path[:] = saved_path
        os.environ.clear()
        os.environ.update(saved_env)
        torch.set_num_threads(1)
    texts = []
    for out in outputs:
        out.seek(0)
        texts.append(out.read().decode(errors="replace"))
        out.close()
    if code != 0:
        raise WarmRunFailed(f"exit code {code}\n{texts[0][-2000:]}{texts[1][-2000:]}")
    dist.barrier()
    if rank == 0:  # the next run's first error must be reported again
        dist.distributed_c10d._get_default_store().delete_key(errors.error_report_key())
    return code, texts[0], texts[1]


def run_warm(script_path: str, flags, nproc: int, env: dict, cwd: str, timeout: float):
    """A CompletedProcess of the script run in the pool of ``nproc`` ranks. A run that is not
    clean raises: relaunching it for real would find what the failed attempt left (its
    checkpoints, its W&B run), and its exit code and output would not be a launch's; a test
    of a failing run says ``warm=False``."""
    from tests import distributed

    try:
        results = distributed.run_distributed(_run_in_rank, world_size=nproc, timeout=timeout,
                                              script_path=script_path, argv=list(flags),
                                              env=env, cwd=cwd, nproc=nproc)
    except (distributed.RankFailed, TimeoutError) as exc:
        raise AssertionError(
            f"{os.path.basename(script_path)} did not run clean in the warm rank pool; a run "
            f"meant to fail must be launched for real (run_script/start_script(..., "
            f"warm=False)):\n{exc}") from None
    return subprocess.CompletedProcess(
        [sys.executable, script_path, *map(str, flags)], 0,
        "".join(out for _, out, _ in results), "".join(err for _, _, err in results))
