"""Forward and backward over a global batch of microbatches: Megatron's schedules.

    forward_backward = get_forward_backward_func()
    losses = forward_backward(forward_step_func=..., data_iterator=..., model=chunks,
                              num_microbatches=8, seq_length=2048, micro_batch_size=1)

``forward_step_func(data_iterator, model)`` returns ``(output, loss_func)``; on the last stage
``loss_func(output)`` returns ``(loss, dict_to_report)``. The loss is divided by the number of
microbatches before backward, so gradients accumulate to the global-batch mean. The functions
return the per-microbatch dicts on the last stage and an empty list elsewhere.

The pipelined schedules execute the plan of ``simulate.communication_plan`` (itself built from
``schedule_order``): before each unit of steps, one batch of sends and receives. DDP gradient
sync is held (``no_sync``) until each model chunk's last backward.
"""
import contextlib
from collections import deque
from typing import Callable, Dict, List, Optional

import torch
from torch.autograd.variable import Variable

from megatron.core import parallel_state
from megatron.core.pipeline_parallel import p2p_communication as p2p
from megatron.core.pipeline_parallel.model_chunks import get_model_config, unwrap_model
from megatron.core.pipeline_parallel.schedule_order import (
    BACKWARD,
    FORWARD,
    WEIGHT,
    ZERO_BUBBLE,
    check_schedule_settings,
)
from megatron.core.pipeline_parallel.simulate import (
    ACTIVATION,
    GRADIENT,
    communication_plan,
    is_first_stage,
    is_last_stage,
    step_messages,
)
from megatron.core.pipeline_parallel.trace import BACKWARD as TRACE_BACKWARD
from megatron.core.pipeline_parallel.trace import FORWARD as TRACE_FORWARD
from megatron.core.pipeline_parallel.trace import WAIT, PipelineTrace
from megatron.core.pipeline_parallel.trace import WEIGHT as TRACE_WEIGHT
from megatron.core.tensor_parallel.weight_grad_store import (
    WeightGradStore,
    deferring_weight_grads,
)
from megatron.core.transformer.moe.moe_layer import set_aux_loss_scale


def get_forward_backward_func() -> Callable:
    if parallel_state.get_pipeline_model_parallel_world_size() > 1:
        if parallel_state.get_virtual_pipeline_model_parallel_world_size() is not None:
            return forward_backward_pipelining_with_interleaving
        return forward_backward_pipelining_without_interleaving
    return forward_backward_no_pipelining


# --- one step ---------------------------------------------------------------------------------

def forward_step(forward_step_func, data_iterator, model, num_microbatches: int,
                 input_tensor: Optional[torch.Tensor], forward_data_store: List, config,
                 is_last_stage: bool, collect_non_loss_data: bool = False) -> torch.Tensor:
    """Run one microbatch through one model chunk; on the last stage turn it into the loss."""
    # The MoE and multi-token-prediction losses' share of the gradient
    if getattr(config, "moe", None) is not None or getattr(config, "mtp_num_layers", None):
        scale = 1.0 if config.grad_scale_func is None else \
            float(config.grad_scale_func(torch.ones(1)))
        # x CP like the main loss (gpt_step.loss_func): DDP averages over DP x CP, while the
        # CP ranks' loss shares must add up.
        cp = getattr(config, "context_parallel_size", 1)
        set_aux_loss_scale(scale * cp / num_microbatches)
    unwrap_model(model).set_input_tensor(input_tensor)
    output, loss_func = forward_step_func(data_iterator, model)
    if not is_last_stage:
        return output
    if collect_non_loss_data:
        forward_data_store.append(loss_func(output, non_loss_data=True))
        return output
    result = loss_func(output)
    if not (isinstance(result, tuple) and len(result) == 2):
        raise TypeError("loss_func must return (loss, dict of values to report); got "
                        f"{type(result).__name__}.")
    loss, reported = result
    forward_data_store.append(reported)
    return loss / num_microbatches


