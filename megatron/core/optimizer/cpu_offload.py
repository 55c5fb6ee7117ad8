"""Optimizer CPU offload (``--optimizer-cpu-offload``): the fp32 main params and the optimizer
state live in host memory and the step runs there.

Per step: the gradients are copied device -> host into fp32 host buffers made once (pinned on
CUDA, so the copies are asynchronous: one per bucket shard for the distributed optimizer,
issued back to back, then one wait); unscaling, the inf/NaN check, the global norm, clipping
and the torch step (fused CPU AdamW/SGD) run on those host tensors with the same arithmetic
as without offload; the updated main params are copied host -> device without blocking (the
next forward is ordered after them on the stream). The device keeps only the model's params
and gradients: no fp32 main params, no exp_avg / exp_avg_sq.

Checkpoints are the same named state as without offload: an fp32 model param has no separate
``"param"`` entry there (its main param is the model's), so the host copy is left out too.
"""
from typing import Callable, Dict, List

import torch
import torch.distributed as dist

from megatron.core import device
from megatron.core.optimizer.distributed_optimizer import DistributedOptimizer
from megatron.core.optimizer.optimizer import (
    Float16OptimizerWithFloat16Params,
    _model_grad,
    copy_main_to_model,
    main_param_like,
)


def _host_buffers(numels: List[int]) -> List[torch.Tensor]:
    """1-D fp32 host tensors of these sizes, views into one buffer pinned at its exact size
    (``device.pinned_host_empty``: not the caching allocator's power-of-two blocks)."""
    flat = device.pinned_host_empty(sum(numels), dtype=torch.float32)
    return list(torch.split(flat, numels)) if numels else []


def host_main_param_groups(param_groups: List[Dict]):
    """Param groups whose params are replaced by fp32 host copies (every param, fp32 ones
    too), and the map from each host main param to its model param."""
    model_of, main_groups = {}, []
    hosts = iter(_host_buffers([p.numel() for g in param_groups for p in g["params"]]))
    for group in param_groups:
        mains = []
        for param in group["params"]:
            host = next(hosts).view(param.shape)
            host.copy_(param.detach())
            main = main_param_like(host, param)
            model_of[main] = param
            mains.append(main)
        main_groups.append({**group, "params": mains})
    return main_groups, model_of


class HostStep:
    """The step's pieces that must know the main grads are on the host."""

    def _unscale_and_check_for_inf(self) -> bool:
        grads = [grad for _, grad in self._main_params_and_grads()]
        found_inf = torch.zeros(1, dtype=torch.float32)
        inv_scale = torch.tensor([self.grad_scaler.inv_scale], dtype=torch.float32)
        if grads:
            torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, inv_scale)
        found_inf = found_inf.to(device.current_device())  # the backend's device (nccl)
        dist.all_reduce(found_inf, op=dist.ReduceOp.MAX, group=self._reduction_group())
        return found_inf.item() > 0

    def _fp32_model_names(self) -> set:
        """Names of fp32 model params: their checkpoint entry has no "param" (see above)."""
        return {name for param, name in self._names.items() if param.dtype == torch.float32}


class CpuOffloadOptimizer(HostStep, Float16OptimizerWithFloat16Params):
    """The plain (replicated) optimizer with every main param an fp32 host copy."""

    def __init__(self, optimizer: torch.optim.Optimizer, config, grad_scaler,
                 model_param_of: Dict[torch.nn.Parameter, torch.nn.Parameter]):
        super().__init__(optimizer, config, grad_scaler, model_param_of)
        grads = _host_buffers([main.numel() for main in model_param_of])
        self._host_grads = {main: grad.view(main.shape)
                            for main, grad in zip(model_param_of, grads)}

    def _copy_model_grads_to_main_grads(self) -> None:
        for main, model in self._model_of.items():
            grad = _model_grad(model)
            if grad is None:
                main.grad = None
                continue
            main.grad = self._host_grads[main]
            main.grad.copy_(grad, non_blocking=True)
        device.wait_event(device.record_event())

    def _copy_main_params_to_model_params(self) -> None:
        copy_main_to_model(list(self._model_of.items()), non_blocking=True)

    def state_dict(self) -> Dict:
        state = super().state_dict()
        for name in self._fp32_model_names():
            state["params"].get(name, {}).pop("param", None)
        return state


