"""The optimizer step alone: AdamW, Muon (Newton-Schulz in fp32) and Muon (NS in bf16).

    python3 bench/muon.py [--layers 4 --hidden 512 --heads 8 --ffn 1376 --vocab 4096
                           --steps 10 --warmup 2 --device cpu|cuda]

One process. Each contender is its own LLaMA with the same weights and the same fixed random
gradients; a step is what ``optimizer.step()`` does (clip, the update); medians of ``--steps``
after ``--warmup``, contenders alternating. Also printed: the optimizer state (Muon keeps one
momentum per layer matrix, AdamW two moments everywhere). NS in bf16 is slow on CPUs
without bf16 matmul units: time it on a GPU.
"""
import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir))

from megatron.core import device, parallel_state  # noqa: E402
from megatron.core.models import LlamaModel, llama_config  # noqa: E402
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer  # noqa: E402

CONTENDERS = {
    "adam": dict(optimizer="adam"),
    "muon (NS fp32)": dict(optimizer="muon"),
    "muon (NS bf16)": dict(optimizer="muon", muon_ns_dtype=torch.bfloat16),
}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--ffn", type=int, default=1376)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--device", default=None, help="cpu or cuda (default: what device.py picks)")
    p.add_argument("--contenders", nargs="+", default=list(CONTENDERS), choices=list(CONTENDERS))
    return p.parse_args(argv)


def _init(target):
    import torch.distributed as dist
    device.set_device_type(target)
    device.set_device(0)
    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29561")
        dist.init_process_group(device.dist_backend(), rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1, 1)


def _contender(args, settings):
    torch.manual_seed(1)
    model = LlamaModel(llama_config(
        num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=args.heads,
        ffn_hidden_size=args.ffn, max_position_embeddings=128), args.vocab)
    model = model.to(device.current_device())
    optimizer = get_megatron_optimizer(OptimizerConfig(lr=1e-3, weight_decay=0.1, **settings),
                                       [model])
    g = torch.Generator().manual_seed(2)
    grads = [torch.randn(p.shape, generator=g).to(p.device) * 1e-2 for p in model.parameters()]
    return model, optimizer, grads


def _step(model, optimizer, grads) -> float:
    for p, grad in zip(model.parameters(), grads):
        p.grad = grad.clone()
    device.synchronize()
    start = time.perf_counter()
    optimizer.step()
    device.synchronize()
    return time.perf_counter() - start


def _state_bytes(optimizer) -> int:
    return sum(v.numel() * v.element_size() for s in optimizer.optimizer.state.values()
               for k, v in s.items() if k != "step")


def main(argv=None):
    args = parse_args(argv)
    _init(args.device)
    runs = {name: _contender(args, CONTENDERS[name]) for name in args.contenders}
    times = {name: [] for name in runs}
    for i in range(args.warmup + args.steps):
        for name, run in runs.items():
            seconds = _step(*run)
            if i >= args.warmup:
                times[name].append(seconds)
    print(f"device {device.device_type()}: {args.layers} layers, hidden {args.hidden}, ffn "
          f"{args.ffn}, vocab {args.vocab}; median of {args.steps} steps")
    print(f"{'optimizer':<16} {'step ms':>10} {'state MiB':>10}")
    for name, (_, optimizer, _) in runs.items():
        print(f"{name:<16} {statistics.median(times[name]) * 1e3:>10.2f} "
              f"{_state_bytes(optimizer) / 2 ** 20:>10.2f}")


if __name__ == "__main__":
    main()
