"""Data parallel, DP=2: our DDP (synchronous and overlapped reduction) vs torch's DDP.

    python3 bench/data_parallel.py [--layers 4 --hidden 384 --seq 128 --micro-batch-size 2
                                   --microbatches 4 --bucket-size 1500000 --steps 12]
    torchrun --nproc-per-node 2 bench/data_parallel.py [...]   (same, launched by torchrun)

Two processes (gloo, one compute thread each). Every contender is its own LLaMA instance
(``LlamaModel``) with the same initial weights, trains on the same batches (each rank its half
of the global batch, ``--microbatches`` microbatches of gradient accumulation per rank), and
takes full training steps: zero grads, forward+backward of every microbatch (no gradient sync
but on the last), gradient reduction over DP, global-norm clipping (``--clip-grad``) and a
fused AdamW step with the same parameter groups and hyperparameters. Contenders:

  ours            DistributedDataParallel(overlap_grad_reduce=False): one bucket, reduced in
                  finalize_model_grads after the last backward;
  ours-overlap    overlap_grad_reduce=True, --bucket-size elements per bucket: each bucket's
                  all-reduce launched from the backward hooks of the last microbatch;
  ours-overlap-default   overlap_grad_reduce=True with Megatron's default bucket size
                  (max(40M, 1M x DP) elements: one bucket for this model);
  torch           torch.nn.parallel.DistributedDataParallel, default bucket_cap_mb (25);
  torch-matched   the same with bucket_cap_mb matched to --bucket-size.

Ours runs the real path: get_forward_backward_func() (no_sync held for every microbatch but
the last), config.finalize_model_grads_func = finalize_model_grads (wrapped in a timer),
get_megatron_optimizer() and optimizer.step(). Torch runs the idiomatic loop: no_sync()
around the non-final microbatches, clip_grad_norm_ (when --clip-grad > 0), and
torch.optim.AdamW(fused=True) on the same parameter groups (no weight decay on norms).
Torch's DDP: gradient_as_bucket_view=True and optimizer.zero_grad(set_to_none=False), so its
grads stay views into its buckets (no copies; --torch-no-grad-view / --torch-set-to-none
measured within noise of it), no buffer sync in forward (the only buffer, rotary inv_freq,
never changes; ours does not sync buffers either).

Before timing, each contender takes one step from the same start on the same batch and the
parameters are compared (max |diff| against ``ours``). After warmup the contenders alternate
step by step; each timed step starts after a barrier and lasts until the slower rank is done.
Prints the median step time, tokens/s and CPU time (both processes, all threads) of each; the
median time per phase: zero grads, the no-sync microbatches, the last microbatch (with the
overlapped reduction), the wait for the reduction after backward (finalize_model_grads; torch's
reducer waits inside the last backward, so its wait is part of "last microbatch"), clip +
optimizer; and the ratios ours/torch and overlapped/non-overlapped, both as the ratio of the
medians and as the median of the per-round ratios (each round runs the contenders back to
back, so they share the load of the rest of the machine). With --clip-grad 0 all contenders'
parameters are bitwise equal after the check step; with clipping they differ by ~6e-8 (the
global norm and clip coefficient are rounded differently: fp32 tensors in torch, a Python
float in ours).
"""
import argparse
import contextlib
import copy
import inspect
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir))

from bench.launch import launch  # noqa: E402
from megatron.core import parallel_state  # noqa: E402
from megatron.core.distributed import (  # noqa: E402
    DistributedDataParallel,
    DistributedDataParallelConfig,
    finalize_model_grads,
)
from megatron.core.models import LlamaModel, llama_config  # noqa: E402
from megatron.core.optimizer import (  # noqa: E402
    OptimizerConfig,
    get_megatron_optimizer,
    get_param_groups,
)
from megatron.core.pipeline_parallel import get_forward_backward_func  # noqa: E402

