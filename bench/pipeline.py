"""Pipeline parallel, PP=2: our 1F1B schedule vs torch.distributed.pipelining.Schedule1F1B.

    python bench/pipeline.py [--layers 4 --hidden 384 --seq 128 --micro-batch-size 2
                              --microbatches 8 --steps 10 --warmup 2]
    torchrun --nproc-per-node 2 bench/pipeline.py [...]      (same, launched by torchrun)

Two processes (gloo, one thread each) each hold one half of a LLaMA stack, built once with
``build_model_chunks``. Both schedules run the SAME module objects on the SAME microbatches
(global batch = microbatches x micro batch, split along the batch dimension), so the compute is
identical and only the schedule and its communication differ. Gradients only (no optimizer
step; grads are zeroed between steps). After warmup, the schedules alternate step by step; each
step starts after a barrier and lasts until the slower rank is done. Prints the median step
time and tokens/s of each, the ratio, a one-time gradient check (ours vs torch from zero grads),
and the measured bubble fraction next to the theoretical (p-1)/(m+p-1). The bubble comes from
separate, untimed traced steps: ours records a PipelineTrace itself; torch's steps are recorded
into one by wrapping its stage's forward/backward, its loss and its waits on communication.
"""
import argparse
import contextlib
import os
import statistics
import sys
import time
from functools import partial

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir))

from bench.launch import launch  # noqa: E402
from megatron.core import parallel_state  # noqa: E402
from megatron.core.models.llama import LlamaModel, llama_config  # noqa: E402
from megatron.core.pipeline_parallel import (  # noqa: E402
    PipelineTrace,
    build_model_chunks,
    get_forward_backward_func,
    stage_layer_counts,
)
from megatron.core.pipeline_parallel.trace import BACKWARD, FORWARD, WAIT  # noqa: E402

PP = 2


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=384)
    p.add_argument("--heads", type=int, default=6)
    p.add_argument("--groups", type=int, default=2, help="query groups (GQA)")
    p.add_argument("--ffn", type=int, default=1024)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--micro-batch-size", type=int, default=2)
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--last-stage-layers", type=int, default=None,
                   help="layers on the last stage (default: an even split)")
    p.add_argument("--steps", type=int, default=10, help="timed steps per schedule")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per schedule")
    p.add_argument("--trace-steps", type=int, default=3,
                   help="separate untimed steps of each, traced (bubble)")
    p.add_argument("--profile", default=None,
                   help="directory: cProfile each rank's timed steps of both schedules")
    return p.parse_args(argv)


# --- model and data -------------------------------------------------------------------------

def build_stage(args):
    config = llama_config(
        num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=args.heads,
        num_query_groups=args.groups, ffn_hidden_size=args.ffn,
        max_position_embeddings=args.seq, pipeline_model_parallel_size=PP,
        num_layers_in_last_pipeline_stage=args.last_stage_layers)
    torch.manual_seed(0)  # same on both ranks: each layer's weights do not depend on the split

    def provider(pre_process, post_process, layer_range):
        return LlamaModel(config, args.vocab, pre_process=pre_process,
                          post_process=post_process, layer_range=layer_range)

    (model,) = build_model_chunks(provider, config)
    return model.train(), config


def global_batch(args):
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, args.vocab, (args.microbatches * args.micro_batch_size,
                                           args.seq + 1), generator=g)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def cross_entropy(logits, labels):
    return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), labels.reshape(-1))


# --- ours -----------------------------------------------------------------------------------

def ours_step_fn(args, model, inputs, labels):
    forward_backward = get_forward_backward_func()
    b = args.micro_batch_size
    microbatches = [{"tokens": inputs[i * b:(i + 1) * b], "labels": labels[i * b:(i + 1) * b]}
                    for i in range(args.microbatches)]

    def loss_func(mb_labels, logits):
        loss = cross_entropy(logits, mb_labels)
        return loss, {"loss": loss.detach()}

    def forward_step_func(data_iterator, chunk):
        batch = next(data_iterator)
        tokens = batch["tokens"] if chunk.pre_process else None
        return chunk(tokens), partial(loss_func, batch["labels"])

    def step(trace=None):
        return forward_backward(forward_step_func=forward_step_func,
                                data_iterator=iter(microbatches), model=[model],
                                num_microbatches=args.microbatches, seq_length=args.seq,
                                micro_batch_size=b, trace=trace)

    return step


# --- peer: torch.distributed.pipelining -------------------------------------------------------

class FirstStage(torch.nn.Module):
    """Token ids [b, s] -> hidden [s, b, h]."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, tokens):
        return self.model(tokens)


class LastStage(torch.nn.Module):
    """Hidden [s, b, h] from the previous stage -> logits [b, s, vocab]."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, hidden):
        self.model.set_input_tensor(hidden)
        return self.model(None)


