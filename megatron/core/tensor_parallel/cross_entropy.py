"""Cross entropy over logits whose vocabulary dimension is split across TP ranks.

Never gathers the logits: each rank reduces its slice, and two all-reduces (the max, then the
target logit, the sum of exponentials and, with label smoothing, the sum of logits packed
together) give every rank the per-token loss. Label smoothing follows
``torch.nn.functional.cross_entropy``: the target distribution is (1 - eps) on the label plus
eps spread uniformly over the vocabulary. Columns at or past ``vocab_size`` (padding added by
vocab_size_with_padding) are left out of the softmax and of the smoothing.
"""
from typing import Optional

import torch
import torch.distributed as dist

from megatron.core import parallel_state
from megatron.core.tensor_parallel.utils import vocab_range_for_rank


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, vocab_parallel_logits, target, label_smoothing, vocab_size):
        group = parallel_state.get_tensor_model_parallel_group()
        tp_size = parallel_state.get_tensor_model_parallel_world_size()
        partition = vocab_parallel_logits.shape[-1]
        start, end = vocab_range_for_rank(partition * tp_size,
                                          parallel_state.get_tensor_model_parallel_rank(), tp_size)
        num_classes = vocab_size if vocab_size is not None else partition * tp_size

        logits = vocab_parallel_logits.float()
        padded = None
        if end > num_classes:
            padded = torch.arange(start, end, device=logits.device) >= num_classes
            logits = logits.masked_fill(padded, float("-inf"))

        logits_max = logits.max(dim=-1).values
        if tp_size > 1:
            dist.all_reduce(logits_max, op=dist.ReduceOp.MAX, group=group)
        logits = logits - logits_max.unsqueeze(-1)

        off_rank = (target < start) | (target >= end)
        local_target = (target - start).masked_fill(off_rank, 0)
        predicted = logits.gather(-1, local_target.unsqueeze(-1)).squeeze(-1)
        predicted = predicted.masked_fill(off_rank, 0.0)

        sums = [predicted]
        if label_smoothing > 0:
            finite = logits if padded is None else logits.masked_fill(padded, 0.0)
            sums.append(finite.sum(dim=-1))
        exp_logits = logits.exp_()  # logits is ours (a new tensor); reuse it for the softmax
        sums.append(exp_logits.sum(dim=-1))
        packed = torch.stack(sums)
        if tp_size > 1:
            dist.all_reduce(packed, group=group)
        predicted, sum_exp = packed[0], packed[-1]

        log_sum_exp = torch.log(sum_exp)
        loss = log_sum_exp - predicted
        if label_smoothing > 0:
            mean_log_prob = packed[1] / num_classes - log_sum_exp
            loss = (1.0 - label_smoothing) * loss - label_smoothing * mean_log_prob

        softmax = exp_logits.div_(sum_exp.unsqueeze(-1))
        ctx.label_smoothing = label_smoothing
        ctx.num_classes = num_classes
        ctx.input_dtype = vocab_parallel_logits.dtype
        ctx.save_for_backward(softmax, off_rank, local_target, padded
                              if padded is not None else torch.empty(0, dtype=torch.bool))
        return loss

    @staticmethod
    def backward(ctx, grad_output):
        softmax, off_rank, local_target, padded = ctx.saved_tensors
        eps = ctx.label_smoothing
        grad = softmax  # saved only for us: update in place
        on_rank = (~off_rank).to(grad.dtype)
        grad.scatter_add_(-1, local_target.unsqueeze(-1), (-(1.0 - eps) * on_rank).unsqueeze(-1))
        if eps > 0:
            smoothing = torch.full((grad.shape[-1],), eps / ctx.num_classes,
                                   dtype=grad.dtype, device=grad.device)
            if padded.numel():
                smoothing = smoothing.masked_fill(padded, 0.0)
            grad.sub_(smoothing)
        grad.mul_(grad_output.unsqueeze(-1))
        return grad.to(ctx.input_dtype), None, None, None


def vocab_parallel_cross_entropy(vocab_parallel_logits: torch.Tensor, target: torch.Tensor,
                                 label_smoothing: float = 0.0,
                                 vocab_size: Optional[int] = None) -> torch.Tensor:
    """Per-token loss (shape of ``target``) from this rank's vocab slice of the logits.

    ``target`` holds global token ids; ``vocab_size`` is the unpadded vocabulary (defaults to
    the padded one, i.e. nothing excluded).
    """
    if not 0.0 <= label_smoothing < 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1), got {label_smoothing}.")
    if vocab_parallel_logits.shape[:-1] != target.shape:
        raise ValueError(f"logits {tuple(vocab_parallel_logits.shape)} and target "
                         f"{tuple(target.shape)} disagree on the leading dimensions.")
    return _VocabParallelCrossEntropy.apply(vocab_parallel_logits, target, label_smoothing,
                                            vocab_size)
