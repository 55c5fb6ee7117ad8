"""Broadcast a batch from TP rank 0 to the rest of its TP group.

Only TP rank 0 reads the data loader; the others receive its tensors, so every TP rank of a
replica sees the same batch. Two broadcasts: the shapes, then all tensors packed flat.
"""
from typing import Dict, List, Optional

import torch
import torch.distributed as dist

from megatron.core import device, parallel_state

_MAX_DIMS = 8


def broadcast_data(keys: List[str], data: Optional[Dict[str, torch.Tensor]],
                   datatype: torch.dtype) -> Dict[str, torch.Tensor]:
    """Return ``{key: tensor}`` on the current device, equal on all ranks of the TP group.

    ``data`` is read on TP rank 0 only (others may pass None); every tensor under ``keys``
    is cast to ``datatype``.
    """
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

    shapes = []
    for row in sizes[1:].tolist():
        # Rows are zero-padded; a batch has no empty dimension (checked on the source).
        shapes.append(tuple(d for d in row if d > 0))
    numels = [int(torch.Size(s).numel()) for s in shapes]

    if is_source:
        flat = torch.cat([data[k].reshape(-1).to(device=device.current_device(), dtype=datatype)
                          for k in keys])
    else:
        flat = device.empty(sum(numels), dtype=datatype)
    dist.broadcast(flat, src, group=group)

    out, offset = {}, 0
    for key, shape, numel in zip(keys, shapes, numels):
        out[key] = flat.narrow(0, offset, numel).view(shape)
        offset += numel
    return out


def _check_batch(keys: List[str], data: Optional[Dict[str, torch.Tensor]]) -> Optional[str]:
    missing = [k for k in keys if data is None or k not in data]
    if missing:
        return f"keys {missing} are not in the batch."
    for key in keys:
        shape = tuple(data[key].shape)
        if 0 in shape:
            return f"{key!r} has an empty dimension {shape}."
        if len(shape) > _MAX_DIMS:
            return f"{key!r} has {len(shape)} dims; at most {_MAX_DIMS} are supported."
    return None