def peer_step_fn(args, model, inputs, labels):
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    rank = parallel_state.get_pipeline_model_parallel_rank()
    module = FirstStage(model) if rank == 0 else LastStage(model)
    stage = PipelineStage(module, stage_index=rank, num_stages=PP, device=torch.device("cpu"),
                          group=parallel_state.get_pipeline_model_parallel_group())
    # loss_fn is the per-microbatch mean; scale_grads=True (the default) divides the summed
    # gradients by n_microbatches at the end: the global-batch mean, as ours.
    schedule = Schedule1F1B(stage, n_microbatches=args.microbatches, loss_fn=cross_entropy)

    def step(trace=None):
        # return_outputs=False: ours returns no logits either (torch would otherwise keep
        # every microbatch's logits and concatenate them).
        with traced_peer(schedule, stage, trace):
            if rank == 0:
                schedule.step(inputs, return_outputs=False)
                return []
            losses = []
            schedule.step(target=labels, losses=losses, return_outputs=False)
            return losses

    return step


@contextlib.contextmanager
def traced_peer(schedule, stage, trace):
    """Record torch's steps in a PipelineTrace the way ours records its own: forward (and the
    loss), backward, and waits on communication."""
    if trace is None:
        yield
        return
    import torch.distributed.pipelining.schedules as torch_schedules

    forward, backward = stage.forward_one_chunk, stage.backward_one_chunk
    compute_loss, wait = schedule._maybe_compute_loss, torch_schedules._wait_batch_p2p

    def traced(kind, fn, index_arg):
        def run(*a, **k):
            with trace.span(kind, a[index_arg], 0):
                return fn(*a, **k)
        return run

    def traced_wait(work):
        if not work:
            return wait(work)
        with trace.span(WAIT):
            return wait(work)

    stage.forward_one_chunk = traced(FORWARD, forward, 0)
    stage.backward_one_chunk = traced(BACKWARD, backward, 0)
    schedule._maybe_compute_loss = traced(FORWARD, compute_loss, 3)
    torch_schedules._wait_batch_p2p = traced_wait
    try:
        yield
    finally:
        del stage.forward_one_chunk, stage.backward_one_chunk, schedule._maybe_compute_loss
        torch_schedules._wait_batch_p2p = wait


# --- measurement ----------------------------------------------------------------------------

def zero_grads(model):
    for p in model.parameters():
        p.grad = None


def check_same_gradients(model, ours_step, peer_step):
    """One step of each from zero grads; returns (max abs diff, all close, loss ours, peer)."""
    zero_grads(model)
    ours_losses = ours_step()
    ours_grads = [p.grad.clone() for p in model.parameters()]
    zero_grads(model)
    peer_losses = peer_step()
    max_diff, close = 0.0, True
    for g, p in zip(ours_grads, model.parameters()):
        max_diff = max(max_diff, (g - p.grad).abs().max().item())
        close = close and torch.allclose(g, p.grad, rtol=1e-5, atol=0.0)
    zero_grads(model)
    loss_ours = torch.stack([d["loss"] for d in ours_losses]).mean().item() \
        if ours_losses else None
    loss_peer = torch.stack([l.detach() for l in peer_losses]).mean().item() \
        if peer_losses else None
    return max_diff, close, loss_ours, loss_peer


def trace_summary(trace):
    """(bubble fraction, busy seconds, schedule span seconds, seconds in waits)."""
    span = trace.events[-1]["end"] - trace.events[0]["start"]
    waits = sum(e["end"] - e["start"] for e in trace.events if e["kind"] == WAIT)
    return trace.bubble_fraction(), trace.busy_time(), span, waits


def timed(fn, profiler=None):
    dist.barrier()
    start = time.perf_counter()
    if profiler is not None:
        profiler.enable()
    fn()
    if profiler is not None:
        profiler.disable()
    return time.perf_counter() - start


