"""DP=2: step time and per-rank memory of DDP, the distributed optimizer (ZeRO-1), ZeRO-2
(--shard-gradients), FSDP2 (ZeRO-3, ZeRO-2 without reshard-after-forward, and ZeRO-3 reducing
each unit once per step instead of once per microbatch) and the distributed optimizer with
--optimizer-cpu-offload, on the same LLaMA and the same data.

    python3 bench/memory_modes.py [--layers 4 --hidden 512 --seq 256 --micro-batch-size 1
                                  --microbatches 2 --steps 5 --warmup 2 --repeats 3]
    torchrun --nproc-per-node 2 bench/memory_modes.py [...]

Two processes (gloo, one compute thread each). Each mode is its own model with the same
initial weights and takes full training steps (``train_step``: zero the buffers, forward and
backward of ``--microbatches`` microbatches per rank, gradient reduction, clipping, fused
AdamW, the parameter all-gather) on the same batches. After a first step, an instrumented one
and ``--warmup`` steps, the modes alternate step by step; each step starts after a barrier and
lasts until the slower rank is done. Per repeat: the median step of each mode and its ratio
to the distributed optimizer's; reported: the median over repeats and their spread.

Memory per rank is what the parameters, gradients and optimizer state hold: the bytes of the
distinct storages of the model's parameters (FSDP2: the sharded ones, and the gathered ones
while they exist), the gradients (DDP's buffers, ZeRO-2's shards, FSDP2's .grad) and the
optimizer's main params and state (for offload: the host side, split out). "after step" is
measured after the optimizer step; "fwd/bwd peak" is the largest value sampled at every saved
activation (pack in forward, unpack in backward) of the second step (the first makes Adam's
state). Both are the largest over the ranks. Activations themselves
are not counted (they are the same for every mode).
"""
import argparse
import os
import statistics
import sys
import time
import warnings

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir))

from bench.launch import launch  # noqa: E402
from megatron.core import parallel_state  # noqa: E402
from megatron.core.distributed import (  # noqa: E402
    DistributedDataParallel,
    ddp_config_for_optimizer,
    finalize_model_grads,
)
from megatron.core.distributed.fsdp import TorchFSDP2, TorchFSDP2Config  # noqa: E402
from megatron.core.models import LlamaModel, llama_config  # noqa: E402
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer  # noqa: E402
from megatron.training.training import train_step  # noqa: E402

DP = 2
BASELINE = "distributed optimizer"
# mode -> (optimizer flags, shard_gradients, TorchFSDP2Config's settings or None for our DDP)
MODES = {
    "DDP": (dict(), False, None),
    BASELINE: (dict(use_distributed_optimizer=True), False, None),
    "ZeRO-2 (--shard-gradients)": (dict(use_distributed_optimizer=True), True, None),
    "FSDP2 ZeRO-3": (dict(), False, dict(reshard_after_forward=True)),
    "FSDP2 ZeRO-2": (dict(), False, dict(reshard_after_forward=False)),
    # each unit reduce-scattered once per step (gradients held unsharded until then), not
    # once per microbatch: the measured choice of fsdp.py's no_sync
    "FSDP2 ZeRO-3, reduce once": (dict(), False, dict(reshard_after_forward=True,
                                                      reduce_gradients_once=True)),
    "dist. opt. + CPU offload": (dict(use_distributed_optimizer=True,
                                      optimizer_cpu_offload=True), False, None),
}
FIGURES = ("device", "host", "peak")
ADAM = dict(lr=1e-4, weight_decay=0.1, adam_beta1=0.9, adam_beta2=0.95, clip_grad=1.0)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--ffn", type=int, default=1408)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--micro-batch-size", type=int, default=1)
    p.add_argument("--microbatches", type=int, default=2, help="per DP rank")
    p.add_argument("--steps", type=int, default=5, help="timed steps per repeat")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    return p.parse_args(argv)


def build_mode(args, name):
    """(model chunks, optimizer) of one mode, from the same seed."""
    flags, shard_gradients, fsdp2 = MODES[name]
    config = llama_config(num_layers=args.layers, hidden_size=args.hidden,
                          num_attention_heads=args.heads, ffn_hidden_size=args.ffn,
                          max_position_embeddings=args.seq)
    config.finalize_model_grads_func = finalize_model_grads
    opt_config = OptimizerConfig(**ADAM, **flags)
    torch.manual_seed(1234)
    module = LlamaModel(config, args.vocab)
    if fsdp2 is None:
        model = DistributedDataParallel(
            config, ddp_config_for_optimizer(opt_config, shard_gradients=shard_gradients),
            module)
    else:
        model = TorchFSDP2(config, TorchFSDP2Config(**fsdp2), module)
    return [model], get_megatron_optimizer(opt_config, [model])


