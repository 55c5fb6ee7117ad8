"""Megatron's optimizers: parameter groups, torch Adam/SGD, mixed precision, loss scaling,
gradient clipping, and the LR / weight-decay schedule."""
from typing import Callable, Dict, List, Optional

import torch

from megatron.core import device
from megatron.core.optimizer import muon
from megatron.core.optimizer.cpu_offload import offloaded_optimizer
from megatron.core.optimizer.distributed_optimizer import DistributedOptimizer
from megatron.core.optimizer.grad_scaler import ConstantGradScaler, DynamicGradScaler
from megatron.core.optimizer.optimizer import (
    Float16OptimizerWithFloat16Params,
    FP32Optimizer,
    MegatronOptimizer,
    fp32_main_param_groups,
)
from megatron.core.optimizer.optimizer_config import OptimizerConfig
from megatron.core.optimizer.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.pipeline_parallel.model_chunks import unwrap_model


def no_weight_decay(name: str, param: torch.nn.Parameter) -> bool:
    """Megatron's rule: biases and 1-D weights (norms) are not decayed. The stacked experts'
    bias1 / bias2 ([E, ...], Megatron's per-expert biases in one tensor) are biases too."""
    leaf = name.rsplit(".", 1)[-1]
    return leaf.rstrip("0123456789") == "bias" or param.dim() == 1


def get_param_groups(model_chunks: List[torch.nn.Module],
                     no_weight_decay_cond: Optional[Callable] = None) -> List[Dict]:
    """Two groups (weight-decayed, not), each with ``wd_mult`` / ``lr_mult`` for the
    scheduler; empty groups are dropped."""
    cond = no_weight_decay_cond or no_weight_decay
    decay, no_decay = [], []
    for chunk in model_chunks:
        for name, param in unwrap_model(chunk).named_parameters():
            if param.requires_grad:
                (no_decay if cond(name, param) else decay).append(param)
    groups = [{"params": decay, "wd_mult": 1.0, "lr_mult": 1.0},
              {"params": no_decay, "wd_mult": 0.0, "lr_mult": 1.0}]
    return [g for g in groups if g["params"]]


def _torch_optimizer(param_groups: List[Dict], config: OptimizerConfig,
                     layouts: Optional[Dict] = None,
                     dtensors: bool = False) -> torch.optim.Optimizer:
    """``layouts``: Muon's MatrixLayout per parameter (--optimizer muon). ``dtensors``: the
    parameters are FSDP2's DTensor shards."""
    groups = [{**g, "weight_decay": config.weight_decay * g["wd_mult"],
               "lr": config.lr * g["lr_mult"]} for g in param_groups]
    # One fused kernel per step where torch has one for the device (CUDA and CPU), else
    # foreach (a few multi-tensor ops). DTensor has no sharding rule for the fused SGD
    # kernel (it has one for fused AdamW): SGD over FSDP2's shards takes foreach.
    fused = device.device_type() in ("cuda", "cpu") and not (
        dtensors and config.optimizer == "sgd")
    if config.optimizer == "muon":
        return muon.MuonWithAdamW(
            groups, layouts or {}, lr=config.lr, weight_decay=config.weight_decay,
            momentum=config.muon_momentum, nesterov=config.muon_use_nesterov,
            ns_steps=config.muon_num_ns_steps, scale_mode=config.muon_scale_mode,
            extra_scale_factor=config.muon_extra_scale_factor, ns_dtype=config.muon_ns_dtype,
            adamw_kwargs=dict(betas=(config.adam_beta1, config.adam_beta2),
                              eps=config.adam_eps, fused=fused))
    if config.optimizer == "adam":
        return torch.optim.AdamW(groups, lr=config.lr, betas=(config.adam_beta1,
                                 config.adam_beta2), eps=config.adam_eps,
                                 weight_decay=config.weight_decay, fused=fused)
    return torch.optim.SGD(groups, lr=config.lr, momentum=config.sgd_momentum,
                           weight_decay=config.weight_decay, fused=fused)


def _grad_scaler(config: OptimizerConfig):
    if config.loss_scale is not None:
        return ConstantGradScaler(config.loss_scale)
    if config.fp16:  # bf16's range needs no scaling (Megatron's default)
        return DynamicGradScaler(config.initial_loss_scale, config.min_loss_scale,
                                 growth_interval=int(config.loss_scale_window),
                                 hysteresis=config.hysteresis)
    return None


def get_megatron_optimizer(config: OptimizerConfig, model_chunks: List[torch.nn.Module],
                           no_weight_decay_cond: Optional[Callable] = None
                           ) -> MegatronOptimizer:
    """The optimizer for this rank's model chunks (wrapped in DDP or not)."""
    groups = get_param_groups(model_chunks, no_weight_decay_cond)
    layouts = None  # Muon's MatrixLayout per parameter
    if config.optimizer == "muon":  # its matrices in groups apart from AdamW's (muon.py)
        names = {p: name for chunk in model_chunks
                 for name, p in unwrap_model(chunk).named_parameters()}
        groups = muon.muon_param_groups(groups, names)
        layouts = muon.matrix_layouts(model_chunks, config.muon_split_qkv)
    from megatron.core.distributed import fsdp  # here: fsdp imports this package
    if fsdp.is_fsdp2(model_chunks):  # fp32 shards are the main params
        if layouts is not None:  # (the overlapped optimizer and offload: OptimizerConfig)
            raise ValueError("--optimizer muon with --use-torch-fsdp2 is not built (Muon "
                             "orthogonalizes whole matrices, FSDP2 holds DP shards of them).")
        if any(chunk.ddp_config.cpu_offload != config.optimizer_cpu_offload
               for chunk in model_chunks):
            raise ValueError("optimizer_cpu_offload and the FSDP2 config's cpu_offload must "
                             "agree (the shards are where FSDP2 keeps them).")
        kind = fsdp.FSDP2HostOptimizer if config.optimizer_cpu_offload else fsdp.FSDP2Optimizer
        optimizer = kind(_torch_optimizer(groups, config, dtensors=True), config,
                         _grad_scaler(config))
        optimizer.set_param_names(model_chunks)
        return optimizer
    if config.optimizer_cpu_offload:  # main params and state on the host
        return offloaded_optimizer(config, groups, model_chunks,
                                   lambda g: _torch_optimizer(g, config), _grad_scaler(config))
    if config.sharded:
        optimizer = DistributedOptimizer(lambda g: _torch_optimizer(g, config, layouts),
                                         groups, config, _grad_scaler(config), model_chunks)
        if layouts is not None:  # each matrix's owner rank orthogonalizes it
            optimizer.optimizer.shard_matrices(optimizer.shards, [
                p for g in groups if g["use_muon"] for p in g["params"]])
        return optimizer
    if config.fp16 or config.bf16:
        main_groups, model_of = fp32_main_param_groups(groups)
        main_layouts = None if layouts is None else \
            {main: layouts[param] for main, param in model_of.items()}
        optimizer = Float16OptimizerWithFloat16Params(
            _torch_optimizer(main_groups, config, main_layouts), config, _grad_scaler(config),
            model_of)
    else:
        optimizer = FP32Optimizer(_torch_optimizer(groups, config, layouts), config,
                                  _grad_scaler(config))
    optimizer.set_param_names(model_chunks)
    return optimizer
