"""Muon's optimizer step: ours at DP=2 with the distributed optimizer against torch.optim.Muon
on one process, its share of a whole training step, and Newton-Schulz in fp32 vs bf16.

    python3 bench/muon.py [--layers 2 --hidden 384 --heads 6 --ffn 1024 --vocab 512 --seq 128
                           --micro-batch-size 2 --microbatches 2 --steps 6 --warmup 2
                           --ns-dtypes fp32 bf16]

Two gloo processes (one compute thread each). Every contender is its own LLaMA with the same
initial weights and takes full training steps on the same batches (forward and backward of
``--microbatches`` microbatches per rank, the gradient reduction, clipping, the step):
- "ours DP=2 distributed": --optimizer muon --use-distributed-optimizer; each DP rank
  orthogonalizes the matrices it owns (about half), then the pieces are exchanged;
- "ours DP=2 replicated": --optimizer muon without it; both ranks orthogonalize every matrix;
- "adam DP=2 distributed": the AdamW step of the same model, for scale;
- "torch.optim.Muon, 1 process" (rank 0 alone, rank 1 waits): torch's Muon on the same
  matrices and fused AdamW on the rest, stepping the same gradients (those of rank 0's last
  step of "ours DP=2 replicated" after the DP mean). torch's iteration is bf16 only; with
  ``--ns-dtypes fp32`` it is given ours in fp32 (the rest of its arithmetic is unchanged; see
  tests/unit/test_muon.py), so each NS precision is compared with the same precision.
Times: the optimizer step (``optimizer.step()``: clip, update, gather) and the whole step, the
slower rank's, medians over ``--steps`` after ``--warmup``, contenders alternating. bf16
matmul speed on a CPU depends on its bf16 units (fast on this machine's): the GPU decides.
"""
import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir))

from bench.distributed_optimizer import DP, _batch, _forward_step  # noqa: E402
from bench.launch import launch  # noqa: E402
from megatron.core import parallel_state  # noqa: E402
from megatron.core.distributed import (  # noqa: E402
    DistributedDataParallel,
    ddp_config_for_optimizer,
    finalize_model_grads,
)
from megatron.core.models import LlamaModel, llama_config  # noqa: E402
from megatron.core.optimizer import (  # noqa: E402
    OptimizerConfig,
    get_megatron_optimizer,
    get_param_groups,
)
from megatron.core.optimizer import muon  # noqa: E402
from megatron.core.pipeline_parallel import get_forward_backward_func  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
SETTINGS = dict(lr=1e-3, weight_decay=0.1, adam_beta1=0.9, adam_beta2=0.95, clip_grad=1.0,
                muon_momentum=0.95, muon_use_nesterov=True, muon_scale_mode="shape_scaling")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=384)
    p.add_argument("--heads", type=int, default=6)
    p.add_argument("--ffn", type=int, default=1024)
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--micro-batch-size", type=int, default=2)
    p.add_argument("--microbatches", type=int, default=2, help="per DP rank")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--ns-dtypes", nargs="+", default=["fp32"], choices=list(DTYPES))
    return p.parse_args(argv)


def _model(args):
    torch.manual_seed(1234)
    config = llama_config(num_layers=args.layers, hidden_size=args.hidden,
                          num_attention_heads=args.heads, ffn_hidden_size=args.ffn,
                          max_position_embeddings=args.seq)
    return config, LlamaModel(config, args.vocab)


def _ours(args, **flags):
    config, model = _model(args)
    opt_config = OptimizerConfig(**SETTINGS, **flags)
    model = DistributedDataParallel(config, ddp_config_for_optimizer(opt_config), model)
    config.finalize_model_grads_func = finalize_model_grads
    return model, get_megatron_optimizer(opt_config, [model])


def _slowest(seconds: float) -> float:
    value = torch.tensor([seconds])
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return value.item()


def _train_step(model, optimizer, batch, args):
    """(whole step, optimizer step) seconds, the slower rank's."""
    dist.barrier()
    start = time.perf_counter()
    model.zero_grad_buffer()
    optimizer.zero_grad()
    get_forward_backward_func()(forward_step_func=_forward_step, data_iterator=iter(batch),
                                model=[model], num_microbatches=len(batch),
                                seq_length=args.seq, micro_batch_size=args.micro_batch_size)
    step_start = time.perf_counter()
    optimizer.step()
    end = time.perf_counter()
    return _slowest(end - start), _slowest(end - step_start)