# --- memory -------------------------------------------------------------------------------

def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def _model_tensors(chunks):
    """Parameters as the model holds them now, their gradients (FSDP2: also the unsharded
    ones it holds), DDP's gradient buckets."""
    for chunk in chunks:
        if isinstance(chunk, TorchFSDP2):
            yield from chunk.held_gradients()
        for p in chunk.module.parameters():
            yield _local(p)
            for grad in (p.grad, getattr(p, "main_grad", None)):
                if grad is not None:
                    yield _local(grad)
        for bucket in getattr(chunk, "_buckets", lambda: [])():
            for t in (bucket.grad_data, bucket.grad_shard, bucket.param_data):
                if t is not None:
                    yield t


def _optimizer_tensors(optimizer):
    """Main params (FSDP2: the sharded parameters), their gradients and the torch state."""
    for group in optimizer.optimizer.param_groups:
        for p in group["params"]:
            yield _local(p)
            if p.grad is not None:
                yield _local(p.grad)
            yield from (_local(v) for v in optimizer.optimizer.state.get(p, {}).values()
                        if torch.is_tensor(v))
    for shard in getattr(optimizer, "shards", []):
        for t in (shard.main, getattr(shard, "host_grads", None)):
            if t is not None:
                yield t
    yield from getattr(optimizer, "_host_grads", {}).values()


def _storage_bytes(tensors):
    """{storage address: bytes} of distinct, non-empty storages (FSDP2 frees a gathered
    parameter by resizing its storage to 0)."""
    out = {}
    for t in tensors:
        storage = t.untyped_storage()
        if storage.nbytes() > 0:
            out[storage.data_ptr()] = storage.nbytes()
    return out


def held_bytes(chunks, optimizer, offloaded):
    """(device bytes, host bytes): the optimizer's side is host memory under offload."""
    opt = _storage_bytes(_optimizer_tensors(optimizer))
    model = _storage_bytes(_model_tensors(chunks))
    if not offloaded:
        return sum({**model, **opt}.values()), 0
    return sum(v for k, v in model.items() if k not in opt), sum(opt.values())


class PeakSampler:
    """Largest device + host bytes held, sampled at every saved activation."""

    def __init__(self, chunks, optimizer, offloaded):
        self.measure = lambda: sum(held_bytes(chunks, optimizer, offloaded))
        self.peak = 0

    def _pack(self, t):
        self.peak = max(self.peak, self.measure())
        return t

    def _unpack(self, t):
        self.peak = max(self.peak, self.measure())
        return t

    def hooks(self):
        return torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)


# --- steps --------------------------------------------------------------------------------

def _loss(per_token):
    loss = per_token.mean()
    return loss, {"loss": loss.detach()}


def _forward_step(data_iterator, model):
    tokens, labels = next(data_iterator)
    return model(tokens, labels=labels), _loss


def batch_for(args, step):
    g = torch.Generator().manual_seed(step * DP + parallel_state.get_data_parallel_rank())
    shape = (args.micro_batch_size, args.seq)
    return [(torch.randint(0, args.vocab, shape, generator=g),
             torch.randint(0, args.vocab, shape, generator=g)) for _ in range(args.microbatches)]


def take_step(chunks, optimizer, batch, args):
    """One training step; the loss averaged over microbatches and DP."""
    losses, skipped, _, _ = train_step(_forward_step, iter(batch), chunks, optimizer, None,
                                       len(batch), args.seq, args.micro_batch_size)
    assert not skipped
    for chunk in chunks:  # the overlapped / async parameter gathers done within the step
        getattr(chunk, "finish_param_sync", lambda: None)()
    return losses["loss"]


def step_with_memory(built, args, step):
    """One instrumented step of every mode (after the first: Adam's state exists):
    {mode: memory figures}, {mode: loss}."""
    memory, losses = {}, {}
    for name, (chunks, optimizer) in built.items():
        offloaded = MODES[name][0].get("optimizer_cpu_offload", False)
        sampler = PeakSampler(chunks, optimizer, offloaded)
        with sampler.hooks():
            losses[name] = take_step(chunks, optimizer, batch_for(args, step), args)
        device, host = held_bytes(chunks, optimizer, offloaded)
        memory[name] = dict(device=device, host=host, peak=sampler.peak)
    return memory, losses


