"""Cross entropy over logits whose vocabulary dimension is split across TP ranks.

Never gathers the logits: each rank reduces its slice, and two all-reduces (the max, then the
target logit, the sum of exponentials and, with label smoothing, the sum of logits packed
together) give every rank the per-token loss. Label smoothing follows
``torch.nn.functional.cross_entropy``: the target distribution is (1 - eps) on the label plus
eps spread uniformly over the vocabulary. Columns at or past ``vocab_size`` (padding added by
vocab_size_with_padding) are left out of the softmax and of the smoothing.

The logits are the largest activation of a language model, so the work is done in one fp32
buffer: the exponentials are kept there for backward, unnormalised, and become the gradient in
place. With ``inplace=True`` that buffer is the caller's logits tensor itself (the model's loss
path owns its logits); otherwise it is one copy.

``fused=True`` (the compiled element-wise path, CUDA's default) never makes an fp32 copy of the
logits: three torch.compile'd functions read the logits in their own dtype (bf16) and do the
fp32 arithmetic in registers, one pass each: the row maximum, then the target logit and the sums
(between them the same all-reduces), and in backward the gradient, written once in the logits'
dtype. What backward keeps is the logits themselves (half the fp32 buffer in bf16) and two
floats a token. ``compile=False`` runs the same three functions eagerly (tests).
"""
from typing import Optional

import torch
import torch.distributed as dist

from megatron.core import parallel_state
from megatron.core.tensor_parallel.utils import vocab_range_for_rank
from megatron.core.compiled import compiled

# Rows per pass with vectorized=False (meant to keep a chunk in cache between the ops). The
# default is one pass over all rows: on CUDA each op is one launch instead of ~128 iterations x
# 3-4 launches per microbatch, and on CPU it measured faster too (fwd+bwd on [1024, 32000],
# 2 threads: ~175-280 ms against ~320-460 ms chunked, on a loaded machine).
_ROWS_PER_CHUNK = 64


def _tp_group():
    return (parallel_state.get_tensor_model_parallel_group(),
            parallel_state.get_tensor_model_parallel_world_size())


