"""Run a test function on N ranks (gloo on CPU), the way torchrun would.

    results = run_distributed(fn, world_size=8, tp=2, pp=2, x=1)

runs ``fn(x=1)`` on ranks 0..7 with torch.distributed and parallel_state initialised, and
returns the per-rank return values in rank order. A failing rank's traceback is re-raised here;
if any rank is still running after ``timeout`` seconds, all of them are killed.

Importing torch costs seconds per process, so the ranks are kept alive between tests: one pool
of N workers per world size, each with its process group initialised once. Workers are forked
from multiprocessing's fork server, which imported torch and megatron once (a fresh process of
its own, never a fork of pytest: nothing of the test process, CUDA included, is inherited); an
8-rank pool starts in about 1-2 s instead of 4. Each worker takes the test process's
environment of the moment, as a spawned one would; a pool serves only runs of the device and
backend it was made for (MEGATRON_DEVICE, MEGATRON_DIST_BACKEND), another is replaced. Every
task starts from the same seed and leaves parallel_state destroyed; a failing or hung task kills its pool, and the next test gets
a fresh one.
"""
import atexit
import itertools
import os
import pickle
import queue
import sys
import time
import traceback
from typing import Any, Callable, Dict, List, Optional

import torch.multiprocessing as mp

from tests import nccl_faithful

_HOST = "127.0.0.1"
_GRACE_AFTER_FAILURE_S = 10.0
_DEFAULT_TIMEOUT_S = 180.0
# What every rank imports anyway, imported once in the fork server. torch._dynamo: every
# torch optimizer's constructor imports it (about 1.4 s), and nearly every task builds one.
_PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "megatron.core.parallel_state",
            "megatron.core.tensor_parallel", "megatron.training.pretrain"]


class RankFailed(AssertionError):
    """A rank raised; the message holds its traceback."""


def _worker(rank: int, world_size: int, port: int, tasks, results, env: Dict[str, str]) -> None:
    os.environ.clear()  # the test process's environment, not the fork server's
    os.environ.update(env)
    import torch
    import torch.distributed as dist
    from megatron.core import device, parallel_state
    from megatron.core.tensor_parallel import random as tp_random

    torch.set_num_threads(1)  # N ranks share 2 cores
    store = dist.TCPStore(_HOST, port, world_size, is_master=False)
    device.set_device(rank)
    dist.init_process_group(_backend(env), store=store, rank=rank, world_size=world_size)
    while True:
        task = tasks.get()
        if task is None:
            break
        task_id, fn_bytes, kwargs, layout = task
        try:
            torch.manual_seed(1234)
            tp_random.get_rng_tracker().reset()
            fn = pickle.loads(fn_bytes)
            if layout is not None:
                parallel_state.initialize_model_parallel(*layout)
            payload = (True, pickle.dumps(fn(**kwargs)))
        except BaseException:  # noqa: BLE001 - everything goes back to pytest
            payload = (False, f"rank {rank}:\n{traceback.format_exc()}")
        finally:
            parallel_state.destroy_model_parallel()
            _forget_compiled_code()
            os.environ.clear()  # a task's environment changes end with it
            os.environ.update(env)
        results.put((task_id, rank) + payload)
    dist.destroy_process_group()


def _forget_compiled_code() -> None:
    """A task's torch.compile'd code ends with it, as in a fresh process: compiled functions
    are shared by all layers (megatron/core/compiled.py), so the tasks a pooled rank serves
    (other shapes, dtypes, layouts) would otherwise pile up recompilations of one function
    until dynamo's recompile limit (8) refuses the next (the GPU tier's bf16 PP=2 case did)."""
    dynamo = sys.modules.get("torch._dynamo")
    if dynamo is not None:
        dynamo.reset()


def _rank_env(world_size: int) -> Dict[str, str]:
    """The environment a new rank of a ``world_size`` pool starts with."""
    from megatron.core import device

    env = dict(os.environ, OMP_NUM_THREADS="1")
    if "MEGATRON_DEVICE" not in os.environ and device.cuda_device_count() < world_size:
        env["MEGATRON_DEVICE"] = "cpu"  # nccl needs one GPU per rank
    return env


def _device_and_backend(env: Dict[str, str]) -> tuple:
    """What a rank's process group was made for: its device and collective backend, as
    megatron.core.device resolves them from ``env`` (unset means the default), or the
    nccl-faithful test group (tests/nccl_faithful.py) when ``env`` asks for it."""
    import torch

    device = env.get("MEGATRON_DEVICE") or ("cuda" if torch.cuda.is_available() else "cpu")
    if env.get(nccl_faithful.ENV) == "1":
        return device, nccl_faithful.BACKEND
    return device, env.get("MEGATRON_DIST_BACKEND") or ("nccl" if device == "cuda" else "gloo")


