"""Run a benchmark's ``run_rank(rank, world_size, args)`` on ``world_size`` gloo processes:
under torchrun when launched by it, else spawned here with the rendezvous store held by the
parent on a free port (held, not guessed)."""
import os
import sys

import torch.distributed as dist

_HOST = "127.0.0.1"


def _spawned(rank, world_size, port, run_rank, args, threads):
    os.environ.setdefault("OMP_NUM_THREADS", str(threads))
    store = dist.TCPStore(_HOST, port, world_size, is_master=False)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)
    try:
        run_rank(rank, world_size, args)
    finally:
        dist.destroy_process_group()


def launch(run_rank, world_size: int, args, name: str, threads: int = 1) -> None:
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # under torchrun
        if int(os.environ["WORLD_SIZE"]) != world_size:
            sys.exit(f"{name} needs exactly {world_size} processes.")
        dist.init_process_group("gloo")
        try:
            run_rank(dist.get_rank(), world_size, args)
        finally:
            dist.destroy_process_group()
        return
    import torch.multiprocessing as mp

    store = dist.TCPStore(_HOST, 0, None, True, wait_for_workers=False)
    os.environ["OMP_NUM_THREADS"] = str(threads)
    mp.spawn(_spawned, args=(world_size, store.port, run_rank, args, threads),
             nprocs=world_size, join=True)
