"""Context parallel attention, CP=2 on 2 processes (ring ``p2p`` and ``all_gather``) vs CP=1
on one process (torch SDPA) at the same sequence length.

    python3 bench/context_parallel.py [--seqs 2048,4096 --batch 1 --heads 8 --kv-heads 2
                                      --head-dim 64 --steps 5 --warmup 1 --trace-steps 2]
    torchrun --nproc-per-node 2 bench/context_parallel.py [...]      (same, under torchrun)

Two processes (gloo, one thread each). One attention core, fp32, causal, GQA: q [b, hq, s, d],
k/v [b, hkv, s, d] -> out, forward + backward (``torch.autograd.grad(out, (q, k, v), dout)``).
Every rank builds the same full q, k, v, dout (fixed seed); CP=2 ranks take their
load-balanced shards (``shard_sequence``) and run ``context_parallel_attention`` over the
world group; CP=1 is what the model runs at CP=1,
``F.scaled_dot_product_attention(is_causal=True, enable_gqa=True)`` on the full sequence, on
rank 0 while rank 1 waits. After warmup the three alternate step by
step, each step after a barrier; a CP=2 step lasts until the slower rank is done. Medians.

Memory (a separate, untimed step of each): bytes saved for backward (autograd's
saved_tensors_hooks, distinct storages, the inputs q, k, v included), and the aten
allocations made inside the step (tests/allocation_tracker.py: peak bytes alive at once, in
forward and in forward + backward, and the transient peak, which leaves out what outlives the
step: out and the grads; not seen: gloo's own staging buffers and the scratch the
flash kernel allocates inside itself). Overlap (further untimed, traced steps): see
bench/context_parallel_trace.py. A correctness check compares the CP=2 outputs and grads,
unsharded, with CP=1's.
"""
import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir))

from bench.context_parallel_report import report  # noqa: E402
from bench.context_parallel_trace import (  # noqa: E402
    KV_TAG,
    RingTrace,
    final_hop,
    ring_overlap,
    timed_all_gather,
    traced_ring,
)
from bench.launch import launch  # noqa: E402
from megatron.core.transformer.context_parallel import (  # noqa: E402
    context_parallel_attention,
    shard_sequence,
    unshard_sequence,
)
from megatron.core.transformer.context_parallel.blocks import CPLayout  # noqa: E402
from megatron.core.transformer.context_parallel.ring import _exchange  # noqa: E402
from tests.allocation_tracker import track_allocations  # noqa: E402

CP = 2
CONTENDERS = ("cp1", "p2p", "all_gather")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seqs", default="2048,4096", help="comma-separated sequence lengths")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=2, help="key/value heads (GQA)")
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--steps", type=int, default=5, help="timed steps per contender")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps per contender")
    p.add_argument("--trace-steps", type=int, default=2,
                   help="separate untimed traced steps of p2p and all_gather (overlap)")
    p.add_argument("--exchange-reps", type=int, default=5,
                   help="isolated K/V exchanges timed without compute (the comm cost)")
    args = p.parse_args(argv)
    args.seqs = [int(s) for s in args.seqs.split(",") if s.strip()]
    bad = [s for s in args.seqs if s % (2 * CP)]
    if bad or not args.seqs:
        p.error(f"--seqs: each must be a multiple of 2*CP = {2 * CP}, got {bad or 'none'}")
    if args.heads % args.kv_heads:
        p.error(f"--heads {args.heads} is not a multiple of --kv-heads {args.kv_heads}")
    return args


# --- inputs and one step of each contender ----------------------------------------------------

def full_inputs(args, seq):
    """q, k, v, dout on the whole sequence; the same on every rank."""
    g = torch.Generator().manual_seed(seq)
    b, d = args.batch, args.head_dim
    return (torch.randn(b, args.heads, seq, d, generator=g),
            torch.randn(b, args.kv_heads, seq, d, generator=g),
            torch.randn(b, args.kv_heads, seq, d, generator=g),
            torch.randn(b, args.heads, seq, d, generator=g))


def step_fns(args, seq, rank):
    """{contender: fn(forward_only_hook=None) -> (out, [dq, dk, dv]) or None where idle}."""
    q, k, v, dout = full_inputs(args, seq)
    local = [shard_sequence(t, 2, CP, rank) for t in (q, k, v, dout)]

    def run(tensors, attention, after_forward):
        leaves = [t.detach().requires_grad_() for t in tensors[:3]]
        out = attention(*leaves)
        if after_forward is not None:
            after_forward()
        # autograd.grad, not backward: no AccumulateGrad copy into .grad (q, k, v are not
        # leaves in a model), so the memory figures are attention's own
        grads = torch.autograd.grad(out, leaves, tensors[3])
        return out.detach(), list(grads)

    def cp1(after_forward=None):
        if rank != 0:
            return None  # CP=1 runs on one process; this one waits at the next barrier
        return run((q, k, v, dout), lambda *t: F.scaled_dot_product_attention(
            *t, is_causal=True, enable_gqa=args.heads != args.kv_heads), after_forward)

    def cp2(comm_type):
        def step(after_forward=None):
            return run(local, lambda *t: context_parallel_attention(
                *t, group=dist.group.WORLD, comm_type=comm_type), after_forward)
        return step

    return {"cp1": cp1, "p2p": cp2("p2p"), "all_gather": cp2("all_gather")}


