"""``save_checkpoint``: every rank's part of one checkpoint, written atomically.

Data-parallel rank 0 of each (TP, PP) position writes ``model_optim_rng.pt`` (model chunks,
plain optimizer state, LR schedule, the RNG states of all its DP replicas, iteration, consumed
samples, args, layout) and, with the distributed optimizer, ``distrib_optim.pt`` (gathered
from all DP ranks, independent of the DP size). See paths.py for the directory protocol.
"""
import os
import shutil
from typing import Dict, List

import torch
import torch.distributed as dist

from megatron.core import device, parallel_state
from megatron.core.distributed.distributed_data_parallel import params_current_everywhere
from megatron.core.fp8.delayed import CHECKPOINT_KEY, capture_histories
from megatron.core.pipeline_parallel.model_chunks import unwrap_model
from megatron.training.checkpointing.disk_space import space_for_save, tree_nbytes
from megatron.training.checkpointing.expert_files import (
    EXPERT_FILE,
    expert_dir_name,
    expert_file_state,
    has_experts,
    without_experts,
)
from megatron.training.checkpointing.experts import expert_data_parallel
from megatron.training.checkpointing.layout import current_layout, model_key
from megatron.training.checkpointing.paths import (
    previous_checkpoint_note,
    MODEL_FILE,
    OPTIMIZER_FILE,
    STAGING_SUFFIX,
    iteration_dir_name,
    publish,
    rank_dir_name,
    remove_stale_staging,
)
from megatron.training.checkpointing.rng_state import capture_rng_state
from megatron.training.checkpointing.safe_io import plain_data, save_or_report_disk_full
from megatron.training.checkpointing.sharded_save import save_sharded
from megatron.training.checkpointing.writer import CheckpointWriter

CHECKPOINT_VERSION = 3.0


def _map_tensors(tree, fn):
    if torch.is_tensor(tree):
        return fn(tree)
    if isinstance(tree, dict):
        return {k: _map_tensors(v, fn) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(_map_tensors(v, fn) for v in tree)
    return tree


def _gather_rng_states() -> List[Dict]:
    states = [None] * parallel_state.get_data_parallel_world_size(with_context_parallel=True)
    dist.all_gather_object(states, capture_rng_state(),
                           group=parallel_state.get_data_parallel_group(with_context_parallel=True))
    return states


def save_checkpoint(root: str, iteration: int, model_chunks, optimizer, scheduler, configs,
                    args: Dict, consumed_train_samples: int, consumed_valid_samples: int,
                    writer: CheckpointWriter) -> None:
    """Collective: every rank calls it. Returns once the state is captured (async) or saved."""
    t = configs.training
    if t.ckpt_format == "torch_dist":
        return save_sharded(root, iteration, model_chunks, optimizer, scheduler, configs, args,
                            consumed_train_samples, consumed_valid_samples, writer)
    writer.wait()  # one save at a time: the previous one is published first
    # --overlap-param-gather: the step's all-gathers may still be writing the parameters this
    # save reads; --fp8-param-gather: their high-precision copies are gathered first.
    params_current_everywhere(model_chunks)
    # The background write needs a copy that training will not change, in host memory: the
    # writer's reused host buffers, filled without blocking (the writer waits for them).
    host = writer.host if writer.async_save else None
    if host is not None:
        host.start()
        snapshot = host.snapshot
    else:
        snapshot = lambda tree, name: _map_tensors(tree, lambda x: x.detach())
    dp_root = parallel_state.get_data_parallel_rank(with_context_parallel=True) == 0
    moe = has_experts(model_chunks)
    expert_root = moe and expert_data_parallel()[0] == 0
    optimizer_state = None
    if not t.no_save_optim and (configs.optimizer.sharded or dp_root or expert_root):
        if configs.optimizer.sharded and host is not None:  # gathers straight into them
            state = optimizer.state_dict(host_tensor=lambda name, key, shape: host.tensor(
                f"optimizer/params/{name}/{key}", shape, torch.float32))
        else:
            state = optimizer.state_dict()  # distributed: gathers to DP rank 0
        optimizer_state = snapshot(state, "optimizer")
    rng_states = None if t.no_save_rng else snapshot(_gather_rng_states(), "rng_state")

    staging = os.path.join(root, iteration_dir_name(iteration) + STAGING_SUFFIX)
    if dist.get_rank() == 0:
        os.makedirs(root, exist_ok=True)
        remove_stale_staging(root)
        os.makedirs(staging)
    dist.barrier()

    files = []
    layout = current_layout(model_chunks, configs)
    model_states = [unwrap_model(chunk).state_dict() for chunk in model_chunks]
    if expert_root:  # its experts, by layout-free name (see expert_files.py)
        experts = expert_file_state(model_states, optimizer_state, layout["layer_ranges"],
                                    layout)
        files.append((os.path.join(staging, expert_dir_name(), EXPERT_FILE),
                      snapshot(experts, "experts") if host is not None else experts))
    if dp_root:
        if moe:
            model_states = [without_experts(m, None)[0] for m in model_states]
            optimizer_state = without_experts({}, optimizer_state)[1]
        state = {"checkpoint_version": CHECKPOINT_VERSION, "iteration": iteration,
                 "args": plain_data(args), "layout": layout,
                 "consumed_train_samples": consumed_train_samples,
                 "consumed_valid_samples": consumed_valid_samples}
        vpp = parallel_state.get_virtual_pipeline_model_parallel_world_size()
        for c, model_state in enumerate(model_states):
            key = model_key(c, vpp)
            state[key] = snapshot(model_state, key)
        if optimizer_state is not None:
            state["opt_param_scheduler"] = scheduler.state_dict()
            if not configs.optimizer.sharded:
                state["optimizer"] = optimizer_state
        if rng_states is not None:
            state["rng_state"] = rng_states
        histories = capture_histories(model_chunks)  # the same on every TP and DP rank
        if histories is not None:
            state[CHECKPOINT_KEY] = histories
        rank_dir = os.path.join(staging, rank_dir_name(
            parallel_state.get_tensor_model_parallel_rank(),
            parallel_state.get_pipeline_model_parallel_rank(),
            parallel_state.get_pipeline_model_parallel_world_size()))
        files.append((os.path.join(rank_dir, MODEL_FILE), state))
        if configs.optimizer.sharded and optimizer_state is not None:
            files.append((os.path.join(rank_dir, OPTIMIZER_FILE), optimizer_state))

    space = space_for_save(root, sum(tree_nbytes(obj) for _, obj in files))

    def write():
        for path, obj in files:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            save_or_report_disk_full(obj, path, staging, space, iteration)

    def finalize():
        if dist.get_rank() == 0:
            publish(root, staging, iteration_dir_name(iteration), iteration)

    def abort():  # a rank's write failed: remove what every rank wrote (it is never published)
        if dist.get_rank() == 0:
            shutil.rmtree(staging, ignore_errors=True)

    writer.submit(write, finalize, ready=device.record_event(), abort=abort,
                  previous=lambda: previous_checkpoint_note(root))
