"""What a run says about itself: one block at start (layout, model, batch, data, precision and
optimizer, where logs and checkpoints go) and one closing line (iterations, tokens, time, the
last training and validation losses, the last checkpoint). Parameter counts are collective;
everything else is read from the configs and the datasets on the printing rank."""
from typing import List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from megatron.core import device, expert_parallel_state, parallel_state
from megatron.core.optimizer.clip_grads import is_counted_in_norm
from megatron.core.pipeline_parallel.model_chunks import unwrap_model


def _local_numel(param: torch.Tensor) -> int:
    local = getattr(param, "to_local", None)  # an FSDP2 DTensor: this rank's shard
    return local().numel() if callable(local) else param.numel()


def parameter_counts(model_chunks) -> Tuple[int, int, int]:
    """(the model's parameters, counted once; this rank's; the largest rank's). Collective:
    every rank calls it. A parameter is counted where the global gradient norm counts it (one
    TP copy of a replicated weight, the first stage's copy of a tied embedding, the first
    data-parallel replica; a DTensor at its global size)."""
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    expert_dp_rank = expert_parallel_state.get_expert_data_parallel_rank() \
        if expert_parallel_state.expert_parallel_is_initialized() else 0  # a dense model
    replicas = (parallel_state.get_data_parallel_rank(with_context_parallel=True),
                expert_dp_rank)
    seen, counted, local = set(), 0, 0
    for chunk in model_chunks:
        for param in unwrap_model(chunk).parameters():
            if id(param) in seen:
                continue
            seen.add(id(param))
            local += _local_numel(param)
            if is_counted_in_norm(param, tp_rank, replicas):
                counted += param.numel()
    totals = device.tensor([counted, local], dtype=torch.float64)
    largest = device.tensor([local], dtype=torch.float64)
    dist.all_reduce(totals)
    dist.all_reduce(largest, op=dist.ReduceOp.MAX)
    return int(totals[0].item()), local, int(largest.item())


def _count(n: int) -> str:
    """'1,100,048,384 (1.10 B)'."""
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n:,} ({n / size:.2f} {unit})"
    return f"{n:,}"


def _dataset_line(name: str, dataset, samples_needed: int, seq_length: int) -> str:
    """'train 48 samples of 4096 (0.75 epochs of 65,536 tokens)'; what the dataset knows."""
    if dataset is None:
        return f"{name} none"
    text = f"{name} {samples_needed} samples of {len(dataset)}"
    tokens = _tokens_per_epoch(dataset)
    if tokens:
        epochs = samples_needed * seq_length / tokens
        text += f" ({epochs:.2f} epochs of {tokens:,} tokens)"
    return text


def _tokens_per_epoch(dataset) -> Optional[int]:
    """Tokens of the documents a GPT dataset (or a blend of them) samples from, if known."""
    parts = getattr(dataset, "datasets", None)
    if parts is not None:
        counts = [_tokens_per_epoch(part) for part in parts]
        return sum(counts) if all(counts) else None
    return getattr(dataset, "num_tokens", None)


def start_block(args, configs, counts: Tuple[int, int, int], datasets: Sequence,
                samples_needed: Sequence[int], train_iters: int, memory_mode: str,
                world_size: int) -> List[str]:
    """The lines rank 0 prints before iteration 1."""
    tc, t = configs.transformer, configs.training
    tp, pp, cp = (tc.tensor_model_parallel_size, tc.pipeline_model_parallel_size,
                  tc.context_parallel_size)
    vpp = tc.virtual_pipeline_model_parallel_size
    schedule = tc.pipeline_schedule or ("interleaved 1F1B" if vpp else "1F1B")
    pipeline = f"PP {pp} ({schedule}{f', {vpp} chunks per rank' if vpp else ''})" \
        if pp > 1 else "PP 1"
    ep = tc.expert_model_parallel_size
    total, mine, largest = counts
    tokens = t.global_batch_size * args.seq_length
    micro = t.global_batch_size // (t.micro_batch_size * t.data_parallel_size)
    precision = "bf16" if args.bf16 else "fp16" if args.fp16 else "fp32"
    if precision != "fp32":
        precision += " (fp32 main parameters and gradients)"
    if tc.fp8 is not None:
        precision += f", FP8 GEMMs ({tc.fp8.format}, {tc.fp8.recipe})"
        if getattr(args, "fp8_param_gather", False):
            precision += ", weights all-gathered in FP8"
    experts = f", {tc.moe.num_moe_experts} experts (top-{tc.moe.moe_router_topk})" \
        if tc.moe is not None else ""
    data = "mock data" if args.mock_data else "; ".join(
        _dataset_line(name, ds, n, args.seq_length)
        for name, ds, n in zip(("train", "valid", "test"), datasets, samples_needed))
    saves = f"{t.save} every {t.save_interval} iterations" if t.save and t.save_interval \
        else t.save or "nowhere (no --save)"
    lines = [
        (f"job: {t.job_name}; " if t.job_name else "")
        + f"run: {world_size} process{'es' if world_size > 1 else ''} = TP {tp} x CP {cp} x "
        f"{pipeline} x DP {t.data_parallel_size}" + (f"; EP {ep}" if ep > 1 else ""),
        f"model: {_count(total)} parameters (this rank {_count(mine)}, the largest "
        f"{_count(largest)}); {tc.num_layers} layers, hidden {tc.hidden_size}, "
        f"{tc.num_attention_heads} heads / {tc.num_query_groups} query groups, vocabulary "
        f"{configs.model_kwargs.get('padded_vocab_size')}{experts}",
        f"batch: {t.global_batch_size} sequences x {args.seq_length} tokens = {tokens:,} "
        f"tokens per iteration (micro batch {t.micro_batch_size}, {micro} micro batches per "
        f"data-parallel rank); {train_iters} iterations = {tokens * train_iters:,} tokens",
        f"data: {data}",
        f"precision: {precision}; optimizer: {configs.optimizer.optimizer}, {memory_mode}; "
        f"element-wise: {'compiled' if tc.torch_compile else 'eager'}",
        f"checkpoints: {args.ckpt_format} format, saved to {saves}"
        + (f", loaded from {t.load}" if t.load else "")
        + (f"; TensorBoard: {t.tensorboard_dir}" if t.tensorboard_dir else "")
        + (f"; W&B project: {t.wandb_project}" if t.wandb_project else ""),
    ]
    return lines


def closing_line(first: int, last: int, tokens_per_iteration: int, seconds: float,
                 final_losses: Optional[dict], validation: Optional[Tuple[int, dict]],
                 saved: Optional[int], save_dir: Optional[str]) -> str:
    """One line after training (the last pipeline stage prints it: it has the losses)."""
    done = last - first
    text = f"done: {done} iterations ({first + 1}-{last}), {done * tokens_per_iteration:,} " \
           f"tokens in {seconds:.1f} s"
    if final_losses:
        text += "; final " + ", ".join(f"{k} {v:.6E}" for k, v in final_losses.items())
    if validation is not None:
        iteration, losses = validation
        text += f"; validation at iteration {iteration}: " + ", ".join(
            f"{k} {v:.6E}" for k, v in losses.items())
    text += f"; last checkpoint: iteration {saved} in {save_dir}" if saved is not None \
        else "; no checkpoint saved"
    return text