# --- measurements ------------------------------------------------------------------------------

def timed(fn):
    """(wall seconds, this process's CPU seconds) of one step, started after a barrier."""
    dist.barrier()
    start, cpu = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - start, time.process_time() - cpu


def check_against_cp1(fns, rank):
    """Max |diff| of CP=2's unsharded out, dq, dk, dv against CP=1's, per comm type (rank 0)."""
    reference = fns["cp1"]()
    errors = {}
    for name in ("p2p", "all_gather"):
        out, grads = fns[name]()
        shards = [None] * CP
        dist.all_gather_object(shards, [out] + grads)
        if rank == 0:
            got = [unshard_sequence([s[i] for s in shards], 2) for i in range(4)]
            want = [reference[0]] + reference[1]
            errors[name] = [(a - b).abs().max().item() for a, b in zip(got, want)]
    return errors


def _peak(events, upto=None):
    """Most bytes alive at once among the recorded allocations (all of them, kept or not)."""
    sizes, live, peak = {}, 0, 0
    for event in events[:upto]:
        if event[0] == "alloc":
            sizes[event[1]] = event[2]
            live += event[2]
        else:
            live -= sizes.get(event[1], 0)
        peak = max(peak, live)
    return peak, live


def memory_of(fn):
    """Saved-for-backward bytes (distinct storages) and aten allocation peaks of one step."""
    storages = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    marks = {}
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        with track_allocations() as track:
            result = fn(after_forward=lambda: marks.setdefault("forward", len(track.events)))
        track.finish()
    if result is None:
        return None
    forward_peak, after_forward = _peak(track.events, marks["forward"])
    step_peak, _ = _peak(track.events)
    return {"saved": sum(storages.values()), "forward_peak": forward_peak,
            "alive_after_forward": after_forward, "step_peak": step_peak,
            "transient_peak": track.peak_temporary}


def exchange_time(args, seq, rank):
    """Median seconds of one ring hop of this size with nothing to hide it behind: post the
    batched isend/irecv of a K/V message and wait at once (dK/dV has the same size in fp32)."""
    layout = CPLayout(dist.group.WORLD, rank, CP, list(range(CP)), [])
    message = torch.randn(2, args.batch, args.kv_heads, seq // CP, args.head_dim)
    incoming = torch.empty_like(message)
    times = []
    for _ in range(args.exchange_reps):
        dist.barrier()
        start = time.perf_counter()
        for work in _exchange(message, incoming, layout, KV_TAG):
            work.wait()
        times.append(time.perf_counter() - start)
    return statistics.median(times), message.numel() * message.element_size()


def traced(fns, args):
    """Per traced step: the ring's overlap summaries and all_gather's collective seconds."""
    ring, gather = [], []
    for _ in range(args.trace_steps):
        trace = RingTrace()
        dist.barrier()
        with traced_ring(trace):
            fns["p2p"]()
        summary = {phase: ring_overlap(trace, phase) for phase in ("forward", "backward")}
        ring.append({**summary, "final_hop": final_hop(trace)})
        spans = []
        dist.barrier()
        with timed_all_gather(spans):
            start = time.perf_counter()
            fns["all_gather"]()
            total = time.perf_counter() - start
        gather.append({"collectives": sum(s for _, s in spans), "calls": len(spans),
                       "step": total})
    return ring, gather


def measure_seq(args, seq, rank):
    fns = step_fns(args, seq, rank)
    for _ in range(args.warmup):
        for name in CONTENDERS:
            timed(fns[name])
    check = check_against_cp1(fns, rank)
    times = {name: [] for name in CONTENDERS}
    for _ in range(args.steps):
        for name in CONTENDERS:  # alternating: each round sees about the same machine load
            times[name].append(timed(fns[name]))
    dist.barrier()
    memory = {name: memory_of(fns[name]) for name in CONTENDERS}
    ring, gather = traced(fns, args)
    exchange = exchange_time(args, seq, rank)
    return {"rank": rank, "times": times, "check": check, "memory": memory, "ring": ring,
            "gather": gather, "exchange": exchange}


def run_rank(rank, world_size, args):
    torch.set_num_threads(1)
    results = {}
    for seq in args.seqs:
        mine = measure_seq(args, seq, rank)
        gathered = [None] * world_size
        dist.all_gather_object(gathered, mine)
        results[seq] = gathered
    if rank == 0:
        report(args, results)


def main():
    args = parse_args()
    launch(run_rank, CP, args, "bench/context_parallel.py", threads=1)


if __name__ == "__main__":
    main()