class CpuOffloadDistributedOptimizer(HostStep, DistributedOptimizer):
    """The distributed optimizer with this rank's shard of every bucket (main params, state,
    gradients) in host memory."""

    def __init__(self, optimizer_factory: Callable, param_groups: List[Dict], config,
                 grad_scaler, model_chunks: List[torch.nn.Module]):
        super().__init__(optimizer_factory, param_groups, config, grad_scaler, model_chunks)
        new_piece = {}
        sizes = [shard.end - shard.begin for shard in self.shards]
        for shard, main, grads in zip(self.shards, _host_buffers(sizes), _host_buffers(sizes)):
            _move_shard_to_host(shard, main, grads, new_piece)
        self._model_of = {new_piece[old]: param for old, param in self._model_of.items()}
        groups = [{**group, "params": [new_piece[p] for p in torch_group["params"]]}
                  for group, torch_group in zip(param_groups, self.optimizer.param_groups)]
        self.optimizer = optimizer_factory(groups)  # nothing stepped yet: no state to keep

    def _copy_model_grads_to_main_grads(self) -> None:
        self._finish_param_gather()
        for shard in self.shards:  # one asynchronous copy per bucket shard
            shard.host_grads.copy_(shard.main_grads(), non_blocking=True)
            for piece, _, _, _, offset in shard.pieces:
                piece.grad = shard.host_grads[offset:offset + piece.numel()]
        device.wait_event(device.record_event())

    def _copy_main_params_to_model_params(self) -> None:
        copy_main_to_model([(shard.main, shard.bucket.param_data[shard.begin:shard.end])
                            for shard in self.shards], non_blocking=True)
        overlap = any(chunk.ddp_config.overlap_param_gather for chunk in self.model_chunks)
        for chunk in self.model_chunks:
            chunk.start_param_sync(async_op=overlap)

    def state_dict(self, host_tensor=None):
        state = super().state_dict(host_tensor)
        if state is not None:
            for name in self._fp32_model_names():
                state["params"].get(name, {}).pop("param", None)
        return state

    def sharded_state(self):
        parts, meta = super().sharded_state()
        fp32 = self._fp32_model_names()
        for name, _, _, values in parts:
            if name in fp32:
                values.pop("param", None)
        return parts, meta


def _move_shard_to_host(shard, main: torch.Tensor, grads: torch.Tensor,
                        new_piece: Dict) -> None:
    """Make a device shard's main values and pieces host ones (``main``, ``grads``: its host
    buffers; ``new_piece``: old piece -> new); the device fp32 copy of a bf16/fp16 shard is
    freed with the old pieces."""
    main.copy_(shard.main)
    shard.main, shard.host_grads = main, grads
    shard.in_place = False  # the model's buffer is no longer the main params: copy back
    pieces = []
    for piece, param, begin, end, offset in shard.pieces:
        host_piece = torch.nn.Parameter(shard.main[offset:offset + piece.numel()])
        new_piece[piece] = host_piece
        pieces.append((host_piece, param, begin, end, offset))
    shard.pieces = pieces


def offloaded_optimizer(config, param_groups: List[Dict], model_chunks: List[torch.nn.Module],
                        optimizer_factory: Callable, grad_scaler):
    """The optimizer for ``--optimizer-cpu-offload`` (plain or distributed)."""
    if config.sharded:
        return CpuOffloadDistributedOptimizer(optimizer_factory, param_groups, config,
                                              grad_scaler, model_chunks)
    main_groups, model_of = host_main_param_groups(param_groups)
    optimizer = CpuOffloadOptimizer(optimizer_factory(main_groups), config, grad_scaler,
                                    model_of)
    optimizer.set_param_names(model_chunks)
    return optimizer

