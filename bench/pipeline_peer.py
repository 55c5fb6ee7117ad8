"""The peer side of bench/pipeline.py: torch.distributed.pipelining's schedules on the modules
of our pipeline stages, and their steps recorded in our PipelineTrace.

Torch's zero-bubble schedules split each backward themselves (``stage_backward_input`` runs
autograd for the stage input only and keeps the graph; ``stage_backward_weight`` later runs it
for the weights). That split relies on autograd computing only the gradients asked for. Our
Column/RowParallelLinear go through one custom autograd Function whose backward computes the
input AND the weight gradient whenever both require grad (``ctx.needs_input_grad`` is fixed at
forward), so under torch's split it would run the weight GEMM in B (thrown away) and both GEMMs
again in W. Torch's schedules therefore run the same modules, the same parameter tensors, with
every linear layer computing through plain autograd: ``torch.matmul(x, w.t())`` (+ bias), the
forward GEMM ours runs (``plain_linear_layers``). Only TP=1 without sequence parallelism (this
bench) allows that: the Function's extra work is TP communication and fusion.
"""
import contextlib

import torch

from megatron.core.pipeline_parallel.trace import BACKWARD, FORWARD, WAIT, WEIGHT
from megatron.core.tensor_parallel import layers as tp_layers

# name -> (torch class name, V placement)
TORCH_SCHEDULES = {
    "torch-1f1b": ("Schedule1F1B", False),
    "torch-zb": ("ScheduleInterleavedZeroBubble", False),
    "torch-zbv": ("ScheduleZBVZeroBubble", True),
    "torch-dualpipev": ("ScheduleDualPipeV", True),
}


def available_torch_schedules():
    """The names above whose class this torch has (ScheduleDualPipeV is recent)."""
    import torch.distributed.pipelining as pipelining

    return [name for name, (cls, _) in TORCH_SCHEDULES.items() if hasattr(pipelining, cls)]


class _PlainLinear:
    """Stands in for LinearWithGradAllReduce: the same forward GEMM, backward by autograd."""

    @staticmethod
    def apply(input_, weight, bias, sequence_parallel, reduce_input_grad, *unused):
        if sequence_parallel or reduce_input_grad:
            raise RuntimeError("plain linear layers are for TP=1 only.")
        output = torch.matmul(input_, weight.t())
        return output if bias is None else output + bias


@contextlib.contextmanager
def plain_linear_layers():
    original = tp_layers.LinearWithGradAllReduce
    tp_layers.LinearWithGradAllReduce = _PlainLinear
    try:
        yield
    finally:
        tp_layers.LinearWithGradAllReduce = original


class FromTokens(torch.nn.Module):
    """The first stage: token ids [b, s] -> hidden [s, b, h]."""

    def __init__(self, chunk):
        super().__init__()
        self.chunk = chunk

    def forward(self, tokens):
        return self.chunk(tokens)


class FromHidden(torch.nn.Module):
    """Any later stage: hidden [s, b, h] -> hidden, or logits [b, s, vocab] on the last."""

    def __init__(self, chunk):
        super().__init__()
        self.chunk = chunk

    def forward(self, hidden):
        self.chunk.set_input_tensor(hidden)
        return self.chunk(None)


def peer_step_fn(name, chunks, stage_indices, num_stages, group, microbatches, inputs, labels,
                 loss_fn):
    """One step of torch's schedule ``name`` over this rank's ``chunks`` (virtual stages
    ``stage_indices``); returns a function step(trace=None) -> this rank's losses."""
    import torch.distributed.pipelining as pipelining

    cls_name, _ = TORCH_SCHEDULES[name]
    stages = [pipelining.PipelineStage(FromTokens(c) if s == 0 else FromHidden(c), s,
                                       num_stages, torch.device("cpu"), group=group)
              for c, s in zip(chunks, stage_indices)]
    cls = getattr(pipelining, cls_name)
    # loss_fn is the per-microbatch mean; scale_grads=True (the default) divides the summed
    # gradients by n_microbatches at the end: the global-batch mean, as ours.
    schedule = cls(stages[0] if len(stages) == 1 and cls_name == "Schedule1F1B" else stages,
                   n_microbatches=microbatches, loss_fn=loss_fn)
    first = 0 in stage_indices
    last = num_stages - 1 in stage_indices

    def step(trace=None):
        losses = []
        # return_outputs=False: ours returns no logits either.
        with plain_linear_layers(), traced_peer(schedule, stages, trace):
            args = (inputs,) if first else ()
            extra = dict(target=labels, losses=losses) if last else {}
            schedule.step(*args, return_outputs=False, **extra)
        return losses

    return step


@contextlib.contextmanager
def traced_peer(schedule, stages, trace):
    """Record torch's steps in a PipelineTrace the way ours records its own: forward (and the
    loss), backward (B: the input gradient under the zero-bubble schedules, else the whole
    backward), W (backward_weight_one_chunk) and waits on communication; the chunk of a step
    is the index of its stage in this rank's list (ours' numbering: 1 = the V's second arm)."""
    if trace is None:
        yield
        return
    import torch.distributed.pipelining.schedules as torch_schedules

    wait = torch_schedules._wait_batch_p2p
    compute_loss = schedule._maybe_compute_loss
    chunk_of = {id(stage): chunk for chunk, stage in enumerate(stages)}

    def traced(kind, fn, chunk):
        def run(microbatch, *a, **k):
            with trace.span(kind, microbatch, chunk):
                return fn(microbatch, *a, **k)
        return run

    def traced_loss(stage, output, target_mbs, mb_index, *a, **k):
        with trace.span(FORWARD, mb_index, chunk_of[id(stage)]):
            return compute_loss(stage, output, target_mbs, mb_index, *a, **k)

    def traced_wait(work):
        if not work:
            return wait(work)
        with trace.span(WAIT):
            return wait(work)

    for chunk, stage in enumerate(stages):
        stage.forward_one_chunk = traced(FORWARD, stage.forward_one_chunk, chunk)
        stage.backward_one_chunk = traced(BACKWARD, stage.backward_one_chunk, chunk)
        stage.backward_weight_one_chunk = traced(WEIGHT, stage.backward_weight_one_chunk, chunk)
    schedule._maybe_compute_loss = traced_loss
    torch_schedules._wait_batch_p2p = traced_wait
    try:
        yield
    finally:
        for stage in stages:
            del stage.forward_one_chunk, stage.backward_one_chunk
            del stage.backward_weight_one_chunk
        del schedule._maybe_compute_loss
        torch_schedules._wait_batch_p2p = wait
