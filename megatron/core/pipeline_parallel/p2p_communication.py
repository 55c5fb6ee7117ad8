"""Point-to-point communication between neighbouring pipeline stages.

Every call posts all its sends and receives as one batch (``batch_isend_irecv``) and waits for
the whole batch, so a stage that sends forward and receives backward at once cannot deadlock
with its neighbour doing the opposite. Within a batch, activation traffic (to the next stage,
from the previous) is posted before gradient traffic (to the previous, from the next): with
two pipeline ranks both directions share one pair of ranks, and this order makes both sides
match messages the same way on gloo and nccl.

Tensor shapes are known from the config ([seq / TP under sequence parallelism, micro batch,
hidden]) or, with ``config.variable_seq_lengths``, sent ahead of each tensor.
"""
from typing import List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from megatron.core import device, parallel_state

Shape = Sequence[int]


def _dtype(config) -> torch.dtype:
    return config.pipeline_dtype or config.params_dtype


def _post_and_wait(ops: List[dist.P2POp]) -> None:
    if ops:
        for request in dist.batch_isend_irecv(ops):
            request.wait()


def _exchange_shapes(send_next, send_prev, recv_prev: bool, recv_next: bool):
    """Send our tensors' shapes ahead of them; receive the shapes we are about to get."""
    group = parallel_state.get_pipeline_model_parallel_group()
    nxt = parallel_state.get_pipeline_model_parallel_next_rank()
    prev = parallel_state.get_pipeline_model_parallel_prev_rank()

    def shape_of(t):
        if t.dim() != 3:
            raise ValueError(f"pipeline tensors are [sequence, micro batch, hidden]; got shape "
                             f"{tuple(t.shape)} to send.")
        return device.tensor(list(t.shape), dtype=torch.int64)

    recv_prev_shape = device.empty(3, dtype=torch.int64) if recv_prev else None
    recv_next_shape = device.empty(3, dtype=torch.int64) if recv_next else None
    ops = []
    if send_next is not None:
        ops.append(dist.P2POp(dist.isend, shape_of(send_next), nxt, group))
    if recv_prev_shape is not None:
        ops.append(dist.P2POp(dist.irecv, recv_prev_shape, prev, group))
    if send_prev is not None:
        ops.append(dist.P2POp(dist.isend, shape_of(send_prev), prev, group))
    if recv_next_shape is not None:
        ops.append(dist.P2POp(dist.irecv, recv_next_shape, nxt, group))
    _post_and_wait(ops)
    return (tuple(recv_prev_shape.tolist()) if recv_prev else None,
            tuple(recv_next_shape.tolist()) if recv_next else None)


def communicate(tensor_send_next: Optional[torch.Tensor],
                tensor_send_prev: Optional[torch.Tensor], recv_prev: bool, recv_next: bool,
                tensor_shape: Optional[Shape], config
                ) -> Tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    """Send to / receive from the neighbouring stages in one batch; returns
    (tensor received from the previous stage, tensor received from the next stage)."""
    if parallel_state.get_pipeline_model_parallel_world_size() == 1:
        if recv_prev or recv_next:
            raise RuntimeError("nothing to receive from: the pipeline has one stage.")
        return None, None
    prev_shape = next_shape = tensor_shape
    if config.variable_seq_lengths:
        prev_shape, next_shape = _exchange_shapes(tensor_send_next, tensor_send_prev,
                                                  recv_prev, recv_next)
    elif (recv_prev or recv_next) and tensor_shape is None:
        raise ValueError("tensor_shape is needed to receive unless "
                         "config.variable_seq_lengths is set.")

    dtype = _dtype(config)
    # Received activations are leaves of this stage's autograd graph: their .grad is what
    # goes back to the previous stage.
    from_prev = device.empty(*prev_shape, dtype=dtype, requires_grad=True) if recv_prev \
        else None
    from_next = device.empty(*next_shape, dtype=dtype) if recv_next else None

    group = parallel_state.get_pipeline_model_parallel_group()
    nxt = parallel_state.get_pipeline_model_parallel_next_rank()
    prev = parallel_state.get_pipeline_model_parallel_prev_rank()
    ops = []  # activations first, then gradients (see the module docstring)
    if tensor_send_next is not None:
        ops.append(dist.P2POp(dist.isend, tensor_send_next, nxt, group))
    if from_prev is not None:
        ops.append(dist.P2POp(dist.irecv, from_prev, prev, group))
    if tensor_send_prev is not None:
        ops.append(dist.P2POp(dist.isend, tensor_send_prev, prev, group))
    if from_next is not None:
        ops.append(dist.P2POp(dist.irecv, from_next, nxt, group))
    _post_and_wait(ops)
    return from_prev, from_next


