"""What bench/moe.py and its parts (bench/moe_dispatch.py, bench/moe_model.py) share: the MoE
layer's config and HF's Mixtral block for it, the batch, one forward + backward of each, the
relative difference, and the alternating timing loop with its summary table. Its own module,
so the parts import it and not bench/moe.py, which imports them."""
import statistics
import time

import torch

from megatron.core.transformer.moe import MoEConfig
from megatron.core.transformer.transformer_config import TransformerConfig


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
