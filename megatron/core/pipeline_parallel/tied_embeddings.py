"""GPT's tied input embedding and output layer when they sit on different pipeline stages.

The first stage holds the embedding, the last stage a copy used as the output layer. The two
start equal (broadcast from the first stage) and stay equal because their gradients are summed
over the embedding group before every optimizer step.
"""
from typing import List, Optional

import torch
import torch.distributed as dist

from megatron.core import parallel_state
from megatron.core.pipeline_parallel.model_chunks import unwrap_model


def _tied_weight(chunks: List[torch.nn.Module]) -> Optional[torch.nn.Parameter]:
    """This rank's copy of the tied weight, or None where it holds none (or PP == 1, where the
    two uses already share one parameter)."""
    if parallel_state.get_pipeline_model_parallel_world_size() == 1:
        return None
    if parallel_state.is_pipeline_first_stage(ignore_virtual=True):
        model = unwrap_model(chunks[0])
    elif parallel_state.is_pipeline_last_stage(ignore_virtual=True):
        model = unwrap_model(chunks[-1])
    else:
        return None
    if not getattr(model, "share_embeddings_and_output_weights", False):
        return None
    return model.shared_embedding_or_output_weight()


def sync_tied_embedding_weights(chunks: List[torch.nn.Module]) -> None:
    """Copy the first stage's embedding into the last stage's output layer."""
    weight = _tied_weight(chunks)
    if weight is not None:
        group = parallel_state.get_embedding_group()
        src = parallel_state.get_embedding_ranks()[0]
        with torch.no_grad():
            dist.broadcast(weight.data, src=src, group=group)


def allreduce_tied_embedding_grads(chunks: List[torch.nn.Module]) -> None:
    """Sum the tied weight's gradient over its two copies (``main_grad`` where DDP keeps one;
    with ZeRO-2's freed buffers the slice of this rank's shard inside it: each copy has a
    bucket of its own, of one layout, so both stages hold the same slice)."""
    weight = _tied_weight(chunks)
    if weight is None:
        return
    grad = getattr(weight, "main_grad", None)
    if grad is None:
        grad = getattr(weight, "main_grad_shard", None)
    if grad is None:
        grad = weight.grad
    if grad is None:
        raise RuntimeError("the tied embedding has no gradient on this stage; run backward on "
                           "every microbatch before summing the tied-embedding gradients.")
    if grad.numel() > 0:  # a shard of padding only: empty on both stages
        dist.all_reduce(grad, group=parallel_state.get_embedding_group())