def _vocabulary_slice(partition: int, vocab_size: Optional[int]):
    """(start, end) of this rank's global ids, the classes of the softmax (the unpadded
    vocabulary) and ``valid``: local columns [0, valid) are real entries, the rest padding."""
    tp_size = parallel_state.get_tensor_model_parallel_world_size()
    start, end = vocab_range_for_rank(partition * tp_size,
                                      parallel_state.get_tensor_model_parallel_rank(), tp_size)
    num_classes = vocab_size if vocab_size is not None else partition * tp_size
    return start, end, num_classes, max(0, min(partition, num_classes - start))


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, vocab_parallel_logits, target, label_smoothing, vocab_size, inplace,
                vectorized):
        group, tp_size = _tp_group()
        partition = vocab_parallel_logits.shape[-1]
        start, end, num_classes, valid = _vocabulary_slice(partition, vocab_size)

        owned = inplace and vocab_parallel_logits.dtype == torch.float32
        work = vocab_parallel_logits if owned else vocab_parallel_logits.to(torch.float32,
                                                                             copy=True)
        work[..., valid:] = float("-inf")

        logits_max = work.amax(dim=-1)
        if tp_size > 1:
            dist.all_reduce(logits_max, op=dist.ReduceOp.MAX, group=group)

        off_rank = (target < start) | (target >= end)
        local_target = (target - start).masked_fill(off_rank, 0)
        predicted = work.gather(-1, local_target.unsqueeze(-1)).squeeze(-1)
        predicted = (predicted - logits_max).masked_fill(off_rank, 0.0)

        rows = work.view(-1, partition)
        row_max = logits_max.view(-1, 1)
        sum_exp = torch.empty(rows.shape[0], dtype=torch.float32, device=work.device)
        sum_logits = torch.zeros_like(sum_exp) if label_smoothing > 0 else None
        # The same in-place ops on all rows at once (vectorized) or on 64 rows at a time.
        step = rows.shape[0] if vectorized else _ROWS_PER_CHUNK
        for begin in range(0, rows.shape[0], step):
            chunk = rows[begin:begin + step]
            chunk.sub_(row_max[begin:begin + step])
            if sum_logits is not None:
                sum_logits[begin:begin + chunk.shape[0]] = chunk[:, :valid].sum(dim=-1)
            torch.sum(chunk.exp_(), dim=-1, out=sum_exp[begin:begin + chunk.shape[0]])

        sums = [predicted.reshape(-1), sum_exp] + ([sum_logits] if sum_logits is not None else [])
        packed = torch.stack(sums)
        if tp_size > 1:
            dist.all_reduce(packed, group=group)
        predicted, sum_exp = packed[0].view(target.shape), packed[1].view(target.shape)

        log_sum_exp = torch.log(sum_exp)
        loss = log_sum_exp - predicted
        if label_smoothing > 0:
            mean_log_prob = packed[2].view(target.shape) / num_classes - log_sum_exp
            loss = (1.0 - label_smoothing) * loss - label_smoothing * mean_log_prob

        ctx.label_smoothing, ctx.num_classes, ctx.valid = label_smoothing, num_classes, valid
        ctx.input_dtype = vocab_parallel_logits.dtype
        ctx.save_for_backward(work, sum_exp, off_rank, local_target)
        return loss

    @staticmethod
    def backward(ctx, grad_output):
        exp_logits, sum_exp, off_rank, local_target = ctx.saved_tensors
        eps = ctx.label_smoothing
        # d loss / d logit_j = g * (softmax_j - (1 - eps) [j = target] - eps / K [j valid]).
        grad = exp_logits.mul_((grad_output / sum_exp).unsqueeze(-1))
        on_target = (-(1.0 - eps) * grad_output).masked_fill(off_rank, 0.0)
        grad.scatter_add_(-1, local_target.unsqueeze(-1), on_target.unsqueeze(-1))
        if eps > 0:
            grad[..., :ctx.valid].sub_((eps / ctx.num_classes * grad_output).unsqueeze(-1))
        return grad.to(ctx.input_dtype), None, None, None, None, None


def _real_columns(logits, valid: int):
    """fp32 view of the logits (in registers when compiled) with padding columns at -inf."""
    columns = torch.arange(logits.shape[-1], device=logits.device)
    return torch.where(columns < valid, logits.float(), float("-inf"))


def _row_max(logits, valid: int):
    return _real_columns(logits, valid).amax(dim=-1)


def _row_sums(logits, row_max, local_target, off_rank, valid: int, smoothing: bool):
    """[target logit - max (0 off this rank), sum of exp(logit - max), and with label
    smoothing the sum of (logit - max) over real columns] per row, stacked."""
    shifted = _real_columns(logits, valid) - row_max.unsqueeze(-1)
    predicted = shifted.gather(-1, local_target.unsqueeze(-1)).squeeze(-1)
    sums = [predicted.masked_fill(off_rank, 0.0), shifted.exp().sum(dim=-1)]
    if smoothing:
        columns = torch.arange(logits.shape[-1], device=logits.device)
        sums.append(torch.where(columns < valid, shifted, 0.0).sum(dim=-1))
    return torch.stack(sums)


def _logits_grad(logits, row_max, sum_exp, grad_output, local_target, off_rank, eps: float,
                 valid: int, num_classes: int):
    """g * (softmax - (1 - eps) [j = target] - eps / K [j real]), in the logits' dtype."""
    columns = torch.arange(logits.shape[-1], device=logits.device)
    g = grad_output.unsqueeze(-1)
    softmax = (_real_columns(logits, valid) - row_max.unsqueeze(-1)).exp() / \
        sum_exp.unsqueeze(-1)
    on_target = (columns == local_target.unsqueeze(-1)) & ~off_rank.unsqueeze(-1)
    grad = softmax - torch.where(on_target, 1.0 - eps, 0.0)
    if eps > 0:
        grad = torch.where(columns < valid, grad - eps / num_classes, grad)
    return (grad * g).to(logits.dtype)