def backward_step(input_tensor: Optional[torch.Tensor], output_tensor: torch.Tensor,
                  output_tensor_grad: Optional[torch.Tensor], config) -> Optional[torch.Tensor]:
    """Backward through one chunk; returns the gradient for the previous stage."""
    if output_tensor_grad is None:  # the loss, on the last stage
        if config.grad_scale_func is not None:
            output_tensor = config.grad_scale_func(output_tensor)
        torch.autograd.backward(output_tensor)
    elif output_tensor.numel() != output_tensor_grad.numel():
        # The output's data was freed once sent; autograd only needs its graph. The public
        # backward() would compare shapes, so call the engine directly (as Megatron does).
        Variable._execution_engine.run_backward(
            (output_tensor,), (output_tensor_grad,), False, False, (), True, True)
    else:
        torch.autograd.backward(output_tensor, grad_tensors=output_tensor_grad)
    return input_tensor.grad if input_tensor is not None else None


def deallocate_output(output: torch.Tensor) -> None:
    """Free a sent activation's data, keeping the tensor (and its autograd graph)."""
    if output is not None and output._base is None:
        output.data = torch.empty((1,), device=output.device, dtype=output.dtype)


# --- gradient sync --------------------------------------------------------------------------

class GradSyncHold:
    """Holds DDP gradient sync on every chunk until ``release(chunk)`` (its last backward)."""

    def __init__(self, chunks: List[torch.nn.Module], config, hold: bool):
        self._contexts: Dict[int, contextlib.AbstractContextManager] = {}
        self._factories = None
        if not hold:
            return
        factories = config.no_sync_func
        self._factories = []
        for i, chunk in enumerate(chunks):
            if isinstance(factories, (list, tuple)):
                factory = factories[i]
            else:
                factory = factories or getattr(chunk, "no_sync", None)
            self._factories.append(factory)
            if factory is not None:
                context = factory()
                context.__enter__()
                self._contexts[i] = context

    def release(self, chunk: int) -> None:
        context = self._contexts.pop(chunk, None)
        if context is not None:
            context.__exit__(None, None, None)

    def release_all(self) -> None:
        for chunk in list(self._contexts):
            self.release(chunk)

    @contextlib.contextmanager
    def sync_paused(self, chunk: int, paused: bool):
        """Hold the chunk's sync again for one step after its release: a zero-bubble
        schedule runs earlier microbatches' W after the chunk's last B, and only the last W
        (each weight's final gradient) may mark parameters ready."""
        released = self._factories is not None and chunk not in self._contexts
        if not (paused and released and self._factories[chunk] is not None):
            yield
            return
        with self._factories[chunk]():
            yield


def _span(trace: Optional[PipelineTrace], kind: str, microbatch=None, chunk=None):
    return trace.span(kind, microbatch, chunk) if trace is not None else contextlib.nullcontext()


def _finish(chunks, config, forward_only: bool) -> None:
    if not forward_only and config.finalize_model_grads_func is not None:
        config.finalize_model_grads_func(chunks)


# --- the schedules ----------------------------------------------------------------------------

def forward_backward_no_pipelining(*, forward_step_func, data_iterator, model,
                                   num_microbatches: int, seq_length: Optional[int] = None,
                                   micro_batch_size: Optional[int] = None,
                                   decoder_seq_length=None, forward_only: bool = False,
                                   collect_non_loss_data: bool = False, first_val_step=None,
                                   trace: Optional[PipelineTrace] = None) -> List:
    """Gradient accumulation on one stage: forward and backward each microbatch in turn."""
    chunks = model if isinstance(model, list) else [model]
    if len(chunks) != 1:
        raise ValueError("forward_backward_no_pipelining takes one model chunk; virtual "
                         "pipeline stages need pipeline-model-parallel size >= 2.")
    model = chunks[0]
    if isinstance(data_iterator, list):
        data_iterator = data_iterator[0]
    config = get_model_config(model)
    check_schedule_settings(1, num_microbatches)
    hold = GradSyncHold(chunks, config, hold=not forward_only)
    store = []
    try:
        for microbatch in range(num_microbatches):
            if microbatch == num_microbatches - 1:
                hold.release(0)  # the last microbatch reduces gradients (forward included)
            with _span(trace, TRACE_FORWARD, microbatch, 0):
                output = forward_step(forward_step_func, data_iterator, model,
                                      num_microbatches, None, store, config, True,
                                      collect_non_loss_data)
            if not forward_only:
                with _span(trace, TRACE_BACKWARD, microbatch, 0):
                    backward_step(None, output, None, config)
    finally:
        hold.release_all()
    _finish(chunks, config, forward_only)
    return store


