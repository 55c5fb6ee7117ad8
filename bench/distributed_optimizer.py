"""DP=2, gradient accumulation: step time without sharding, with --use-distributed-optimizer
and with --overlapped-distributed-optimizer.

    python3 bench/distributed_optimizer.py [--layers 4 --hidden 384 --seq 128
                                           --micro-batch-size 2 --microbatches 8 --steps 10]
    torchrun --nproc-per-node 2 bench/distributed_optimizer.py [...]

Two processes (gloo, one compute thread each). Each contender is its own LLaMA instance with
the same initial weights, wrapped in our DDP as its flags imply (``ddp_config_for_optimizer``),
and takes full training steps on the same batches: zero the gradient buffers, forward+backward
of ``--microbatches`` microbatches per rank (gradient sync only on the last), gradient
reduction (all-reduce, or reduce-scatter for the sharded ones), clipping and a fused AdamW
step, and for the sharded ones the parameter all-gather (overlapped with the next step's
forward for the overlapped optimizer). Contenders alternate step by step after warmup; each
step starts after a barrier and lasts until the slower rank is done; medians. Before timing,
all three take one step from the same start and their parameters are compared.
"""
import argparse
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
    ddp_config_for_optimizer,
    finalize_model_grads,
)
from megatron.core.models import LlamaModel, llama_config  # noqa: E402
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer  # noqa: E402
from megatron.core.pipeline_parallel import get_forward_backward_func  # noqa: E402

DP = 2
CONTENDERS = {
    "no sharding": dict(),
    "--use-distributed-optimizer": dict(use_distributed_optimizer=True),
    "--overlapped-distributed-optimizer": dict(overlapped_distributed_optimizer=True),
}
ADAM = dict(lr=1e-4, weight_decay=0.1, adam_beta1=0.9, adam_beta2=0.95, clip_grad=1.0)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=384)
    p.add_argument("--heads", type=int, default=6)
    p.add_argument("--ffn", type=int, default=1024)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--micro-batch-size", type=int, default=2)
    p.add_argument("--microbatches", type=int, default=8, help="per DP rank")
    p.add_argument("--reduce-bucket-size", type=int, default=500_000_000,
                   help="elements per bucket of the overlapped optimizer (Megatron-LLaMA's)")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    return p.parse_args(argv)


def _build(args, flags):
    config = llama_config(num_layers=args.layers, hidden_size=args.hidden,
                          num_attention_heads=args.heads, ffn_hidden_size=args.ffn,
                          max_position_embeddings=args.seq)
    opt_config = OptimizerConfig(**ADAM, **flags)
    torch.manual_seed(1234)
    model = DistributedDataParallel(
        config, ddp_config_for_optimizer(opt_config, reduce_bucket_size=args.reduce_bucket_size),
        LlamaModel(config, args.vocab))
    config.finalize_model_grads_func = finalize_model_grads
    return model, get_megatron_optimizer(opt_config, [model])


def _loss(per_token):
    loss = per_token.mean()
    return loss, {"loss": loss.detach()}


def _forward_step(data_iterator, model):
    tokens, labels = next(data_iterator)
    return model(tokens, labels=labels), _loss


def _step(model, optimizer, batch, args):
    model.zero_grad_buffer()
    optimizer.zero_grad()
    get_forward_backward_func()(forward_step_func=_forward_step, data_iterator=iter(batch),
                                model=[model], num_microbatches=len(batch),
                                seq_length=args.seq, micro_batch_size=args.micro_batch_size)
    optimizer.step()


def _batch(args, seed):
    g = torch.Generator().manual_seed(seed * DP + parallel_state.get_data_parallel_rank())
    shape = (args.micro_batch_size, args.seq)
    return [(torch.randint(0, args.vocab, shape, generator=g),
             torch.randint(0, args.vocab, shape, generator=g)) for _ in range(args.microbatches)]


def run_rank(rank, world_size, args):
    torch.set_num_threads(1)
    parallel_state.initialize_model_parallel(1, 1)
    built = {name: _build(args, flags) for name, flags in CONTENDERS.items()}

    # Same start, same batch: the same parameters after one step.
    for model, optimizer in built.values():
        _step(model, optimizer, _batch(args, 0), args)
        model.finish_param_sync()
    base = dict(next(iter(built.values()))[0].module.named_parameters())
    diffs = {name: max((p - base[n]).abs().max().item()
                       for n, p in model.module.named_parameters())
             for name, (model, _) in built.items()}

    times = {name: [] for name in CONTENDERS}
    for i in range(args.warmup + args.steps):
        batch = _batch(args, i + 1)
        for name, (model, optimizer) in built.items():
            dist.barrier()
            start = time.perf_counter()
            _step(model, optimizer, batch, args)
            elapsed = torch.tensor([time.perf_counter() - start])
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            if i >= args.warmup:
                times[name].append(elapsed.item())
    if rank == 0:
        tokens = DP * args.microbatches * args.micro_batch_size * args.seq
        med = {name: statistics.median(t) for name, t in times.items()}
        print("=" * 78)
        print(f"distributed optimizer bench: DP={DP}, gloo, 1 thread/rank, torch "
              f"{torch.__version__}; LLaMA layers={args.layers} hidden={args.hidden} "
              f"vocab={args.vocab} seq={args.seq}; {args.microbatches} microbatches x "
              f"{args.micro_batch_size} per rank ({tokens} tokens/step)")
        print("max |param diff| vs no sharding after one step: " +
              ", ".join(f"{n} {d:.2e}" for n, d in diffs.items()))
        for name, t in med.items():
            print(f"  {name:36s} median step {t * 1e3:8.1f} ms  {tokens / t:9.1f} tokens/s")
        names = list(CONTENDERS)
        print(f"ratio distributed / no sharding (step time): {med[names[1]] / med[names[0]]:.3f}")
        print(f"ratio overlapped / distributed  (step time): {med[names[2]] / med[names[1]]:.3f}")
        print("=" * 78)


def main():
    launch(run_rank, DP, parse_args(), "bench/distributed_optimizer.py")


if __name__ == "__main__":
    main()
