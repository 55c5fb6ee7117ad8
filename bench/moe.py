"""Mixture of experts on CPU, fp32: our MoE layer against Hugging Face's Mixtral block,
grouped GEMM against the per-expert loop, and the all-to-all against the all-gather
dispatcher at EP=2.

    python bench/moe.py [--parts layer,experts,dispatch,model] [--tokens 1024 --hidden 256
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
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir))

from megatron.core.transformer.moe import MoEConfig  # noqa: E402
from megatron.core.transformer.moe.experts import SwiGLUExperts  # noqa: E402
from megatron.core.transformer.moe.moe_layer import MoELayer  # noqa: E402
from megatron.core.transformer.transformer_config import TransformerConfig  # noqa: E402


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


def moe_config(args, grouped=True, ep=1):
    return TransformerConfig(
        num_layers=1, hidden_size=args.hidden, num_attention_heads=4, activation="swiglu",
        add_bias_linear=False, normalization="RMSNorm", hidden_dropout=0.0,
        attention_dropout=0.0, expert_model_parallel_size=ep,
        moe=MoEConfig(num_moe_experts=args.experts, moe_ffn_hidden_size=args.ffn,
                      moe_router_topk=args.topk, moe_grouped_gemm=grouped))


def hf_block(args, implementation=None):
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
    config = MixtralConfig(hidden_size=args.hidden, intermediate_size=args.ffn,
                           num_local_experts=args.experts, num_experts_per_tok=args.topk,
                           num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=4)
    if implementation:
        config._experts_implementation = implementation
    torch.manual_seed(0)
    block = MixtralSparseMoeBlock(config)
    for param in block.parameters():
        torch.nn.init.normal_(param, std=0.05)
    return block


def ours_from_hf(args, block, grouped=True):
    """Our layer with the HF block's weights (the same [E, 2f, h] / [E, h, f] layouts)."""
    layer = MoELayer(moe_config(args, grouped))
    with torch.no_grad():
        layer.router.weight.copy_(block.gate.weight)
        layer.experts.weight1.copy_(block.experts.gate_up_proj)
        layer.experts.weight2.copy_(block.experts.down_proj)
    return layer


def tokens_batch(args, seed=1):
    """[s, b, h] with b = 2 (ours); HF takes the transpose [b, s, h]."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(args.tokens // 2, 2, args.hidden, generator=g)


def run_ours(layer, x):
    x = x.detach().requires_grad_()
    out, _ = layer(x)
    out.square().sum().backward()
    return out, x.grad


def run_hf(block, x):
    """x [b, s, h] (contiguous: the block views it)."""
    x = x.detach().requires_grad_()
    out = block(x)
    out.square().sum().backward()
    return out, x.grad


def hf_layout(x):
    return x.transpose(0, 1).contiguous()


def max_diff(a, b):
    """Largest |a - b| relative to the reference b's largest magnitude (gradients summed over
    many tokens are large: an absolute figure would say more about their size)."""
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


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


def timed(fn, sync=None):
    if sync:
        sync()
    start = time.perf_counter()
    fn()
    if sync:
        sync()
    return time.perf_counter() - start


def alternate(variants, repeats, warmup, sync=None):
    """{name: [seconds per repeat]}: each repeat runs every variant once, in turn."""
    times = {name: [] for name in variants}
    for step in range(warmup + repeats):
        for name, fn in variants.items():
            seconds = timed(fn, sync)
            if step >= warmup:
                times[name].append(seconds)
    return times


def summary(times, baseline, faster):
    """(median of the per-repeat baseline/faster ratios, (min, max) of them)."""
    ratios = [b / f for b, f in zip(times[baseline], times[faster])]
    return statistics.median(ratios), (min(ratios), max(ratios))


def print_summary(title, times, baselines, faster):
    """The table, and the ratio of each of ``baselines`` (a name or a list) to ``faster``;
    returns the first ratio."""
    baselines = [baselines] if isinstance(baselines, str) else baselines
    print(f"\n{title}")
    for name, t in times.items():
        print(f"  {name:30s} median {1e3 * statistics.median(t):9.2f} ms  "
              f"(min {1e3 * min(t):.2f}, max {1e3 * max(t):.2f})")
    ratios = []
    for baseline in baselines:
        ratio, spread = summary(times, baseline, faster)
        print(f"  {baseline} / {faster}: median ratio {ratio:.2f}x "
              f"(per-repeat {spread[0]:.2f}-{spread[1]:.2f}x)")
        ratios.append(ratio)
    return ratios[0]


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
