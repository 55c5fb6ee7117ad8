"""One training iteration, evaluation, and building the model for this rank.

``train_step`` is Megatron's: zero the gradient buffers, run the schedule over the global
batch's microbatches (which finalizes gradients), step the optimizer, and advance the LR
schedule by the number of samples consumed, unless the step was skipped (loss-scale overflow).
"""
from collections.abc import Mapping
from typing import Callable, Dict, Iterator, List, Optional, Tuple, Union

import torch
import torch.distributed as dist

from megatron.core import device, parallel_state
from megatron.core.distributed import DistributedDataParallel, finalize_model_grads
from megatron.core.distributed.fsdp import TorchFSDP2
from megatron.core.fp8.delayed import delayed_states, step_delayed_scaling
from megatron.core.optimizer.qk_clip import QKClip
from megatron.core.pipeline_parallel import (
    PipelineTrace,
    build_model_chunks,
    get_forward_backward_func,
)
from megatron.core.pipeline_parallel.model_chunks import get_model_config
from megatron.core.tensor_parallel.random import get_rng_tracker
from megatron.training.initialize import seed_for_model_init
from megatron.training.logging.deferred import DeviceReport, resolve_reports
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


def _average_losses_of_iterations(iterations: List[List[Dict[str, torch.Tensor]]]
                                  ) -> List[Dict[str, float]]:
    """The mean of each reported value over DP, then over the microbatches (only the last
    stage has any), of each iteration's reports, with one all-reduce and one host read for
    them all.

    The arithmetic is what reducing each microbatch's value on its own gave (Megatron's
    per-microbatch average_losses_across_data_parallel_group): a float32 sum over DP divided
    by the DP size, element by element, then a float64 mean over microbatches. A stacked
    all-reduce sums each element over the same ranks, so the result is bitwise the same
    where the backend adds the ranks in the same order (always at DP <= 2)."""
    keys, stacked = _reduce_over_data_parallel(iterations)
    if stacked is None:
        return [{} for _ in iterations]
    rows = stacked.tolist()  # the one host sync
    return _means_over_microbatches(keys, [len(losses) for losses in iterations], rows)


def _reduce_over_data_parallel(iterations: List[List[Dict[str, torch.Tensor]]]
                               ) -> Tuple[List[str], Optional[torch.Tensor]]:
    """(keys, [microbatches of all iterations, keys] averaged over DP on the device), or
    (keys, None) where nothing was reported."""
    reports = [report for losses in iterations for report in losses]
    keys = list(reports[0].keys()) if reports else []
    if not keys:
        return keys, None
    stacked = torch.stack([torch.stack([r[k].detach().float().reshape(()) for k in keys])
                           for r in reports])
    dp_size = parallel_state.get_data_parallel_world_size()
    if dp_size > 1:
        dist.all_reduce(stacked, group=parallel_state.get_data_parallel_group())
        stacked = stacked / dp_size
    return keys, stacked


def _means_over_microbatches(keys: List[str], microbatches: List[int],
                             rows: List[List[float]]) -> List[Dict[str, float]]:
    rows = iter(rows)
    averaged = []
    for count in microbatches:
        mine = [next(rows) for _ in range(count)]
        averaged.append({k: float(sum(row[i] for row in mine) / len(mine))
                         for i, k in enumerate(keys)} if mine else {})
    return averaged


class LossReport(DeviceReport, Mapping):
    """One iteration's reported losses, averaged over DP on the device and not read yet: a
    read is a host sync on CUDA, so the logger reads a log interval's reports together
    (``deferred.resolve_reports``). Used as a mapping, it reads itself."""

    def __init__(self, losses_reduced: List[Dict[str, torch.Tensor]]):
        self._keys, self._rows = _reduce_over_data_parallel([losses_reduced])
        self._value = None if self._rows is not None else {}

    def pending(self) -> Optional[torch.Tensor]:
        return self._rows

    def resolve(self, numbers: List[float]) -> None:
        width = len(self._keys)
        rows = [numbers[i:i + width] for i in range(0, len(numbers), width)]
        self._value = _means_over_microbatches(self._keys, [len(rows)], rows)[0]
        self._rows = None

    def value(self) -> Dict[str, float]:
        resolve_reports([self])
        return self._value

    def __getitem__(self, key: str) -> float:
        return self.value()[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self.value())

    def __len__(self) -> int:
        return len(self.value())


def train_step(forward_step_func, data_iterator, model: List[torch.nn.Module], optimizer,
               scheduler, num_microbatches: int, seq_length: int, micro_batch_size: int,
               before_optimizer_step: Optional[Callable[[List[torch.nn.Module]], None]] = None,
               trace: Optional[PipelineTrace] = None, timers: Optional[Timers] = None,
               qk_clip: Optional[QKClip] = None
               ) -> Tuple[LossReport, bool, Optional[Union[float, torch.Tensor]],
                          Optional[int]]:
    """Returns (mean reported losses, skipped?, grad norm, zeros in grads); the losses and,
    unless the optimizer read it (the NaN check), the norm stay on the device until read.
    ``before_optimizer_step(model)`` sees the reduced gradients (fault injection in tests);
    ``trace`` records the schedule's steps (``--pipeline-trace-dir``); ``timers`` times
    Megatron's forward-backward, optimizer (level 1), forward-compute (level 2) and
    all-grads-sync (level 1: the whole finalize_model_grads). ``qk_clip`` (default: as the
    model's config says) clips W_q / W_k in the step and keeps the max logit for the log."""
    timers = timers or Timers(log_level=0)
    qk_clip = qk_clip or QKClip.for_model(model)
    if qk_clip is not None:
        qk_clip.reset()
    for chunk in model:
        chunk.zero_grad_buffer()
    optimizer.zero_grad()
    for state in delayed_states(model):
        state.begin_step()
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
    report = LossReport(losses)
    timers("optimizer", log_level=1).start()
    # QK-clip's factors (a collective over DP x CP) reach the step, applied if it is taken.
    clipping = {} if qk_clip is None else {"row_scales": qk_clip.row_scales()}
    # FP8 delayed scaling's step boundary first: the step's all-gather of FP8 weights
    # (--fp8-param-gather) casts with the histories the next forward uses.
    step_fp8_delayed_scaling(model)
    # With the NaN check the optimizer reads the norm; the losses come in the same copy.
    ok, grad_norm, num_zeros = optimizer.step(read_with_norm=report, **clipping)
    timers("optimizer").stop()
    if ok and scheduler is not None:
        scheduler.step(increment=num_microbatches * micro_batch_size *
                       parallel_state.get_data_parallel_world_size())
    return report, not ok, grad_norm, num_zeros


def step_fp8_delayed_scaling(model: List[torch.nn.Module]) -> None:
    """--fp8-recipe delayed's step boundary (fp8/delayed.py), taken or skipped step alike:
    the step's amaxes MAX-reduced over TP (a sharded operand's amax is its whole tensor's)
    and over DP x CP (every replica then holds the same histories, so the same scales: the
    replicas stay bitwise identical), then rolled into the histories."""
    states = delayed_states(model)
    if states:
        step_delayed_scaling(states, [
            parallel_state.get_tensor_model_parallel_group(),
            parallel_state.get_data_parallel_group(with_context_parallel=True)])


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