DP = 2
ADAM = dict(lr=1e-3, weight_decay=0.1, adam_beta1=0.9, adam_beta2=0.95, adam_eps=1e-8)
CONTENDERS = ("ours", "ours-overlap", "ours-overlap-default", "torch", "torch-matched")


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
    p.add_argument("--microbatches", type=int, default=4, help="per rank, per step")
    p.add_argument("--bucket-size", type=int, default=1_500_000,
                   help="elements per bucket for ours-overlap (default: 6 buckets here)")
    p.add_argument("--torch-bucket-cap-mb", type=float, default=25.0,
                   help="bucket_cap_mb of the 'torch' contender (torch's default)")
    p.add_argument("--torch-no-grad-view", action="store_true",
                   help="torch DDP with gradient_as_bucket_view=False (default True)")
    p.add_argument("--torch-set-to-none", action="store_true",
                   help="torch: optimizer.zero_grad(set_to_none=True) (default False)")
    p.add_argument("--clip-grad", type=float, default=1.0,
                   help="global-norm clipping for all contenders (0: none)")
    p.add_argument("--contenders", default=",".join(CONTENDERS),
                   help=f"comma-separated subset of {','.join(CONTENDERS)}")
    p.add_argument("--steps", type=int, default=12, help="timed steps per contender")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per contender")
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--profile", default=None,
                   help="directory: cProfile each rank's timed steps of each contender")
    args = p.parse_args(argv)
    args.contenders = [c.strip() for c in args.contenders.split(",") if c.strip()]
    unknown = sorted(set(args.contenders) - set(CONTENDERS))
    if unknown or not args.contenders:
        p.error(f"--contenders: unknown {unknown}; choose from {','.join(CONTENDERS)}")
    return args


# --- model and data -------------------------------------------------------------------------

def model_config(args):
    return llama_config(num_layers=args.layers, hidden_size=args.hidden,
                        num_attention_heads=args.heads, num_query_groups=args.groups,
                        ffn_hidden_size=args.ffn, max_position_embeddings=args.seq)


def build_model(args, config, initial_state):
    torch.manual_seed(0)
    model = LlamaModel(config, args.vocab)
    model.load_state_dict(initial_state)
    return model.train()


def batches(args, count):
    """``count`` global batches; this rank's microbatches of each: [(tokens, labels), ...]."""
    rank = parallel_state.get_data_parallel_rank()
    b, m = args.micro_batch_size, args.microbatches
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(count):
        data = torch.randint(0, args.vocab, (DP * m * b, args.seq + 1), generator=g)
        mine = data[rank * m * b:(rank + 1) * m * b]
        out.append([(mine[i * b:(i + 1) * b, :-1].contiguous(),
                     mine[i * b:(i + 1) * b, 1:].contiguous()) for i in range(m)])
    return out


def loss_func(per_token_loss):
    loss = per_token_loss.mean()
    return loss, {"lm loss": loss.detach()}


# --- contenders -----------------------------------------------------------------------------

PHASES = ("zero grads", "microbatches 1..n-1", "last microbatch", "reduce wait", "optimizer")


def phases(start, marks, end):
    """Seconds in each of PHASES, from the step's marks."""
    points = [start, marks["accumulate"], marks["last"], marks["reduce"], marks["optimizer"],
              end]
    return [b - a for a, b in zip(points, points[1:])]


def ours_contender(args, config, initial_state, overlap, bucket_size):
    config = copy.copy(config)  # this contender's own finalize hook (timed below)
    marks = {}

    def finalize(model_chunks):
        marks["reduce"] = time.perf_counter()
        finalize_model_grads(model_chunks)
        marks["optimizer"] = time.perf_counter()

    config.finalize_model_grads_func = finalize
    model = DistributedDataParallel(
        config, DistributedDataParallelConfig(overlap_grad_reduce=overlap,
                                              bucket_size=bucket_size),
        build_model(args, config, initial_state))
    optimizer = get_megatron_optimizer(OptimizerConfig(clip_grad=args.clip_grad, **ADAM),
                                       [model])
    forward_backward = get_forward_backward_func()

    def step(microbatches):
        n = len(microbatches)
        seen = []

        def forward_step(data_iterator, chunk):
            seen.append(None)
            if len(seen) == n:
                marks["last"] = time.perf_counter()
            tokens, labels = next(data_iterator)
            return chunk(tokens, labels=labels), loss_func

        start = time.perf_counter()
        model.zero_grad_buffer()
        optimizer.zero_grad()
        marks["accumulate"] = time.perf_counter()
        forward_backward(forward_step_func=forward_step, data_iterator=iter(microbatches),
                         model=[model], num_microbatches=n,
                         seq_length=args.seq, micro_batch_size=args.micro_batch_size)
        ok, _, _ = optimizer.step()
        assert ok
        return phases(start, marks, time.perf_counter())

    sizes = [b.grad_data.numel() for buf in model.buffers for b in buf.buckets]
    return step, model.module, f"{len(sizes)} bucket(s), elements {sizes}"


