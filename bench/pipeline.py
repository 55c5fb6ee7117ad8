"""Pipeline parallel, PP=2: our 1F1B, ZB-H1 and ZB-V schedules vs torch.distributed.pipelining's
Schedule1F1B, ScheduleInterleavedZeroBubble, ScheduleZBVZeroBubble and ScheduleDualPipeV.

    python3 bench/pipeline.py [--schedule all | 1f1b,zb-h1,zbv,torch-1f1b,torch-zb,torch-zbv,
                              torch-dualpipev] [--layers 4 --hidden 384 --seq 128
                              --micro-batch-size 2 --microbatches 8 --steps 10 --warmup 2]
                             [--trace-dir DIR] [--png-dir docs]
    torchrun --nproc-per-node 2 bench/pipeline.py [...]      (same, launched by torchrun)

Two processes (gloo, one thread each). Each builds, once, two layouts of the same LLaMA (the
same weights: every layer's initial weights depend only on its layer number):

- the loop: one chunk per rank, layers split evenly over the 2 stages, for ours 1F1B and ZB-H1
  and torch's Schedule1F1B and ScheduleInterleavedZeroBubble (one stage per rank);
- the V: two chunks per rank, 4 virtual stages, rank r holding stages r and 3-r (the embedding
  and the output layer both on rank 0), for ours zbv and torch's ZBV and DualPipeV.

The split is balanced: at the default sizes the output layer and loss (vocab 512) cost about a
ninth of a layer, so each rank computes about two layers in either layout (with a large vocab
the rank holding the output layer is the slowest and the others idle: not what is compared).

Every schedule on a layout runs the SAME module objects on the SAME microbatches (global batch
= microbatches x micro batch, split along the batch dimension). Torch's schedules run those
modules with their linear layers computed through plain autograd (see bench/pipeline_peer.py:
torch's split backward cannot split our custom autograd linear; the forward GEMM is the same).
Gradients only (no optimizer step; grads are zeroed between steps). After warmup, the
schedules alternate step by step; each step starts after a barrier and lasts until the slower
rank is done. A one-time gradient check runs every schedule from zero grads and compares each
parameter's gradient (by its layer number in the whole model) with ours 1F1B's. The bubble
comes from separate, untimed traced steps: ours records a PipelineTrace itself (forward, B, W,
waits); torch's steps are recorded into one by wrapping its stages' forward/backward/weight
steps, its loss and its waits on communication.
"""
import argparse
import contextlib
import os
import re
import sys
import time
from functools import partial

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir))

from bench.launch import launch  # noqa: E402
from bench.pipeline_peer import (  # noqa: E402
    TORCH_SCHEDULES,
    available_torch_schedules,
    peer_step_fn,
)
from bench.pipeline_report import report  # noqa: E402
from megatron.core import parallel_state  # noqa: E402
from megatron.core.models.llama import LlamaModel, llama_config  # noqa: E402
from megatron.core.pipeline_parallel import (  # noqa: E402
    PipelineTrace,
    build_model_chunks,
    get_forward_backward_func,
)
from megatron.core.pipeline_placement import LOOP, V  # noqa: E402

PP = 2
OURS = ("1f1b", "zb-h1", "zbv")
V_LAYOUT = {"zbv"} | {name for name, (_, v) in TORCH_SCHEDULES.items() if v}


def all_schedules():
    return list(OURS) + available_torch_schedules()


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--schedule", default="all",
                   help="comma-separated names, or 'all' (default); ours 1f1b always runs: "
                        "it is the reference of the ratios and the gradient check")
    p.add_argument("--layers", type=int, default=4, help="a multiple of 4 (the V's stages)")
    p.add_argument("--hidden", type=int, default=384)
    p.add_argument("--heads", type=int, default=6)
    p.add_argument("--groups", type=int, default=2, help="query groups (GQA)")
    p.add_argument("--ffn", type=int, default=1024)
    p.add_argument("--vocab", type=int, default=512,
                   help="small, so the output layer (1/9 of a layer at the default sizes) "
                        "leaves the stages balanced")
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--micro-batch-size", type=int, default=2)
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--steps", type=int, default=10, help="timed steps per schedule")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per schedule")
    p.add_argument("--trace-steps", type=int, default=3,
                   help="separate untimed steps of each, traced (bubble)")
    p.add_argument("--trace-dir", default=None,
                   help="write every traced step as DIR/<schedule>/step<k>/trace_rank*.json "
                        "(tools/plot_pipeline.py draws one such directory)")
    p.add_argument("--png-dir", default=None,
                   help="draw the last traced step of each of our schedules into DIR")
    p.add_argument("--profile", default=None,
                   help="directory: cProfile each rank's timed steps of every schedule")
    args = p.parse_args(argv)
    names = all_schedules() if args.schedule == "all" else args.schedule.split(",")
    unknown = [n for n in names if n not in all_schedules()]
    if unknown:
        p.error(f"unknown schedule(s) {unknown}; this torch offers {all_schedules()}")
    args.schedules = ["1f1b"] + [n for n in dict.fromkeys(names) if n != "1f1b"]
    if args.layers % (2 * PP):
        p.error(f"--layers must be a multiple of {2 * PP} (one split for the loop and the V)")
    return args