class _FusedVocabParallelCrossEntropy(torch.autograd.Function):
    """The arithmetic of _VocabParallelCrossEntropy without an fp32 copy of the logits."""

    @staticmethod
    def forward(ctx, logits, target, label_smoothing, vocab_size, compile):
        run = compiled if compile else (lambda fn: fn)
        group, tp_size = _tp_group()
        partition = logits.shape[-1]
        start, end, num_classes, valid = _vocabulary_slice(partition, vocab_size)
        rows = logits.view(-1, partition)
        off_rank = ((target < start) | (target >= end)).reshape(-1)
        local_target = (target.reshape(-1) - start).masked_fill(off_rank, 0)

        row_max = run(_row_max)(rows, valid)
        if tp_size > 1:
            dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=group)
        packed = run(_row_sums)(rows, row_max, local_target, off_rank, valid,
                                label_smoothing > 0)
        if tp_size > 1:
            dist.all_reduce(packed, group=group)
        predicted, sum_exp = packed[0], packed[1]
        log_sum_exp = torch.log(sum_exp)
        loss = log_sum_exp - predicted
        if label_smoothing > 0:
            mean_log_prob = packed[2] / num_classes - log_sum_exp
            loss = (1.0 - label_smoothing) * loss - label_smoothing * mean_log_prob

        ctx.label_smoothing, ctx.num_classes, ctx.valid = label_smoothing, num_classes, valid
        ctx.run = run
        ctx.save_for_backward(logits, row_max, sum_exp, off_rank, local_target)
        return loss.view(target.shape)

    @staticmethod
    def backward(ctx, grad_output):
        logits, row_max, sum_exp, off_rank, local_target = ctx.saved_tensors
        partition = logits.shape[-1]
        grad = ctx.run(_logits_grad)(
            logits.view(-1, partition), row_max, sum_exp, grad_output.reshape(-1).float(),
            local_target, off_rank, ctx.label_smoothing, ctx.valid, ctx.num_classes)
        return grad.view(logits.shape), None, None, None, None


def vocab_parallel_cross_entropy(vocab_parallel_logits: torch.Tensor, target: torch.Tensor,
                                 label_smoothing: float = 0.0, vocab_size: Optional[int] = None,
                                 inplace: bool = False, vectorized: bool = True,
                                 fused: bool = False, compile: bool = True) -> torch.Tensor:
    """Per-token loss (shape of ``target``) from this rank's vocab slice of the logits.

    ``target`` holds global token ids; ``vocab_size`` is the unpadded vocabulary (defaults to
    the padded one, i.e. nothing excluded). ``inplace=True`` lets fp32 logits be overwritten
    (saves a copy of the largest activation); pass it only for logits nothing else reads.
    ``vectorized``: one pass over all rows (default) or 64-row chunks; the numbers are
    bitwise the same on CPU (each row is reduced alike) and the memory too (all in place).
    ``fused``: no fp32 copy of the logits (module docstring); ``inplace`` and ``vectorized``
    then do not apply, and ``compile=False`` runs its functions eagerly.
    """
    if not 0.0 <= label_smoothing < 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1), got {label_smoothing}.")
    if vocab_parallel_logits.shape[:-1] != target.shape:
        raise ValueError(f"logits {tuple(vocab_parallel_logits.shape)} and target "
                         f"{tuple(target.shape)} disagree on the leading dimensions.")
    if fused:
        return _FusedVocabParallelCrossEntropy.apply(vocab_parallel_logits.contiguous(), target,
                                                     label_smoothing, vocab_size, compile)
    return _VocabParallelCrossEntropy.apply(vocab_parallel_logits.contiguous(), target,
                                            label_smoothing, vocab_size, inplace, vectorized)