def torch_contender(args, config, initial_state, bucket_cap_mb):
    module = build_model(args, config, initial_state)
    # No buffer sync in forward: the only buffer (rotary inv_freq) never changes, and ours
    # does not sync buffers either. torch 2.13 renamed broadcast_buffers.
    no_buffer_sync = ({"forward_sync_buffers": False} if "forward_sync_buffers" in
                      inspect.signature(torch.nn.parallel.DistributedDataParallel).parameters
                      else {"broadcast_buffers": False})
    model = torch.nn.parallel.DistributedDataParallel(
        module, bucket_cap_mb=bucket_cap_mb,
        gradient_as_bucket_view=not args.torch_no_grad_view,
        process_group=parallel_state.get_data_parallel_group(), **no_buffer_sync)
    groups = [{**g, "weight_decay": ADAM["weight_decay"] * g["wd_mult"]}
              for g in get_param_groups([module])]
    optimizer = torch.optim.AdamW(groups, lr=ADAM["lr"], betas=(ADAM["adam_beta1"],
                                  ADAM["adam_beta2"]), eps=ADAM["adam_eps"], fused=True)
    params = [p for p in module.parameters() if p.requires_grad]

    def step(microbatches):
        marks = {}
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=args.torch_set_to_none)
        marks["accumulate"] = time.perf_counter()
        n = len(microbatches)
        for i, (tokens, labels) in enumerate(microbatches):
            if i == n - 1:
                marks["last"] = time.perf_counter()
            sync = contextlib.nullcontext() if i == n - 1 else model.no_sync()
            with sync:
                loss, _ = loss_func(model(tokens, labels=labels))
                (loss / n).backward()
        # The reduction finished inside the last backward (the reducer waits for it there).
        marks["reduce"] = marks["optimizer"] = time.perf_counter()
        if args.clip_grad > 0:
            torch.nn.utils.clip_grad_norm_(params, args.clip_grad)
        optimizer.step()
        return phases(start, marks, time.perf_counter())

    def describe():
        data = model._get_ddp_logging_data()
        sizes = data.get("rebuilt_bucket_sizes") or data.get("bucket_sizes")
        return f"bucket_cap_mb={bucket_cap_mb:g}, bucket bytes {sizes}"

    return step, module, describe


def build_contenders(args, config, initial_state):
    mib = args.bucket_size * 4 / 2 ** 20  # fp32 elements -> torch's MiB
    makers = {
        "ours": lambda: ours_contender(args, config, initial_state, False, None),
        "ours-overlap": lambda: ours_contender(args, config, initial_state, True,
                                               args.bucket_size),
        "ours-overlap-default": lambda: ours_contender(args, config, initial_state, True,
                                                       None),
        "torch": lambda: torch_contender(args, config, initial_state,
                                         args.torch_bucket_cap_mb),
        "torch-matched": lambda: torch_contender(args, config, initial_state, mib),
    }
    return {name: makers[name]() for name in args.contenders}


# --- measurement ----------------------------------------------------------------------------

def timed(fn, microbatches, profiler=None):
    """(wall seconds, this process's CPU seconds (all its threads), phases) of one step."""
    dist.barrier()
    start, cpu = time.perf_counter(), time.process_time()
    if profiler is not None:
        profiler.enable()
    step_phases = fn(microbatches)
    if profiler is not None:
        profiler.disable()
    return time.perf_counter() - start, time.process_time() - cpu, step_phases


def check_same_step(contenders, microbatches):
    """One step of each from the same start on the same batch; max |diff| to the first."""
    for step, _, _ in contenders.values():
        step(microbatches)
    names = list(contenders)
    ref = dict(contenders[names[0]][1].named_parameters())
    result = {}
    for name in names[1:]:
        diff, close = 0.0, True
        for pname, p in contenders[name][1].named_parameters():
            diff = max(diff, (p.detach() - ref[pname].detach()).abs().max().item())
            close = close and torch.allclose(p, ref[pname], rtol=1e-5, atol=1e-7)
        result[name] = (diff, close)
    return result


