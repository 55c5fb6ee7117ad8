"""GPT's tied input embedding and output layer when they sit in different model chunks.

The chunk holding the first stage has the embedding, the one holding the last stage a copy
used as the output layer (or, untied, multi-token prediction's lookup table). The two start
equal and stay equal because their gradients are summed before every optimizer step. In the
loop placement the copies are on the first and last pipeline ranks (a broadcast and an
all-reduce over the embedding group); in the V placement (zbv) both are chunks of pipeline
rank 0, so the copy and the sum are local. Summing two copies locally or over two ranks is the
same single addition, so both give the same bits.

Two parameters rather than one shared Parameter: each chunk is its own DDP module with its
own gradient buffer, and a Parameter in two of them would be reduced twice.
"""
from typing import List

import torch
import torch.distributed as dist

from megatron.core import parallel_state
from megatron.core.pipeline_parallel.model_chunks import unwrap_model


def _tied_weights(chunks: List[torch.nn.Module]) -> List[torch.nn.Parameter]:
    """This rank's copies of the tied weight, the embedding's first: none (a middle rank, an
    untied model, or PP == 1, where the two uses already share one parameter), one (the loop
    placement's first or last rank) or two (rank 0 of the V placement)."""
    if parallel_state.get_pipeline_model_parallel_world_size() == 1:
        return []
    weights = []
    for chunk in chunks:
        model = unwrap_model(chunk)
        holds_a_copy = getattr(model, "pre_process", False) or \
            getattr(model, "post_process", False)
        tied = getattr(model, "embedding_tied_across_stages",
                       getattr(model, "share_embeddings_and_output_weights", False))
        if holds_a_copy and tied:
            weights.append(model.shared_embedding_or_output_weight())
    return weights


def sync_tied_embedding_weights(chunks: List[torch.nn.Module]) -> None:
    """Copy the first stage's embedding into the last stage's output layer."""
    weights = _tied_weights(chunks)
    with torch.no_grad():
        if len(weights) == 2:
            weights[1].copy_(weights[0])
        elif weights:
            group = parallel_state.get_embedding_group()
            src = parallel_state.get_embedding_ranks()[0]
            dist.broadcast(weights[0].data, src=src, group=group)


def _reduced_grad(weight: torch.nn.Parameter) -> torch.Tensor:
    """``main_grad`` where DDP keeps one; with ZeRO-2's freed buffers the slice of this rank's
    shard inside it (each copy has a bucket of its own, of one layout, so both copies hold the
    same slice); else ``.grad``."""
    grad = getattr(weight, "main_grad", None)
    if grad is None:
        grad = getattr(weight, "main_grad_shard", None)
    if grad is None:
        grad = weight.grad
    if grad is None:
        raise RuntimeError("the tied embedding has no gradient on this stage; run backward on "
                           "every microbatch before summing the tied-embedding gradients.")
    from megatron.core.distributed.fsdp_checkpoint import is_sharded  # (a cycle at import)

    # FSDP2: this rank's rows. Both copies have the same shape and are sharded on dim 0 over
    # DP groups of the same size, and the embedding group pairs equal DP ranks, so the two
    # ends of the all-reduce hold the same rows.
    return grad.to_local() if is_sharded(grad) else grad


def allreduce_tied_embedding_grads(chunks: List[torch.nn.Module]) -> None:
    """Sum the tied weight's gradient over its two copies, and give the sum to both."""
    grads = [_reduced_grad(weight) for weight in _tied_weights(chunks)]
    if len(grads) == 2:
        grads[0].add_(grads[1])
        grads[1].copy_(grads[0])
    elif grads and grads[0].numel() > 0:  # a shard of padding only: empty on both stages
        dist.all_reduce(grads[0], group=parallel_state.get_embedding_group())