def _backend(env: Dict[str, str]) -> str:
    """The backend a new rank's default group is made with."""
    from megatron.core import device

    if _device_and_backend(env)[1] == nccl_faithful.BACKEND:
        nccl_faithful.register()
        return nccl_faithful.BACKEND
    return device.dist_backend()


class _Pool:
    def __init__(self, world_size: int):
        import torch.distributed as dist

        self.world_size = world_size
        # The parent hosts the rendezvous store, so the port is held, not guessed.
        self.store = dist.TCPStore(_HOST, 0, None, True, wait_for_workers=False)
        env = _rank_env(world_size)
        self.made_for = _device_and_backend(env)
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(_PRELOAD)
        self.results = ctx.Queue()
        self.tasks = [ctx.Queue() for _ in range(world_size)]
        self.procs = [
            ctx.Process(target=_worker, daemon=True,
                        args=(r, world_size, self.store.port, self.tasks[r], self.results, env))
            for r in range(world_size)
        ]
        for p in self.procs:
            p.start()
        self.task_ids = itertools.count()

    def run(self, fn: Callable, kwargs: Dict[str, Any], layout, timeout: float) -> List[Any]:

        task_id = next(self.task_ids)
        fn_bytes = pickle.dumps(fn)
        for q in self.tasks:
            q.put((task_id, fn_bytes, kwargs, layout))
        values: Dict[int, Any] = {}
        failures: Dict[int, str] = {}
        deadline = time.monotonic() + timeout
        while len(values) + len(failures) < self.world_size and time.monotonic() < deadline:
            try:
                got_id, rank, ok, payload = self.results.get(timeout=1.0)
            except queue.Empty:
                for r, p in enumerate(self.procs):
                    if not p.is_alive() and r not in values and r not in failures:
                        failures[r] = f"rank {r}: process died (exit code {p.exitcode})"
            else:
                if got_id != task_id:
                    continue
                if ok:
                    values[rank] = pickle.loads(payload)
                else:
                    failures[rank] = payload
            if failures:  # the others may wait forever on a collective the failed rank left
                deadline = min(deadline, time.monotonic() + _GRACE_AFTER_FAILURE_S)
        missing = sorted(set(range(self.world_size)) - set(values) - set(failures))
        if failures:
            raise RankFailed("\n".join(failures[r] for r in sorted(failures)) + (
                f"\n(ranks {missing} were still running and were killed)" if missing else ""))
        if missing:
            raise TimeoutError(f"ranks {missing} of {self.world_size} did not finish within "
                               f"{timeout:.0f} s; all ranks were killed.")
        return [values[r] for r in range(self.world_size)]

    def alive(self) -> bool:
        return all(p.is_alive() for p in self.procs)

    def close(self, kill: bool = False) -> None:
        if not kill:
            for q in self.tasks:
                q.put(None)
            for p in self.procs:
                p.join(timeout=10)
        for p in self.procs:
            if p.is_alive():
                p.kill()
            p.join()


_POOLS: Dict[int, _Pool] = {}


def run_distributed(fn: Callable, world_size: int, tp: Optional[int] = None,
                    pp: Optional[int] = None, vpp: Optional[int] = None,
                    timeout: float = _DEFAULT_TIMEOUT_S, cp: Optional[int] = None,
                    **kwargs) -> List[Any]:
    """Run module-level ``fn(**kwargs)`` on ``world_size`` ranks; return values in rank order.

    With ``tp``/``pp``/``vpp``/``cp`` given, parallel_state is initialised with them first
    (TP, PP and CP default to 1); without any, ``fn`` sets up parallel_state itself.
    """
    layout = None
    if tp is not None or pp is not None or vpp is not None or cp is not None:
        layout = (tp or 1, pp or 1, vpp, 10.0, cp or 1)
    pool = _POOLS.get(world_size)
    # A pool serves the device and backend it was made for: a CPU run must not land in the
    # nccl ranks a GPU test left (its process group has no CPU backend), nor the reverse.
    if pool is None or not pool.alive() or \
            pool.made_for != _device_and_backend(_rank_env(world_size)):
        if pool is not None:
            pool.close(kill=True)
        pool = _POOLS[world_size] = _Pool(world_size)
    try:
        return pool.run(fn, kwargs, layout, timeout)
    except BaseException:
        del _POOLS[world_size]
        pool.close(kill=True)
        raise


@atexit.register
def close_pools() -> None:
    """End every rank pool (the next run_distributed starts fresh ones)."""
    for pool in _POOLS.values():
        pool.close()
    _POOLS.clear()
