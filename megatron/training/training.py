"""One training iteration, evaluation, and building the model for this rank.

``train_step`` is Megatron's: zero the gradient buffers, run the schedule over the global
batch's microbatches (which finalizes gradients), step the optimizer, and advance the LR
schedule by the number of samples consumed, unless the step was skipped (loss-scale overflow).
"""
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallel, finalize_model_grads
from megatron.core.pipeline_parallel import (
    PipelineTrace,
    build_model_chunks,
    get_forward_backward_func,
)
from megatron.training.initialize import seed_for_model_init


def build_model(model_provider: Callable[..., torch.nn.Module], config, ddp_config,
                seed: int) -> List[torch.nn.Module]:
    """This rank's model chunks, wrapped in DDP, with the schedule hooks set on ``config``.

    Weights are drawn from ``seed`` on every rank, so they do not depend on the layout; the
    generator state is restored afterwards (dropout streams stay per rank)."""
    state = torch.get_rng_state()
    seed_for_model_init(seed)
    chunks = build_model_chunks(model_provider, config)
    torch.set_rng_state(state)
    config.finalize_model_grads_func = finalize_model_grads
    return [DistributedDataParallel(config, ddp_config, chunk) for chunk in chunks]


def _average_losses(losses_reduced: List[Dict[str, torch.Tensor]]) -> Dict[str, float]:
    """Mean of each reported value over the microbatches (only the last stage has any)."""
    if not losses_reduced:
        return {}
    keys = losses_reduced[0].keys()
    return {k: float(sum(float(x[k]) for x in losses_reduced) / len(losses_reduced))
            for k in keys}


def train_step(forward_step_func, data_iterator, model: List[torch.nn.Module], optimizer,
               scheduler, num_microbatches: int, seq_length: int, micro_batch_size: int,
               before_optimizer_step: Optional[Callable[[List[torch.nn.Module]], None]] = None,
               trace: Optional[PipelineTrace] = None
               ) -> Tuple[Dict[str, float], bool, Optional[float], Optional[int]]:
    """Returns (mean reported losses, skipped?, grad norm, zeros in grads).
    ``before_optimizer_step(model)`` sees the reduced gradients (fault injection in tests);
    ``trace`` records the schedule's steps (``--pipeline-trace-dir``)."""
    for chunk in model:
        chunk.zero_grad_buffer()
    optimizer.zero_grad()
    losses = get_forward_backward_func()(
        forward_step_func=forward_step_func, data_iterator=data_iterator, model=model,
        num_microbatches=num_microbatches, seq_length=seq_length,
        micro_batch_size=micro_batch_size, forward_only=False, trace=trace)
    if before_optimizer_step is not None:
        before_optimizer_step(model)
    ok, grad_norm, num_zeros = optimizer.step()
    if ok and scheduler is not None:
        scheduler.step(increment=num_microbatches * micro_batch_size *
                       parallel_state.get_data_parallel_world_size())
    return _average_losses(losses), not ok, grad_norm, num_zeros


@torch.no_grad()
def evaluate(forward_step_func, data_iterator, model: List[torch.nn.Module], eval_iters: int,
             num_microbatches: int, seq_length: int, micro_batch_size: int
             ) -> Dict[str, float]:
    """Mean of each reported loss over ``eval_iters`` global batches (last stage)."""
    for chunk in model:
        chunk.eval()
    totals: Dict[str, float] = {}
    try:
        for _ in range(eval_iters):
            losses = get_forward_backward_func()(
                forward_step_func=forward_step_func, data_iterator=data_iterator, model=model,
                num_microbatches=num_microbatches, seq_length=seq_length,
                micro_batch_size=micro_batch_size, forward_only=True)
            for key, value in _average_losses(losses).items():
                totals[key] = totals.get(key, 0.0) + value
    finally:
        for chunk in model:
            chunk.train()
    return {k: v / eval_iters for k, v in totals.items()}


def average_across_data_parallel(values: List[torch.Tensor]) -> torch.Tensor:
    """The reported loss averaged over DP ranks (what Megatron logs)."""
    stacked = torch.stack([v.detach().float().reshape(()) for v in values])
    dist.all_reduce(stacked, group=parallel_state.get_data_parallel_group())
    return stacked / parallel_state.get_data_parallel_world_size()
