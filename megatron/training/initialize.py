"""Start a run: torch.distributed from torchrun's environment (or a plain single process),
the device, parallel_state, and the seeds.

Seeds follow Megatron where it matters for reproducibility: python, numpy and the dropout
streams get ``seed + 100 * pipeline_rank`` (and the tensor-parallel stream its own offset, see
``model_parallel_manual_seed``). Model weights are drawn separately, from ``seed`` on every
rank (``seed_for_model_init``), so they do not depend on the parallel layout.
"""
import datetime
import os
import random
import socket
from typing import Optional

import numpy as np
import torch
import torch.distributed as dist

from megatron.core import device, parallel_state
from megatron.core.tensor_parallel import model_parallel_manual_seed

_TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def initialize_distributed(device_type: Optional[str] = None,
                           timeout_minutes: float = 10.0) -> None:
    """Join the job torchrun started, or make a one-process group when run directly.
    ``timeout_minutes`` (--distributed-timeout-minutes) bounds every collective's wait."""
    if device_type not in (None, "auto"):
        device.set_device_type(device_type)
    if dist.is_initialized():
        return
    env = {k: os.environ.get(k) for k in _TORCHRUN_VARS}
    if env["RANK"] is None or env["WORLD_SIZE"] is None:
        # Not under torchrun: a world of one, so every code path is the same.
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device.set_device(local_rank)
    kwargs = dict(timeout=datetime.timedelta(minutes=timeout_minutes))
    device_id = device.process_group_device_id(local_rank)
    if device_id is not None:
        kwargs["device_id"] = device_id
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if restart == 0:
        dist.init_process_group(device.dist_backend(), **kwargs)
        return
    # A worker group torchrun restarted: the store still holds the failed group's addresses
    # under the same keys, and gloo/nccl would connect to dead peers (pytorch/pytorch#167288).
    # Keys under a prefix of this attempt cannot be stale.
    store = dist.PrefixStore(f"megatron_attempt_{restart}/", dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
        timeout=kwargs["timeout"]))
    dist.init_process_group(device.dist_backend(), store=store,
                            rank=int(os.environ["RANK"]),
                            world_size=int(os.environ["WORLD_SIZE"]), **kwargs)


def set_random_seeds(seed: int) -> None:
    """Megatron's per-rank seeds for python, numpy, torch and the dropout streams."""
    if seed <= 0:
        raise ValueError(f"--seed must be > 0, got {seed}.")
    seed = seed + 100 * parallel_state.get_pipeline_model_parallel_rank()
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    model_parallel_manual_seed(seed)


def seed_for_model_init(seed: int) -> None:
    """The CPU generator model weights are drawn from: the same on every rank."""
    torch.manual_seed(seed)


def expert_sizes(config) -> tuple:
    """(EP, expert-TP) of an MoE model's TransformerConfig, (None, None) for a dense one."""
    if getattr(config, "moe", None) is None:
        return None, None
    return config.expert_model_parallel_size, config.expert_tensor_parallel_size


def initialize_megatron(tensor_model_parallel_size: int = 1,
                        pipeline_model_parallel_size: int = 1,
                        virtual_pipeline_model_parallel_size: Optional[int] = None,
                        seed: int = 1234, device_type: Optional[str] = None,
                        distributed_timeout_minutes: float = 10.0,
                        context_parallel_size: int = 1,
                        expert_model_parallel_size: Optional[int] = None,
                        expert_tensor_parallel_size: Optional[int] = None,
                        num_distributed_optimizer_instances: int = 1) -> None:
    """Join the process group, make parallel_state's groups (the expert groups too when an
    expert size is given: an MoE model) and seed."""
    if device_type not in (None, "auto"):
        device.set_device_type(device_type)
    # Before any CUDA work: CUDA reads CUDA_DEVICE_MAX_CONNECTIONS when its context starts.
    device.check_max_connections(tensor_model_parallel_size)
    initialize_distributed(device_type, distributed_timeout_minutes)
    try:
        parallel_state.check_world_size(dist.get_world_size(), tensor_model_parallel_size,
                                        pipeline_model_parallel_size, context_parallel_size)
    except RuntimeError as exc:
        raise ValueError(str(exc)) from None
    parallel_state.initialize_model_parallel(tensor_model_parallel_size,
                                             pipeline_model_parallel_size,
                                             virtual_pipeline_model_parallel_size,
                                             distributed_timeout_minutes, context_parallel_size,
                                             expert_model_parallel_size,
                                             expert_tensor_parallel_size,
                                             num_distributed_optimizer_instances)
    set_random_seeds(seed)