def run_rank(rank, world_size, args):
    torch.set_num_threads(args.threads)
    parallel_state.initialize_model_parallel(1, 1)
    config = model_config(args)
    torch.manual_seed(0)
    initial_state = {k: v.clone() for k, v in LlamaModel(config, args.vocab).state_dict().items()}
    contenders = build_contenders(args, config, initial_state)
    data = batches(args, 1 + args.warmup + args.steps)

    check = check_same_step(contenders, data[0])
    for i in range(args.warmup):
        for step, _, _ in contenders.values():
            timed(step, data[1 + i])
    profilers = None
    if args.profile:
        import cProfile
        profilers = {name: cProfile.Profile() for name in contenders}
    times = {name: [] for name in contenders}
    for i in range(args.steps):
        for name, (step, _, _) in contenders.items():
            times[name].append(timed(step, data[1 + args.warmup + i],
                                     profilers[name] if profilers else None))
    if profilers:
        os.makedirs(args.profile, exist_ok=True)
        for name, prof in profilers.items():
            prof.dump_stats(os.path.join(args.profile, f"{name}_rank{rank}.prof"))

    described = {name: (d() if callable(d) else d) for name, (_, _, d) in contenders.items()}
    numel = sum(v.numel() for v in contenders[next(iter(contenders))][1].parameters())
    mine = {"rank": rank, "times": times, "check": check, "described": described,
            "numel": numel}
    gathered = [None] * world_size
    dist.all_gather_object(gathered, mine)
    if rank == 0:
        report(args, config, gathered)
    parallel_state.destroy_model_parallel()


def report(args, config, per_rank):
    names = list(per_rank[0]["times"])
    # A step lasts until the slower rank is done; CPU is both ranks' processes together
    # (compute thread, gloo's threads, everything).
    step_times = {k: [max(r["times"][k][i][0] for r in per_rank) for i in range(args.steps)]
                  for k in names}
    cpu_times = {k: statistics.median(sum(r["times"][k][i][1] for r in per_rank)
                                      for i in range(args.steps)) for k in names}
    tokens = DP * args.microbatches * args.micro_batch_size * args.seq
    median = {k: statistics.median(v) for k, v in step_times.items()}
    rate = {k: tokens / v for k, v in median.items()}
    numel = per_rank[0]["numel"]
    print("=" * 78)
    print(f"data parallel bench: DP={DP}, gloo, {args.threads} thread(s)/rank, "
          f"torch {torch.__version__}")
    print(f"model: LLaMA layers={config.num_layers} hidden={config.hidden_size} "
          f"heads={config.num_attention_heads} groups={config.num_query_groups} "
          f"ffn={config.ffn_hidden_size} vocab={args.vocab} seq={args.seq} fp32, "
          f"{numel / 1e6:.2f}M params ({numel * 4 / 2 ** 20:.1f} MiB of fp32 gradients)")
    print(f"batch: {DP} ranks x {args.microbatches} microbatches x {args.micro_batch_size} x "
          f"{args.seq} = {tokens} tokens/step; fused AdamW lr={ADAM['lr']} "
          f"wd={ADAM['weight_decay']}, clip_grad={args.clip_grad}; {args.steps} timed steps "
          f"each (after {args.warmup} warmup + 1 check step)")
    for k in names:
        print(f"  {k:>20}: {per_rank[0]['described'][k]}")
    for k in names[1:]:
        diff = max(r["check"][k][0] for r in per_rank)
        close = all(r["check"][k][1] for r in per_rank)
        print(f"params after one step, {k} vs {names[0]}: max |diff| {diff:.3e}, "
              f"allclose(rtol=1e-5, atol=1e-7): {close}")
    for k in names:
        ts = sorted(step_times[k])
        print(f"{k:>22}: median step {median[k] * 1e3:8.1f} ms (min {ts[0] * 1e3:.1f}, "
              f"max {ts[-1] * 1e3:.1f})  {rate[k]:8.1f} tokens/s  "
              f"CPU {cpu_times[k] * 1e3:7.1f} ms/step")
    print("phases, ms (median per rank, mean of the ranks): " + " | ".join(PHASES))
    for k in names:
        cols = [statistics.mean(statistics.median(t[2][j] for t in r["times"][k])
                                for r in per_rank) * 1e3 for j in range(len(PHASES))]
        print(f"{k:>22}: " + " | ".join(f"{c:7.1f}" for c in cols))
    # Ratio of medians, and the median of per-round ratios (the contenders of one round ran
    # back to back, so they saw about the same load from the rest of the machine).
    print("ratios (tokens/s)          median/median   median of per-round ratios")
    for a, b in (("ours", "torch"), ("ours-overlap", "torch"), ("ours-overlap", "ours"),
                 ("ours-overlap-default", "torch"), ("ours", "torch-matched"),
                 ("ours-overlap", "torch-matched")):
        if a in rate and b in rate:
            paired = statistics.median(tb / ta for ta, tb in zip(step_times[a], step_times[b]))
            print(f"  {a + '/' + b:>26}: {rate[a] / rate[b]:13.3f} {paired:16.3f}")
    print("=" * 78)


# --- launch ---------------------------------------------------------------------------------

def main():
    args = parse_args()
    launch(run_rank, DP, args, "bench/data_parallel.py", threads=args.threads)


if __name__ == "__main__":
    main()