def run_rank(rank, world_size, args):
    torch.set_num_threads(1)
    parallel_state.initialize_model_parallel(1, PP)
    model, config = build_stage(args)
    inputs, labels = global_batch(args)
    ours_step = ours_step_fn(args, model, inputs, labels)
    peer_step = peer_step_fn(args, model, inputs, labels)

    # Warm up both (torch infers shapes on its first step), then check the gradients agree.
    first = {}  # the first step of each: torch infers its stage shapes there
    for _ in range(max(args.warmup, 1)):
        for name, fn in (("ours", ours_step), ("peer", peer_step)):
            elapsed = timed(fn)
            first.setdefault(name, elapsed)
            zero_grads(model)
    check = check_same_gradients(model, ours_step, peer_step)

    profilers = None
    if args.profile:
        import cProfile
        profilers = {"ours": cProfile.Profile(), "peer": cProfile.Profile()}
    times = {"ours": [], "peer": []}
    for _ in range(args.steps):
        for name, fn in (("ours", ours_step), ("peer", peer_step)):
            times[name].append(timed(fn, profilers[name] if profilers else None))
            zero_grads(model)
    if profilers:
        os.makedirs(args.profile, exist_ok=True)
        for name, prof in profilers.items():
            prof.dump_stats(os.path.join(args.profile, f"{name}_rank{rank}.prof"))

    # Separate, untimed traced steps of both (alternating): the measured bubble.
    traces = {"ours": [], "peer": []}
    for _ in range(args.trace_steps):
        for name, fn in (("ours", ours_step), ("peer", peer_step)):
            trace = PipelineTrace(rank=rank, pipeline_rank=rank)
            dist.barrier()
            fn(trace=trace)
            zero_grads(model)
            traces[name].append(trace_summary(trace))

    mine = {"rank": rank, "times": times, "check": check, "traces": traces, "first": first}
    gathered = [None] * world_size
    dist.all_gather_object(gathered, mine)
    if rank == 0:
        report(args, config, gathered)
    parallel_state.destroy_model_parallel()


def report(args, config, per_rank):
    # A step lasts until the slower rank is done.
    step_times = {name: [max(r["times"][name][i] for r in per_rank) for i in range(args.steps)]
                  for name in ("ours", "peer")}
    tokens = args.microbatches * args.micro_batch_size * args.seq
    median = {k: statistics.median(v) for k, v in step_times.items()}
    rate = {k: tokens / v for k, v in median.items()}
    theory = (PP - 1) / (args.microbatches + PP - 1)
    last = per_rank[-1]["check"]
    max_diff = max(r["check"][0] for r in per_rank)
    close = all(r["check"][1] for r in per_rank)
    print("=" * 72)
    print(f"pipeline bench: PP={PP}, gloo, 1 thread/rank, torch {torch.__version__}")
    print(f"model: LLaMA layers={config.num_layers} hidden={config.hidden_size} "
          f"heads={config.num_attention_heads} groups={config.num_query_groups} "
          f"ffn={config.ffn_hidden_size} vocab={args.vocab} seq={args.seq} fp32; layers per "
          f"stage {stage_layer_counts(config.num_layers, PP, None, args.last_stage_layers)}")
    print(f"batch: {args.microbatches} microbatches x {args.micro_batch_size} = "
          f"{tokens} tokens/step; {args.steps} timed steps each (after {args.warmup} warmup)")
    print(f"gradients ours vs torch: max |diff| {max_diff:.3e}, "
          f"allclose(rtol=1e-5): {close}; mean loss ours {last[2]:.6f} torch {last[3]:.6f}")
    for k, label in (("ours", "ours 1F1B"), ("peer", "torch Schedule1F1B")):
        ts = sorted(step_times[k])
        print(f"{label:>20}: median step {median[k] * 1e3:8.1f} ms "
              f"(min {ts[0] * 1e3:.1f}, max {ts[-1] * 1e3:.1f})  {rate[k]:9.1f} tokens/s")
    print(f"ratio ours/torch tokens/s: {rate['ours'] / rate['peer']:.3f}")
    print("first (untimed warmup) step, slower rank: " + ", ".join(
        f"{label} {max(r['first'][k] for r in per_rank) * 1e3:.0f} ms"
        for k, label in (("ours", "ours"), ("peer", "torch"))))
    print(f"traced steps (separate, untimed; median of {args.trace_steps}); bubble = 1 - "
          f"busy / (first event start .. last event end) per rank:")
    bubble = {}
    for k, label in (("ours", "ours"), ("peer", "torch")):
        cols = [[statistics.median(t[i] for t in r["traces"][k]) for i in range(4)]
                for r in per_rank]
        bubble[k] = statistics.mean(c[0] for c in cols)
        print(f"  {label:>5}: " + "; ".join(
            f"rank {i} bubble {c[0]:.3f} busy {c[1] * 1e3:.0f} ms span {c[2] * 1e3:.0f} ms "
            f"waits {c[3] * 1e3:.0f} ms" for i, c in enumerate(cols))
            + f"; mean bubble {bubble[k]:.3f}")
    print(f"bubble theoretical (p-1)/(m+p-1) = {PP - 1}/{args.microbatches + PP - 1} "
          f"= {theory:.3f}")
    print("=" * 72)


# --- launch ---------------------------------------------------------------------------------

def main():
    args = parse_args()
    launch(run_rank, PP, args, "bench/pipeline.py", threads=1)


if __name__ == "__main__":
    main()