class TorchMuon:
    """torch.optim.Muon on the matrices ours gives Muon, fused AdamW on the rest (the same
    weight-decay groups), clipping by the global norm as ours does; rank 0 only."""

    def __init__(self, args, ns_dtype):
        _, self.model = _model(args)
        names = {p: n for n, p in self.model.named_parameters()}
        mats, rest = [], []
        for group in get_param_groups([self.model]):
            wd = SETTINGS["weight_decay"] * group["wd_mult"]
            for params, use_muon in ((mats, True), (rest, False)):
                chosen = [p for p in group["params"]
                          if muon.is_muon_matrix(names[p], p.dim()) == use_muon]
                params += [{"params": chosen, "weight_decay": wd}] if chosen else []
        self.muon = torch.optim.Muon(mats, lr=SETTINGS["lr"], momentum=SETTINGS["muon_momentum"],
                                     nesterov=SETTINGS["muon_use_nesterov"],
                                     adjust_lr_fn="original")
        self.adamw = torch.optim.AdamW(rest, lr=SETTINGS["lr"], fused=True,
                                       betas=(SETTINGS["adam_beta1"], SETTINGS["adam_beta2"]))
        self.ns_dtype = ns_dtype

    def step(self, grads) -> float:
        import torch.optim._muon as torch_muon

        for p, grad in zip(self.model.parameters(), grads):
            p.grad = grad.clone()
        original = torch_muon._zeropower_via_newtonschulz
        if self.ns_dtype == torch.float32:  # torch's iteration is bf16 only: ours in fp32
            torch_muon._zeropower_via_newtonschulz = \
                lambda g, coefficients, steps, eps: muon.newton_schulz(g, steps, torch.float32,
                                                                       coefficients, eps)
        try:
            start = time.perf_counter()
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), SETTINGS["clip_grad"])
            self.muon.step()
            self.adamw.step()
            return time.perf_counter() - start
        finally:
            torch_muon._zeropower_via_newtonschulz = original


def run_rank(rank, world_size, args):
    torch.set_num_threads(1)
    parallel_state.initialize_model_parallel(1, 1)
    contenders = {}
    for name in args.ns_dtypes:
        dtype = DTYPES[name]
        contenders[f"ours DP=2 distributed, NS {name}"] = _ours(
            args, optimizer="muon", muon_ns_dtype=dtype, use_distributed_optimizer=True)
        contenders[f"ours DP=2 replicated, NS {name}"] = _ours(
            args, optimizer="muon", muon_ns_dtype=dtype)
    contenders["adam DP=2 distributed"] = _ours(args, optimizer="adam",
                                                use_distributed_optimizer=True)
    torch_muon = {name: TorchMuon(args, DTYPES[name]) for name in args.ns_dtypes} \
        if rank == 0 else {}
    whole = {name: [] for name in contenders}
    step = {name: [] for name in list(contenders) + [f"torch.optim.Muon 1 process, NS {n}"
                                                    for n in args.ns_dtypes]}
    for i in range(args.warmup + args.steps):
        batch = _batch(args, i)
        for name, (model, optimizer) in contenders.items():
            seconds, step_seconds = _train_step(model, optimizer, batch, args)
            if i >= args.warmup:
                whole[name].append(seconds)
                step[name].append(step_seconds)
        # rank 0's mean gradients of the replicated run, into torch's optimizer alone
        model = contenders[f"ours DP=2 replicated, NS {args.ns_dtypes[0]}"][0]
        grads = [p.main_grad.detach().clone() for p in model.module.parameters()]
        dist.barrier()
        for name, reference in torch_muon.items():
            seconds = reference.step(grads)
            if i >= args.warmup:
                step[f"torch.optim.Muon 1 process, NS {name}"].append(seconds)
        dist.barrier()
    if rank == 0:
        _report(args, whole, step)


def _report(args, whole, step):
    med = {name: statistics.median(t) * 1e3 for name, t in step.items()}
    print("=" * 86)
    print(f"Muon bench: DP={DP}, gloo, 1 thread/rank, torch {torch.__version__}; LLaMA "
          f"layers={args.layers} hidden={args.hidden} ffn={args.ffn} vocab={args.vocab} "
          f"seq={args.seq}; {args.microbatches} microbatches x {args.micro_batch_size} per rank; "
          f"medians of {args.steps} steps")
    print(f"{'contender':40s} {'optimizer step ms':>18} {'whole step ms':>14} {'share':>7}")
    for name, ms in med.items():
        if name in whole:
            total = statistics.median(whole[name]) * 1e3
            print(f"{name:40s} {ms:18.2f} {total:14.1f} {ms / total:7.1%}")
        else:
            print(f"{name:40s} {ms:18.2f} {'':>14} {'':>7}")
    for dtype in args.ns_dtypes:
        ours, torch_one = med[f"ours DP=2 distributed, NS {dtype}"], \
            med[f"torch.optim.Muon 1 process, NS {dtype}"]
        print(f"ratio ours DP=2 distributed / torch.optim.Muon 1 process (NS {dtype}, step "
              f"time): {ours / torch_one:.3f}")
        print(f"ratio ours distributed / replicated (NS {dtype}, step time): "
              f"{ours / med[f'ours DP=2 replicated, NS {dtype}']:.3f}")
    if len(args.ns_dtypes) == 2:
        print(f"ratio NS bf16 / NS fp32 (ours distributed, step time): "
              f"{med['ours DP=2 distributed, NS bf16'] / med['ours DP=2 distributed, NS fp32']:.3f}")
    print("=" * 86)


def main():
    launch(run_rank, DP, parse_args(), "bench/muon.py")


if __name__ == "__main__":
    main()