# --- model and data -------------------------------------------------------------------------

@contextlib.contextmanager
def layout(v_shaped):
    """parallel_state's virtual size and placement for the V (2 chunks per rank) inside the
    block, none (one chunk, the loop) outside: the two layouts share the process groups, and
    the executor and the stage queries read these two settings."""
    if not v_shaped:
        yield
        return
    parallel_state._VIRTUAL_PIPELINE_WORLD_SIZE = 2
    parallel_state._VIRTUAL_PIPELINE_RANK = 0
    parallel_state.set_pipeline_placement(V)
    try:
        yield
    finally:
        parallel_state._VIRTUAL_PIPELINE_WORLD_SIZE = None
        parallel_state._VIRTUAL_PIPELINE_RANK = None
        parallel_state.set_pipeline_placement(LOOP)


def build_chunks(args, v_shaped):
    config = llama_config(
        num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=args.heads,
        num_query_groups=args.groups, ffn_hidden_size=args.ffn,
        max_position_embeddings=args.seq, pipeline_model_parallel_size=PP,
        virtual_pipeline_model_parallel_size=2 if v_shaped else None,
        pipeline_schedule="zbv" if v_shaped else "1f1b")
    torch.manual_seed(0)  # same on both ranks and layouts: a layer's weights follow its number

    def provider(pre_process, post_process, layer_range):
        return LlamaModel(config, args.vocab, pre_process=pre_process,
                          post_process=post_process, layer_range=layer_range)

    with layout(v_shaped):
        chunks = build_model_chunks(provider, config)
    return [c.train() for c in chunks], config


def global_batch(args):
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, args.vocab, (args.microbatches * args.micro_batch_size,
                                           args.seq + 1), generator=g)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def cross_entropy(logits, labels):
    return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), labels.reshape(-1))


def global_name(chunk, name):
    """The parameter's name in the whole model (its layer numbered as on one process)."""
    return re.sub(r"^decoder\.layers\.(\d+)\.",
                  lambda m: f"decoder.layers.{int(m.group(1)) + chunk.decoder.layer_offset}.",
                  name)


# --- ours -----------------------------------------------------------------------------------

def ours_step_fn(args, schedule, chunks, config, inputs, labels):
    forward_backward = get_forward_backward_func_for(len(chunks))
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
        config.pipeline_schedule = schedule  # the loop's chunks serve 1f1b and zb-h1
        iterators = [iter(microbatches) for _ in chunks]
        results = forward_backward(
            forward_step_func=forward_step_func,
            data_iterator=iterators if len(chunks) > 1 else iterators[0], model=chunks,
            num_microbatches=args.microbatches, seq_length=args.seq, micro_batch_size=b,
            trace=trace)
        return [r["loss"] for r in results]

    return step


def get_forward_backward_func_for(num_chunks):
    with layout(num_chunks > 1):
        return get_forward_backward_func()


# --- measurement ----------------------------------------------------------------------------

def make_steps(args, rank, inputs, labels):
    """name -> (v_shaped, chunks, step function) for every schedule asked for."""
    layouts = {False: build_chunks(args, False)}
    if any(name in V_LAYOUT for name in args.schedules):
        layouts[True] = build_chunks(args, True)
    group = parallel_state.get_pipeline_model_parallel_group()
    steps = {}
    for name in args.schedules:
        v_shaped = name in V_LAYOUT
        chunks, config = layouts[v_shaped]
        if name in OURS:
            fn = ours_step_fn(args, name, chunks, config, inputs, labels)
        else:
            stage_indices = [rank, 2 * PP - 1 - rank] if v_shaped else [rank]
            with layout(v_shaped):
                fn = peer_step_fn(name, chunks, stage_indices, len(chunks) * PP, group,
                                  args.microbatches, inputs, labels, cross_entropy)
        steps[name] = (v_shaped, chunks, fn)
    return steps


