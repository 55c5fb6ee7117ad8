"""Mixture of experts on CPU, fp32: our MoE layer against Hugging Face's Mixtral block,
grouped GEMM against the per-expert loop, and the all-to-all against the all-gather
dispatcher at EP=2.

    python3 bench/moe.py [--parts layer,experts,dispatch,model] [--tokens 1024 --hidden 256
                        --ffn 512 --experts 8 --topk 2 --repeats 7 --warmup 2 --threads 1]
                        [--layers 2 --vocab 1024 --seq 256 --micro-batch 2]

- layer: MoELayer (grouped GEMM) vs transformers' MixtralSparseMoeBlock (its default experts
  implementation, the Python loop over experts; and its "grouped_mm" one) on the same weights
  and batch, forward + backward of sum(out^2). Outputs and gradients are compared first.
- experts: SwiGLUExperts with moe_grouped_gemm True vs False on the same routed rows.
- dispatch: 2 gloo processes, each with E/2 experts: router, AllToAllDispatcher or
  AllGatherDispatcher, experts, combine; forward + backward; outputs compared first.
- model: a small Mixtral training step (forward, backward, AdamW), our GPTModel at EP=1 vs
  transformers' MixtralForCausalLM, same weights and batch; loss and gradients compared first
  (bench/moe_model.py).
Every repeat times each variant once, alternating (the machine's load drifts alike for all);
the table gives the median, min-max over repeats, and the median of the per-repeat ratios.
"""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir))

from bench.moe_common import (  # noqa: E402
    alternate,
    hf_block,
    hf_layout,
    max_diff,
    moe_config,
    print_summary,
    run_hf,
    run_ours,
    tokens_batch,
)
from megatron.core.transformer.moe.experts import SwiGLUExperts  # noqa: E402
from megatron.core.transformer.moe.moe_layer import MoELayer  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--parts", default="layer,experts,dispatch,model")
    p.add_argument("--tokens", type=int, default=1024)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--ffn", type=int, default=512)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--topk", type=int, default=2)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--threads", type=int, default=1)
    # the model part's own sizes (a small Mixtral: --hidden/--ffn/--experts/--topk too)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--micro-batch", type=int, default=2)
    return p.parse_args(argv)


def ours_from_hf(args, block, grouped=True):
    """Our layer with the HF block's weights (the same [E, 2f, h] / [E, h, f] layouts)."""
    layer = MoELayer(moe_config(args, grouped))
    with torch.no_grad():
        layer.router.weight.copy_(block.gate.weight)
        layer.experts.weight1.copy_(block.experts.gate_up_proj)
        layer.experts.weight2.copy_(block.experts.down_proj)
    return layer


def layer_check(args):
    """Largest relative differences ours vs HF (eager): output, input gradient, expert and
    router gradients."""
    block = hf_block(args)
    layer = ours_from_hf(args, block)
    x = tokens_batch(args)
    ours, hf = run_ours(layer, x), run_hf(block, hf_layout(x))
    return {"output": max_diff(hf_layout(ours[0]), hf[0]),
            "input grad": max_diff(hf_layout(ours[1]), hf[1]),
            "weight1 grad": max_diff(layer.experts.weight1.grad,
                                     block.experts.gate_up_proj.grad),
            "weight2 grad": max_diff(layer.experts.weight2.grad, block.experts.down_proj.grad),
            "router grad": max_diff(layer.router.weight.grad, block.gate.weight.grad)}


def routed_rows(args, seed=2):
    """Rows grouped by expert, as the dispatcher gives them: k T rows, uneven counts."""
    g = torch.Generator().manual_seed(seed)
    choices = torch.randint(0, args.experts, (args.tokens * args.topk,), generator=g)
    counts = torch.bincount(choices, minlength=args.experts)
    return torch.randn(int(counts.sum()), args.hidden, generator=g), counts


def experts_pair(args):
    torch.manual_seed(0)
    grouped = SwiGLUExperts(args.experts, args.hidden, args.ffn, grouped_gemm=True)
    loop = SwiGLUExperts(args.experts, args.hidden, args.ffn, grouped_gemm=False)
    loop.load_state_dict(grouped.state_dict())
    return grouped, loop


def run_experts(experts, rows, counts):
    rows = rows.detach().requires_grad_()
    out = experts(rows, counts)
    out.square().sum().backward()
    return out, rows.grad


def experts_check(args):
    grouped, loop = experts_pair(args)
    rows, counts = routed_rows(args)
    a, b = run_experts(grouped, rows, counts), run_experts(loop, rows, counts)
    return {"output": max_diff(a[0], b[0]), "input grad": max_diff(a[1], b[1]),
            "weight1 grad": max_diff(grouped.weight1.grad, loop.weight1.grad)}


def bench_layer(args):
    print("ours vs HF, largest relative |difference|:", layer_check(args))
    eager, grouped_hf = hf_block(args), hf_block(args, "grouped_mm")
    ours, x = ours_from_hf(args, eager), tokens_batch(args)
    x_hf = hf_layout(x)
    variants = {"ours MoELayer (grouped GEMM)": lambda: run_ours(ours, x),
                "HF Mixtral block (eager)": lambda: run_hf(eager, x_hf),
                "HF Mixtral block (grouped_mm)": lambda: run_hf(grouped_hf, x_hf)}
    times = alternate(variants, args.repeats, args.warmup)
    return print_summary("MoE layer, forward + backward", times,
                         ["HF Mixtral block (eager)", "HF Mixtral block (grouped_mm)"],
                         "ours MoELayer (grouped GEMM)")


def bench_experts(args):
    print("grouped vs loop, largest relative |difference|:", experts_check(args))
    grouped, loop = experts_pair(args)
    rows, counts = routed_rows(args)
    variants = {"grouped GEMM": lambda: run_experts(grouped, rows, counts),
                "per-expert loop": lambda: run_experts(loop, rows, counts)}
    times = alternate(variants, args.repeats, args.warmup)
    return print_summary("experts only, forward + backward", times, "per-expert loop",
                         "grouped GEMM")


def main(argv=None):
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    parts = args.parts.split(",")
    print(f"torch {torch.__version__}, {args.threads} thread(s), tokens {args.tokens}, "
          f"hidden {args.hidden}, ffn {args.ffn}, experts {args.experts}, top-{args.topk}")
    if "layer" in parts:
        bench_layer(args)
    if "experts" in parts:
        bench_experts(args)
    if "dispatch" in parts:
        from bench.moe_dispatch import bench_dispatch
        bench_dispatch(args)
    if "model" in parts:
        from bench.moe_model import bench_model
        bench_model(args)


if __name__ == "__main__":
    main()