def exchange_batch(ops: List[Tuple[bool, int, Optional[torch.Tensor], bool]],
                   tensor_shape: Optional[Shape], config) -> List[Optional[torch.Tensor]]:
    """Post one batch of sends and receives with any pipeline peers, in the given order, and
    wait for all of it. ``ops``: (send?, peer's pipeline rank, the tensor to send or None,
    activation?); returns, in the same order, the received tensors (None for sends). Received
    activations are leaves of this stage's autograd graph (``requires_grad``: their .grad
    goes back to the stage that sent them); received gradients are plain tensors. Both ends
    of a pair of ranks must post their ops to each other in the same order (the schedules'
    plans guarantee it).

    ``communicate`` is this with the neighbours of a loop of stages; the V-shaped schedules
    send activations to the previous rank too, and may send several tensors in one round."""
    group = parallel_state.get_pipeline_model_parallel_group()
    global_rank = parallel_state.get_pipeline_model_parallel_ranks()
    shapes = [tensor_shape] * len(ops)
    if config.variable_seq_lengths:
        shapes = _exchange_batch_shapes(ops, group, global_rank)
    elif any(not op[0] for op in ops) and tensor_shape is None:
        raise ValueError("tensor_shape is needed to receive unless "
                         "config.variable_seq_lengths is set.")
    dtype, received, p2p_ops = _dtype(config), [], []
    for (send, peer, tensor, activation), shape in zip(ops, shapes):
        if not send:
            tensor = device.empty(*shape, dtype=dtype, requires_grad=activation)
        received.append(None if send else tensor)
        p2p_ops.append(dist.P2POp(dist.isend if send else dist.irecv, tensor,
                                  global_rank[peer], group))
    _post_and_wait(p2p_ops)
    return received


def _exchange_batch_shapes(ops, group, global_rank) -> List[Optional[Tuple[int, ...]]]:
    """The shapes of the tensors ``exchange_batch`` is about to receive, sent ahead."""
    buffers, p2p_ops = [], []
    for send, peer, tensor, _ in ops:
        if send and tensor.dim() != 3:
            raise ValueError(f"pipeline tensors are [sequence, micro batch, hidden]; got "
                             f"shape {tuple(tensor.shape)} to send.")
        buffer = device.tensor(list(tensor.shape), dtype=torch.int64) if send \
            else device.empty(3, dtype=torch.int64)
        buffers.append(buffer)
        p2p_ops.append(dist.P2POp(dist.isend if send else dist.irecv, buffer,
                                  global_rank[peer], group))
    _post_and_wait(p2p_ops)
    return [None if send else tuple(b.tolist()) for (send, *_), b in zip(ops, buffers)]


# --- Megatron's named operations --------------------------------------------------------------
# The plain ones do nothing on the stage without a neighbour in that direction (they follow the
# current virtual stage); the combined ones do exactly what they are told.

def recv_forward(tensor_shape: Shape, config) -> Optional[torch.Tensor]:
    if parallel_state.is_pipeline_first_stage():
        return None
    return communicate(None, None, True, False, tensor_shape, config)[0]


def recv_backward(tensor_shape: Shape, config) -> Optional[torch.Tensor]:
    if parallel_state.is_pipeline_last_stage():
        return None
    return communicate(None, None, False, True, tensor_shape, config)[1]


def send_forward(output_tensor: torch.Tensor, config) -> None:
    if not parallel_state.is_pipeline_last_stage():
        communicate(output_tensor, None, False, False, None, config)


def send_backward(input_tensor_grad: torch.Tensor, config) -> None:
    if not parallel_state.is_pipeline_first_stage():
        communicate(None, input_tensor_grad, False, False, None, config)


def send_forward_recv_backward(output_tensor: torch.Tensor, tensor_shape: Shape,
                               config) -> Optional[torch.Tensor]:
    if parallel_state.is_pipeline_last_stage():
        return None
    return communicate(output_tensor, None, False, True, tensor_shape, config)[1]


def send_backward_recv_forward(input_tensor_grad: torch.Tensor, tensor_shape: Shape,
                               config) -> Optional[torch.Tensor]:
    if parallel_state.is_pipeline_first_stage():
        return None
    return communicate(None, input_tensor_grad, True, False, tensor_shape, config)[0]


def send_forward_recv_forward(output_tensor: Optional[torch.Tensor], recv_prev: bool,
                              tensor_shape: Shape, config) -> Optional[torch.Tensor]:
    return communicate(output_tensor, None, recv_prev, False, tensor_shape, config)[0]


def send_backward_recv_backward(input_tensor_grad: Optional[torch.Tensor], recv_next: bool,
                                tensor_shape: Shape, config) -> Optional[torch.Tensor]:
    return communicate(None, input_tensor_grad, False, recv_next, tensor_shape, config)[1]


def send_forward_backward_recv_forward_backward(
        output_tensor: Optional[torch.Tensor], input_tensor_grad: Optional[torch.Tensor],
        recv_prev: bool, recv_next: bool, tensor_shape: Shape, config
) -> Tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    return communicate(output_tensor, input_tensor_grad, recv_prev, recv_next, tensor_shape,
                       config)