def forward_backward_pipelining_without_interleaving(**kwargs) -> List:
    """1F1B: warmup forwards, then one forward and one backward alternating, then cooldown."""
    chunks = kwargs["model"] if isinstance(kwargs["model"], list) else [kwargs["model"]]
    if len(chunks) != 1:
        raise ValueError(f"the 1F1B schedule takes one model chunk, got {len(chunks)}; "
                         f"initialise parallel_state with virtual stages to interleave.")
    return _run_pipeline(**kwargs)


def forward_backward_pipelining_with_interleaving(**kwargs) -> List:
    """Interleaved 1F1B over virtual stages: each rank holds several model chunks."""
    virtual_size = parallel_state.get_virtual_pipeline_model_parallel_world_size()
    chunks = kwargs["model"] if isinstance(kwargs["model"], list) else [kwargs["model"]]
    if virtual_size is None or len(chunks) != virtual_size:
        raise ValueError(f"the interleaved schedule needs one model chunk per virtual stage "
                         f"({virtual_size}), got {len(chunks)}.")
    return _run_pipeline(**kwargs)


def activation_shape(config, seq_length: int, micro_batch_size: int):
    """[sequence, micro batch, hidden] as sent between stages (sequence split over CP, and
    again over TP under SP)."""
    seq_length //= config.context_parallel_size
    if config.sequence_parallel:
        seq_length //= parallel_state.get_tensor_model_parallel_world_size()
    return (seq_length, micro_batch_size, config.hidden_size)