def zero_grads(chunks):
    for chunk in chunks:
        for p in chunk.parameters():
            p.grad = None


def run(entry, **kwargs):
    v_shaped, chunks, fn = entry
    with layout(v_shaped):
        result = fn(**kwargs)
    zero_grads(chunks)
    return result


def timed(entry, profiler=None):
    dist.barrier()
    start = time.perf_counter()
    if profiler is not None:
        profiler.enable()
    run(entry)
    if profiler is not None:
        profiler.disable()
    return time.perf_counter() - start


def gradient_check(args, rank, steps):
    """name -> (max |diff| to ours 1F1B over all gradients, max of that relative to each
    tensor's largest entry, bitwise equal, mean loss), on rank 0; one step each from zero
    grads, one schedule's gradients gathered at a time."""
    reference, results = None, {}
    for name, (v_shaped, chunks, fn) in steps.items():
        zero_grads(chunks)
        with layout(v_shaped):
            losses = fn()
        grads = {global_name(c, n): p.grad.clone() for c in chunks
                 for n, p in c.named_parameters()}
        zero_grads(chunks)
        mine = (grads, [float(l.detach()) for l in losses])
        gathered = [None] * PP
        dist.all_gather_object(gathered, mine)
        if rank != 0:
            continue
        merged = {k: g for rank_grads, _ in gathered for k, g in rank_grads.items()}
        all_losses = [l for _, rank_losses in gathered for l in rank_losses]
        loss = sum(all_losses) / len(all_losses)
        if reference is None:
            reference = merged
        assert merged.keys() == reference.keys(), f"{name}: not the same parameters"
        diffs = [(merged[k] - reference[k]).abs().max().item() for k in reference]
        relative = [d / max(reference[k].abs().max().item(), 1e-30)
                    for d, k in zip(diffs, reference)]
        bitwise = all(torch.equal(merged[k], reference[k]) for k in reference)
        results[name] = (max(diffs), max(relative), bitwise, loss)
    return results


def trace_info(args, rank, name, v_shaped, k):
    return dict(tensor_rank=0, data_rank=0, world_size=PP, pipeline_size=PP,
                virtual_size=2 if v_shaped else None, num_microbatches=args.microbatches,
                iteration=k, run_id=name)


def run_rank(rank, world_size, args):
    torch.set_num_threads(1)
    parallel_state.initialize_model_parallel(1, PP)
    inputs, labels = global_batch(args)
    steps = make_steps(args, rank, inputs, labels)

    first = {}  # the first step of each: torch infers its stage shapes there
    for _ in range(max(args.warmup, 1)):
        for name, entry in steps.items():
            first.setdefault(name, timed(entry))
    check = gradient_check(args, rank, steps)

    profilers = None
    if args.profile:
        import cProfile
        profilers = {name: cProfile.Profile() for name in steps}
    times = {name: [] for name in steps}
    for _ in range(args.steps):
        for name, entry in steps.items():
            times[name].append(timed(entry, profilers[name] if profilers else None))
    if profilers:
        os.makedirs(args.profile, exist_ok=True)
        for name, prof in profilers.items():
            prof.dump_stats(os.path.join(args.profile, f"{name}_rank{rank}.prof"))

    # Separate, untimed traced steps of each (alternating): the measured bubble.
    traces = {name: [] for name in steps}
    for k in range(args.trace_steps):
        for name, entry in steps.items():
            trace = PipelineTrace(rank, rank, trace_info(args, rank, name, entry[0], k))
            dist.barrier()
            run(entry, trace=trace)
            traces[name].append(trace.to_dict())

    mine = {"rank": rank, "times": times, "traces": traces, "first": first}
    gathered = [None] * world_size
    dist.all_gather_object(gathered, mine)
    if rank == 0:
        report(args, gathered, check)
    parallel_state.destroy_model_parallel()


# --- launch ---------------------------------------------------------------------------------

def main():
    args = parse_args()
    launch(run_rank, PP, args, "bench/pipeline.py", threads=1)


if __name__ == "__main__":
    main()
