"""Broadcast a batch from TP rank 0 to the rest of its TP group.

Only TP rank 0 reads the data loader; the others receive its tensors, so every TP rank of a
replica sees the same batch. Two paths:

- ``shapes`` given (the training path: micro batch and sequence length are known from the
  configs): one broadcast of all tensors packed flat plus a status element, and no host sync
  (no shapes to read back; a bad batch fails the receivers through a device-side assert).
- ``shapes`` not given (Megatron's generic broadcast_data): the shapes are broadcast first and
  read on the host, then the data.
"""
from typing import Dict, List, Optional, Sequence

import torch
import torch.distributed as dist

from megatron.core import device, parallel_state

_MAX_DIMS = 8


def broadcast_data(keys: List[str], data: Optional[Dict[str, torch.Tensor]],
                   datatype: torch.dtype,
                   shapes: Optional[Dict[str, Sequence[int]]] = None) -> Dict[str, torch.Tensor]:
    """Return ``{key: tensor}`` on the current device, equal on all ranks of the TP group.

    ``data`` is read on TP rank 0 only (others may pass None); every tensor under ``keys``
    is cast to ``datatype``. With ``shapes`` (``{key: shape}``, the same on every rank) no
    shapes are exchanged and nothing waits on the device. At TP=1 nothing is communicated.
    """
    if shapes is not None:
        return _broadcast_known_shapes(keys, data, datatype, shapes)
    is_source = parallel_state.get_tensor_model_parallel_rank() == 0
    group = parallel_state.get_tensor_model_parallel_group()
    src = parallel_state.get_tensor_model_parallel_src_rank()

    # Row 0 is a status flag, so a bad batch on the source fails every rank instead of
    # leaving the others waiting in the next broadcast.
    sizes = device.zeros(len(keys) + 1, _MAX_DIMS, dtype=torch.long)
    problem = None
    if is_source:
        problem = _check_batch(keys, data)
        if problem is None:
            for i, key in enumerate(keys):
                sizes[i + 1, :data[key].dim()] = torch.tensor(data[key].shape, dtype=torch.long)
        else:
            sizes[0, 0] = 1
    dist.broadcast(sizes, src, group=group)
    if problem is not None:
        raise ValueError(f"broadcast_data: {problem}")
    if sizes[0, 0].item() != 0:
        raise RuntimeError(f"broadcast_data: TP source rank {src} could not send its batch "
                           f"(see the error on that rank).")

    shapes_read = []
    for row in sizes[1:].tolist():
        # Rows are zero-padded; a batch has no empty dimension (checked on the source).
        shapes_read.append(tuple(d for d in row if d > 0))
    numels = [int(torch.Size(s).numel()) for s in shapes_read]

    if is_source:
        flat = torch.cat([_to_device(data[k], datatype).reshape(-1) for k in keys])
    else:
        flat = device.empty(sum(numels), dtype=datatype)
    dist.broadcast(flat, src, group=group)
    return _unpack(keys, flat, shapes_read)


def _broadcast_known_shapes(keys, data, datatype, shapes) -> Dict[str, torch.Tensor]:
    shapes = [tuple(shapes[k]) for k in keys]
    if parallel_state.get_tensor_model_parallel_world_size() == 1:
        problem = _check_batch(keys, data, shapes)
        if problem is not None:
            raise ValueError(f"broadcast_data: {problem}")
        return {k: _to_device(data[k], datatype).view(s) for k, s in zip(keys, shapes)}
    is_source = parallel_state.get_tensor_model_parallel_rank() == 0
    group = parallel_state.get_tensor_model_parallel_group()
    src = parallel_state.get_tensor_model_parallel_src_rank()
    total = sum(int(torch.Size(s).numel()) for s in shapes)
    # The last element is a status flag: a bad batch on the source still sends (so no rank
    # waits forever), and the receivers fail on the flag without reading it on the host.
    flat = device.empty(total + 1, dtype=datatype)
    problem = None
    if is_source:
        problem = _check_batch(keys, data, shapes)
        if problem is None:
            torch.cat([_to_device(data[k], datatype).reshape(-1) for k in keys],
                      out=flat[:total])
        flat[total:].fill_(0 if problem is None else 1)
    dist.broadcast(flat, src, group=group)
    if problem is not None:
        raise ValueError(f"broadcast_data: {problem}")
    if not is_source:
        # Asynchronous on CUDA (raised by the device, no host wait); immediate on CPU.
        torch._assert_async(flat[total] == 0, f"broadcast_data: TP source rank {src} could "
                                              f"not send its batch (see the error on that rank).")
    return _unpack(keys, flat, shapes)


def _to_device(tensor: torch.Tensor, datatype: torch.dtype) -> torch.Tensor:
    # Copy first (non-blocking: the loader pins host batches on CUDA), cast on the device.
    tensor = torch.as_tensor(tensor)
    return tensor.to(device=device.current_device(), non_blocking=True).to(datatype)


def _unpack(keys, flat, shapes) -> Dict[str, torch.Tensor]:
    out, offset = {}, 0
    for key, shape in zip(keys, shapes):
        numel = int(torch.Size(shape).numel())
        out[key] = flat.narrow(0, offset, numel).view(shape)
        offset += numel
    return out


def _check_batch(keys: List[str], data: Optional[Dict[str, torch.Tensor]],
                 expected: Optional[List[tuple]] = None) -> Optional[str]:
    """Host-side checks only (shapes are metadata: reading them does not sync)."""
    missing = [k for k in keys if data is None or k not in data]
    if missing:
        return f"keys {missing} are not in the batch."
    for i, key in enumerate(keys):
        shape = tuple(data[key].shape)
        if expected is not None and shape != expected[i]:
            return (f"{key!r} has shape {shape}, expected {expected[i]} (micro batch size x "
                    f"sequence length + 1); check the dataset's sequence length.")
        if 0 in shape:
            return f"{key!r} has an empty dimension {shape}."
        if len(shape) > _MAX_DIMS:
            return f"{key!r} has {len(shape)} dims; at most {_MAX_DIMS} are supported."
    return None
