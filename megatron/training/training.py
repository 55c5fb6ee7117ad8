"""One training iteration, evaluation, and building the model for this rank.

``train_step`` is Megatron's: zero the gradient buffers, run the schedule over the global
batch's microbatches (which finalizes gradients), step the optimizer, and advance the LR
schedule by the number of samples consumed, unless the step was skipped (loss-scale overflow).
"""
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from megatron.core import device, parallel_state
from megatron.core.distributed import DistributedDataParallel, finalize_model_grads
from megatron.core.distributed.fsdp import TorchFSDP2
from megatron.core.pipeline_parallel import (
    PipelineTrace,
    build_model_chunks,
    get_forward_backward_func,
)
from megatron.core.pipeline_parallel.model_chunks import get_model_config
from megatron.core.tensor_parallel.random import get_rng_tracker
from megatron.training.initialize import seed_for_model_init
from megatron.training.logging.timers import Timer, Timers


def build_model(model_provider: Callable[..., torch.nn.Module], config, ddp_config,
                seed: int) -> List[torch.nn.Module]:
    """This rank's model chunks, wrapped in DDP (FSDP2 for a ``TorchFSDP2Config``), with the
    schedule hooks set on ``config``.

    Weights are drawn from ``seed`` on every rank, so they do not depend on the layout; the
    generator states are restored afterwards (dropout streams stay per rank). That includes
    the device's: torch.manual_seed reseeds every CUDA generator too."""
    cpu_state, device_state = torch.get_rng_state(), device.get_rng_state()
    tracker_states = get_rng_tracker().get_states()
    try:
        seed_for_model_init(seed)
        chunks = build_model_chunks(model_provider, config)
    finally:
        # Device first: on CPU it is the CPU generator, and both saved states are equal.
        device.set_rng_state(device_state)
        torch.set_rng_state(cpu_state)
        get_rng_tracker().set_states(tracker_states)
    config.finalize_model_grads_func = finalize_model_grads
    wrapper = TorchFSDP2 if getattr(ddp_config, "use_torch_fsdp2", False) \
        else DistributedDataParallel
    return [wrapper(config, ddp_config, chunk) for chunk in chunks]


def _average_losses(losses_reduced: List[Dict[str, torch.Tensor]]) -> Dict[str, float]:
    """Mean of each reported value over DP, then over the microbatches (only the last stage
    has any): one all-reduce over DP for the whole iteration."""
    return _average_losses_of_iterations([losses_reduced])[0]


def _average_losses_of_iterations(iterations: List[List[Dict[str, torch.Tensor]]]
                                  ) -> List[Dict[str, float]]:
    """``_average_losses`` of each iteration's reports, with one all-reduce for them all.

    The arithmetic is what reducing each microbatch's value on its own gave (Megatron's
    per-microbatch average_losses_across_data_parallel_group): a float32 sum over DP divided
    by the DP size, element by element, then a float64 mean over microbatches. A stacked
    all-reduce sums each element over the same ranks, so the result is bitwise the same
    where the backend adds the ranks in the same order (always at DP <= 2)."""
    reports = [report for losses in iterations for report in losses]
    keys = list(reports[0].keys()) if reports else []
    if not keys:
        return [{} for _ in iterations]
    stacked = torch.stack([torch.stack([r[k].detach().float().reshape(()) for k in keys])
                           for r in reports])  # [microbatches of all iterations, keys]
    dp_size = parallel_state.get_data_parallel_world_size()
    if dp_size > 1:
        dist.all_reduce(stacked, group=parallel_state.get_data_parallel_group())
        stacked = stacked / dp_size
    rows = iter(stacked.tolist())  # the iteration's one host sync
    averaged = []
    for losses in iterations:
        mine = [next(rows) for _ in losses]
        averaged.append({k: float(sum(row[i] for row in mine) / len(mine))
                         for i, k in enumerate(keys)} if mine else {})
    return averaged


def train_step(forward_step_func, data_iterator, model: List[torch.nn.Module], optimizer,
               scheduler, num_microbatches: int, seq_length: int, micro_batch_size: int,
               before_optimizer_step: Optional[Callable[[List[torch.nn.Module]], None]] = None,
               trace: Optional[PipelineTrace] = None, timers: Optional[Timers] = None
               ) -> Tuple[Dict[str, float], bool, Optional[float], Optional[int]]:
    """Returns (mean reported losses, skipped?, grad norm, zeros in grads).
    ``before_optimizer_step(model)`` sees the reduced gradients (fault injection in tests);
    ``trace`` records the schedule's steps (``--pipeline-trace-dir``); ``timers`` times
    Megatron's forward-backward, optimizer (level 1), forward-compute (level 2) and
    all-grads-sync (level 1: the whole finalize_model_grads)."""
    timers = timers or Timers(log_level=0)
    for chunk in model:
        chunk.zero_grad_buffer()
    optimizer.zero_grad()
    config = get_model_config(model[0])
    finalize = config.finalize_model_grads_func
    if finalize is not None:
        config.finalize_model_grads_func = _timed(finalize, timers("all-grads-sync", 1))
    timers("forward-backward", log_level=1).start()
    try:
        losses = get_forward_backward_func()(
            forward_step_func=_timed_forward_step(forward_step_func, timers),
            data_iterator=data_iterator, model=model, num_microbatches=num_microbatches,
            seq_length=seq_length, micro_batch_size=micro_batch_size, forward_only=False,
            trace=trace)
    finally:
        timers("forward-backward").stop()
        if finalize is not None:
            config.finalize_model_grads_func = finalize
    if before_optimizer_step is not None:
        before_optimizer_step(model)
    timers("optimizer", log_level=1).start()
    ok, grad_norm, num_zeros = optimizer.step()
    timers("optimizer").stop()
    if ok and scheduler is not None:
        scheduler.step(increment=num_microbatches * micro_batch_size *
                       parallel_state.get_data_parallel_world_size())
    return _average_losses(losses), not ok, grad_norm, num_zeros


def _timed(fn: Callable, timer) -> Callable:
    def timed(*args, **kwargs):
        timer.start()
        try:
            return fn(*args, **kwargs)
        finally:
            timer.stop()
    return timed


def _timed_forward_step(forward_step_func: Callable, timers: Timers) -> Callable:
    """Megatron's forward-compute: the script's forward step and its loss function."""
    timer = timers("forward-compute", log_level=2)
    if not isinstance(timer, Timer):  # above --timing-log-level: leave the step alone
        return forward_step_func

    def forward_step(data_iterator, model):
        output, loss_func = _timed(forward_step_func, timer)(data_iterator, model)
        return output, _timed(loss_func, timer)
    return forward_step


@torch.no_grad()
def evaluate(forward_step_func, data_iterator, model: List[torch.nn.Module], eval_iters: int,
             num_microbatches: int, seq_length: int, micro_batch_size: int
             ) -> Dict[str, float]:
    """Mean of each reported loss over ``eval_iters`` global batches (last stage)."""
    for chunk in model:
        chunk.eval()
    reports = []
    try:
        for _ in range(eval_iters):
            reports.append(get_forward_backward_func()(
                forward_step_func=forward_step_func, data_iterator=data_iterator, model=model,
                num_microbatches=num_microbatches, seq_length=seq_length,
                micro_batch_size=micro_batch_size, forward_only=True))
    finally:
        for chunk in model:
            chunk.train()
    totals: Dict[str, float] = {}
    for averaged in _average_losses_of_iterations(reports):  # one all-reduce for all
        for key, value in averaged.items():
            totals[key] = totals.get(key, 0.0) + value
    return {k: v / eval_iters for k, v in totals.items()}
