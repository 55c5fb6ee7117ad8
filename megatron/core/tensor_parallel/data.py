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

    sizes = device.zeros(len(keys), _MAX_DIMS, dtype=torch.long)
    if is_source:
        missing = [k for k in keys if data is None or k not in data]
        if missing:
            raise KeyError(f"broadcast_data: keys {missing} are not in the batch.")
        for i, key in enumerate(keys):
            shape = data[key].shape
            if 0 in shape:
                raise ValueError(f"broadcast_data: {key!r} has an empty dimension {tuple(shape)}.")
            if len(shape) > _MAX_DIMS:
                raise ValueError(f"broadcast_data: {key!r} has {len(shape)} dims; "
                                 f"at most {_MAX_DIMS} are supported.")
            sizes[i, :len(shape)] = torch.tensor(shape, dtype=torch.long)
    dist.broadcast(sizes, src, group=group)

    shapes = []
    for row in sizes.tolist():
        # A dimension of size 0 would end the shape early; tensors in a batch have none.
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
