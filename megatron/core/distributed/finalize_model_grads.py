"""Everything that must happen to gradients between the last backward and the optimizer."""
from typing import List

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.distributed.fsdp_checkpoint import is_sharded
from megatron.core.pipeline_parallel.model_chunks import unwrap_model
from megatron.core.pipeline_parallel.tied_embeddings import allreduce_tied_embedding_grads


def reduced_grad(param: torch.nn.Parameter):
    """DDP's main_grad, else (ZeRO-2, full buffers freed after the DP reduction) the slice of
    this rank's gradient shard inside the parameter, else .grad; under FSDP2 this rank's shard
    of it (a DTensor's local tensor). The shards are the same slice on every TP rank of the
    DP rank (and on both stages of a tied embedding), so elementwise sums over them are
    right."""
    grad = getattr(param, "main_grad", None)
    if grad is None:
        grad = getattr(param, "main_grad_shard", None)
    grad = param.grad if grad is None else grad
    return grad.to_local() if is_sharded(grad) else grad


def allreduce_sequence_parallel_grads(model_chunks: List[torch.nn.Module]) -> None:
    """Under sequence parallelism each TP rank saw only its slice of the sequence, so the
    replicated weights (norms, row-parallel biases) hold partial gradients: sum them over TP,
    flattened into one collective."""
    if parallel_state.get_tensor_model_parallel_world_size() == 1:
        return
    grads = [reduced_grad(p) for chunk in model_chunks
             for p in unwrap_model(chunk).parameters() if getattr(p, "sequence_parallel", False)]
    grads = [g for g in grads if g is not None and g.numel() > 0]  # same on every TP rank
    if not grads:
        return
    flat = torch._utils._flatten_dense_tensors(grads)
    dist.all_reduce(flat, group=parallel_state.get_tensor_model_parallel_group())
    for grad, synced in zip(grads, torch._utils._unflatten_dense_tensors(flat, grads)):
        grad.copy_(synced)


def update_router_expert_biases(model_chunks: List[torch.nn.Module]) -> None:
    """Aux-loss-free balancing: each router's token counts since the last step, summed over
    every rank routing tokens for the same layers (TP x CP x DP of the stage), move its
    expert bias, identically on every rank (one collective for all routers)."""
    routers = [m for chunk in model_chunks for m in unwrap_model(chunk).modules()
               if getattr(m, "expert_bias", None) is not None]
    if not routers:
        return
    counts = [r.local_tokens_per_expert for r in routers]
    flat = torch._utils._flatten_dense_tensors(counts)
    dist.all_reduce(flat, group=parallel_state.get_tensor_and_data_parallel_group(
        with_context_parallel=True))
    for count, summed in zip(counts, torch._utils._unflatten_dense_tensors(flat, counts)):
        count.copy_(summed)
    for router in routers:
        router.update_expert_bias()


def finalize_model_grads(model_chunks: List[torch.nn.Module]) -> None:
    """DP reduction (waiting for overlapped buckets), sequence-parallel gradients over TP,
    the tied embedding's two copies summed over the first and last pipeline stage, and the
    routers' expert-bias update."""
    for chunk in model_chunks:
        if hasattr(chunk, "finish_grad_sync"):
            chunk.finish_grad_sync()
    allreduce_sequence_parallel_grads(model_chunks)
    allreduce_tied_embedding_grads(model_chunks)
    update_router_expert_biases(model_chunks)
