"""Check that tensor parallelism on this machine computes what the unsharded model computes.

    torchrun --nproc-per-node 2 tools/check_tensor_parallel.py [--steps 10]

A tiny language model (vocab-parallel embedding -> column-parallel -> GeLU -> row-parallel ->
column-parallel output -> vocab-parallel cross entropy) is trained with SGD at TP = number of
processes, and an unsharded copy built from the gathered initial weights is trained alongside
on every rank. Exits non-zero if any step's loss differs by more than --tolerance. Runs on CPU
(gloo) and on GPUs (nccl); useful to validate a new cluster's set-up.
"""
import argparse
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

# Run from a clone without installing, as Megatron's tools allow.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir))

from megatron.core import device, parallel_state
from megatron.core.model_parallel_config import ModelParallelConfig
from megatron.core.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    gather_from_tensor_model_parallel_region,
    vocab_parallel_cross_entropy,
    vocab_size_with_padding,
)
from megatron.core.utils import init_method_normal


class TinyParallelLM(torch.nn.Module):
    def __init__(self, vocab, hidden, config):
        super().__init__()
        init = init_method_normal(0.2)
        self.embedding = VocabParallelEmbedding(vocab, hidden, config=config, init_method=init)
        self.fc1 = ColumnParallelLinear(hidden, 4 * hidden, config=config, init_method=init)
        self.fc2 = RowParallelLinear(4 * hidden, hidden, config=config, init_method=init)
        self.output = ColumnParallelLinear(hidden, vocab, config=config, init_method=init,
                                           bias=False)

    def forward(self, tokens, labels, vocab_size):
        h = self.embedding(tokens)
        h = h + self.fc2(F.gelu(self.fc1(h)[0]))[0]
        return vocab_parallel_cross_entropy(self.output(h)[0], labels, vocab_size=vocab_size)


def full_weight(param, partition_dim):
    """All-gather a TP-sharded parameter into the full tensor."""
    moved = param.detach().movedim(partition_dim, -1)
    return gather_from_tensor_model_parallel_region(moved).movedim(-1, partition_dim)


def reference_loss(weights, tokens, labels, vocab_size):
    h = F.embedding(tokens, weights["embedding"])
    h = h + F.linear(F.gelu(F.linear(h, weights["fc1"], weights["fc1_bias"])),
                     weights["fc2"], weights["fc2_bias"])
    logits = F.linear(h, weights["output"])[..., :vocab_size]
    return F.cross_entropy(logits.reshape(-1, vocab_size), labels.reshape(-1),
                           reduction="none").view(labels.shape)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--vocab-size", type=int, default=50)
    parser.add_argument("--hidden-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=0.5)
    parser.add_argument("--tolerance", type=float, default=1e-5)
    args = parser.parse_args(argv)
    if "RANK" not in os.environ:
        parser.error("launch with torchrun, e.g. torchrun --nproc-per-node 2 " + sys.argv[0])

    device.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group(device.dist_backend())
    tp = dist.get_world_size()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
    torch.manual_seed(1234)
    padded = vocab_size_with_padding(args.vocab_size, 8, tp)
    model = TinyParallelLM(padded, args.hidden_size, ModelParallelConfig())
    weights = {
        "embedding": full_weight(model.embedding.weight, 0),
        "fc1": full_weight(model.fc1.weight, 0), "fc1_bias": full_weight(model.fc1.bias, 0),
        "fc2": full_weight(model.fc2.weight, 1), "fc2_bias": model.fc2.bias.detach().clone(),
        "output": full_weight(model.output.weight, 0),
    }
    weights = {k: v.clone().requires_grad_() for k, v in weights.items()}
    parallel_opt = torch.optim.SGD(model.parameters(), lr=args.lr)
    reference_opt = torch.optim.SGD(weights.values(), lr=args.lr)

    worst = 0.0
    for step in range(1, args.steps + 1):
        tokens = torch.randint(0, args.vocab_size, (16, 4), device=device.current_device())
        labels = (3 * tokens + 1) % args.vocab_size  # a rule the model can learn
        for opt, loss in ((parallel_opt, model(tokens, labels, args.vocab_size).mean()),
                          (reference_opt, reference_loss(weights, tokens, labels,
                                                         args.vocab_size).mean())):
            opt.zero_grad()
            loss.backward()
            opt.step()
            if opt is parallel_opt:
                parallel_value = loss.item()
        diff = abs(parallel_value - loss.item())
        worst = max(worst, diff)
        if dist.get_rank() == 0:
            print(f"step {step:3d}  loss TP={tp}: {parallel_value:.6f}  unsharded: "
                  f"{loss.item():.6f}  |diff| {diff:.2e}", flush=True)
    ok = worst <= args.tolerance
    if dist.get_rank() == 0:
        print(f"{'OK' if ok else 'MISMATCH'}: tensor parallelism (TP={tp}, "
              f"{device.dist_backend()}) matches the unsharded model to {worst:.2e} "
              f"(tolerance {args.tolerance:.0e}).", flush=True)
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