def timed_steps(built, args, first_step, count, times, losses):
    """``count`` steps, the modes alternating; appends each step's time (slower rank)."""
    for i in range(first_step, first_step + count):
        batch = batch_for(args, i)
        for name, (chunks, optimizer) in built.items():
            dist.barrier()
            start = time.perf_counter()
            loss = take_step(chunks, optimizer, batch, args)
            elapsed = torch.tensor([time.perf_counter() - start])
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            times[name].append(elapsed.item())
            losses[name].append(loss)


def run_modes(args):
    """Everything a rank measures (parallel_state initialised, DP=2): memory, the loss of
    every step, per-repeat step times; and the modes built (for tests)."""
    built = {name: build_mode(args, name) for name in args.modes}
    losses = {name: [] for name in built}
    timed_steps(built, args, 0, 1, {n: [] for n in built}, losses)
    memory, second = step_with_memory(built, args, 1)
    for name, loss in second.items():
        losses[name].append(loss)
    step = 2
    timed_steps(built, args, step, args.warmup, {n: [] for n in built}, losses)
    step += args.warmup
    repeats = []
    for _ in range(args.repeats):
        times = {name: [] for name in built}
        timed_steps(built, args, step, args.steps, times, losses)
        step += args.steps
        repeats.append(times)
    return dict(memory=memory, losses=losses, repeats=repeats, built=built)


# --- report -------------------------------------------------------------------------------

def _mib(n):
    return f"{n / 2**20:8.2f}"


def _spread(values):
    return f"{min(values) * 1e3:.0f}-{max(values) * 1e3:.0f}"


def report(args, result):
    memory, losses, repeats = result["memory"], result["losses"], result["repeats"]
    tokens = DP * args.microbatches * args.micro_batch_size * args.seq
    print("=" * 100)
    print(f"memory modes bench: DP={DP}, gloo, 1 thread/rank, torch {torch.__version__}; LLaMA "
          f"layers={args.layers} hidden={args.hidden} ffn={args.ffn} vocab={args.vocab} "
          f"seq={args.seq}; {args.microbatches} microbatches x {args.micro_batch_size} per "
          f"rank ({tokens} tokens/step); fp32; {args.steps} steps x {args.repeats} repeats")
    base = losses.get(BASELINE)
    print(f"{'mode':28s} | step ms median (repeat medians) | ratio to dist. opt. | "
          f"after step MiB device + host | fwd/bwd peak MiB | max |loss - dist. opt.|")
    for name in memory:
        medians = [statistics.median(r[name]) for r in repeats]
        within = [t for r in repeats for t in r[name]]
        ratio = "n/a"
        if BASELINE in memory:
            ratios = [statistics.median(r[name]) / statistics.median(r[BASELINE])
                      for r in repeats]
            ratio = f"{statistics.median(ratios):.3f} ({min(ratios):.3f}-{max(ratios):.3f})"
        diff = max(abs(a - b) for a, b in zip(losses[name], base)) if base else float("nan")
        m = memory[name]
        print(f"{name:28s} | {statistics.median(medians) * 1e3:7.0f} ({_spread(medians)}; "
              f"steps {_spread(within)}) | {ratio} | {_mib(m['device'])} + {_mib(m['host'])} | "
              f"{_mib(m['peak'])} | {diff:.2e}")
    print("losses (dist. opt.): " + " ".join(f"{v:.5f}" for v in (base or [])))
    print("=" * 100)


def max_over_ranks(memory):
    """Each memory figure's largest value over the ranks (they differ by bucket padding)."""
    names = list(memory)
    figures = torch.tensor([[memory[n][k] for k in FIGURES] for n in names], dtype=torch.float64)
    dist.all_reduce(figures, op=dist.ReduceOp.MAX)
    return {n: dict(zip(FIGURES, map(int, row))) for n, row in zip(names, figures.tolist())}


def run_rank(rank, world_size, args):
    torch.set_num_threads(1)
    # The model's output is a view; FSDP2 warns about in-place ops on it (we make none).
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module")
    parallel_state.initialize_model_parallel(1, 1)
    try:
        result = run_modes(args)
        del result["built"]
        result["memory"] = max_over_ranks(result["memory"])
    finally:
        parallel_state.destroy_model_parallel()
    if rank == 0:
        report(args, result)


def main():
    launch(run_rank, DP, parse_args(), "bench/memory_modes.py")


if __name__ == "__main__":
    main()