def _run_pipeline(*, forward_step_func, data_iterator, model, num_microbatches: int,
                  seq_length: Optional[int] = None, micro_batch_size: Optional[int] = None,
                  decoder_seq_length=None, forward_only: bool = False,
                  collect_non_loss_data: bool = False, first_val_step=None,
                  trace: Optional[PipelineTrace] = None) -> List:
    chunks = model if isinstance(model, list) else [model]
    config = get_model_config(chunks[0])
    pipeline_size = parallel_state.get_pipeline_model_parallel_world_size()
    rank = parallel_state.get_pipeline_model_parallel_rank()
    virtual_size = parallel_state.get_virtual_pipeline_model_parallel_world_size()
    schedule = getattr(config, "pipeline_schedule", None)
    check_schedule_settings(pipeline_size, num_microbatches, virtual_size, schedule)
    if not config.variable_seq_lengths and (seq_length is None or micro_batch_size is None):
        raise ValueError("seq_length and micro_batch_size are needed to size the tensors "
                         "between stages (or set config.variable_seq_lengths).")
    if isinstance(data_iterator, list):
        iterators = data_iterator
    elif len(chunks) > 1 and data_iterator is not None:
        # Chunks sharing one iterator would each take a different microbatch from it.
        raise ValueError("the interleaved schedule needs a list of data iterators, one per "
                         "model chunk, each yielding the same microbatches.")
    else:
        iterators = [data_iterator] * len(chunks)
    if len(iterators) != len(chunks):
        raise ValueError(f"{len(iterators)} data iterators for {len(chunks)} model chunks.")
    shape = None if config.variable_seq_lengths \
        else activation_shape(config, seq_length, micro_batch_size)
    plan = communication_plan(pipeline_size, rank, num_microbatches, virtual_size, forward_only,
                              schedule)
    last_step = {}  # (chunk, kind) -> microbatch of the chunk's last step of that kind
    for _, unit in plan:
        for step in unit:
            last_step[(step.chunk, step.kind)] = step.microbatch

    received, outgoing, local = {}, {}, {}  # Message / (kind, microbatch) -> tensor
    saved = [deque() for _ in chunks]  # (microbatch, input, output) awaiting backward
    deferred = {}  # (chunk, microbatch) -> WeightGradStore of its B, awaiting its W
    store: List = []
    hold = GradSyncHold(chunks, config, hold=not forward_only)
    try:
        for ops, unit in plan:
            if ops:
                with _span(trace, WAIT):
                    _exchange(ops, received, outgoing, shape, config)
            for step in unit:
                if virtual_size is not None:
                    parallel_state.set_virtual_pipeline_model_parallel_rank(step.chunk)
                recv, send = step_messages(step, pipeline_size, rank, virtual_size, schedule)
                first = is_first_stage(step, pipeline_size, rank, schedule)
                last = is_last_stage(step, pipeline_size, rank, virtual_size, schedule)
                if step.kind == FORWARD:
                    with _span(trace, TRACE_FORWARD, step.microbatch, step.chunk):
                        input_tensor = _incoming(recv, first, ACTIVATION, step, received, local)
                        output = forward_step(
                            forward_step_func, iterators[step.chunk], chunks[step.chunk],
                            num_microbatches, input_tensor, store, config, last,
                            collect_non_loss_data)
                    _outgoing(send, last, ACTIVATION, step, output, outgoing, local)
                    if not forward_only:
                        saved[step.chunk].append((step.microbatch, input_tensor, output))
                elif step.kind == BACKWARD:
                    microbatch, input_tensor, output = saved[step.chunk].popleft()
                    assert microbatch == step.microbatch, "backward out of microbatch order"
                    if last_step[(step.chunk, BACKWARD)] == microbatch:
                        hold.release(step.chunk)
                    weight_grads = WeightGradStore() if schedule in ZERO_BUBBLE else None
                    with _span(trace, TRACE_BACKWARD, step.microbatch, step.chunk), \
                            deferring_weight_grads(weight_grads):
                        grad_in = backward_step(
                            input_tensor, output,
                            _incoming(recv, last, GRADIENT, step, received, local), config)
                    if weight_grads is not None:
                        deferred[(step.chunk, step.microbatch)] = weight_grads
                    _outgoing(send, first, GRADIENT, step, grad_in, outgoing, local)
                else:
                    final = last_step[(step.chunk, WEIGHT)] == step.microbatch
                    with _span(trace, TRACE_WEIGHT, step.microbatch, step.chunk), \
                            hold.sync_paused(step.chunk, paused=not final):
                        deferred.pop((step.chunk, step.microbatch)).flush()
    finally:
        hold.release_all()
        if virtual_size is not None:
            parallel_state.set_virtual_pipeline_model_parallel_rank(0)
    assert not received and not outgoing and not local and not deferred, \
        "schedule left messages or weight gradients unused"
    _finish(chunks, config, forward_only)
    return store


def _incoming(recv, end_of_pipeline: bool, kind: str, step, received, local):
    """The step's input (activation, or output gradient): received, handed over by this
    rank's other chunk (the V's turn), or None at the pipeline's end (first stage's forward,
    last stage's backward)."""
    if recv is not None:
        return received.pop(recv.message)
    if end_of_pipeline:
        return None
    handed = local.pop((kind, step.microbatch))
    if kind == ACTIVATION:  # a leaf of this chunk's graph, as a received activation is
        return handed.detach().requires_grad_()
    return handed


def _outgoing(send, end_of_pipeline: bool, kind: str, step, tensor, outgoing, local) -> None:
    """Queue the step's result for its round, or hand it to this rank's other chunk."""
    if send is not None:
        outgoing[send.message] = tensor
    elif not end_of_pipeline:
        local[(kind, step.microbatch)] = tensor


def _exchange(ops, received, outgoing, shape, config) -> None:
    """One communication round: post its sends and receives together (in the plan's order,
    which both ends of each pair of ranks share), then free the data of the activations just
    sent (only their autograd graph is needed from now on)."""
    batch = [(op.send, op.peer, outgoing.pop(op.message) if op.send else None,
              op.message.kind == ACTIVATION) for op in ops]
    tensors = p2p.exchange_batch(batch, shape, config)
    for op, tensor in zip(ops, tensors):
        if not op.send:
            received[op.message] = tensor
    if config.deallocate_pipeline_outputs:
        for (send, _, tensor, activation) in batch:
            if send and activation:
                deallocate_output(tensor)
