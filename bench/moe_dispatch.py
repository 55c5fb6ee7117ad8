"""bench/moe.py's dispatch part: the all-to-all vs the all-gather dispatcher at EP=2.

Two gloo processes (bench/launch.py), parallel_state with expert_model_parallel_size 2: each
rank holds E/2 experts of the same global weights (HF's Mixtral block's, seed 0) and routes
its own tokens (a different batch per rank). One MoELayer per dispatcher, forward + backward
of sum(out^2). Both are checked first against HF's block run on the rank's tokens alone
(same weights: without capacity a token's output depends on its own row only). Timing as in
bench/moe.py: alternating per repeat, each step between barriers (the slower rank sets it).
"""
import dataclasses

import torch
import torch.distributed as dist

from bench.launch import launch
from bench.moe_common import (
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
from megatron.core import parallel_state
from megatron.core.transformer.moe.moe_layer import MoELayer

EP = 2


def ep_layer(args, block, dispatcher):
    config = moe_config(args, grouped=True, ep=EP)
    config = dataclasses.replace(config, moe=dataclasses.replace(
        config.moe, moe_token_dispatcher_type=dispatcher))
    layer = MoELayer(config)
    with torch.no_grad():
        layer.router.weight.copy_(block.gate.weight)
    layer.experts.load_full(block.experts.gate_up_proj.detach(),
                            block.experts.down_proj.detach())
    return layer


def dispatch_check(args, layers, block, x):
    """Largest relative |difference| of each dispatcher's output and input gradient from
    HF's."""
    hf_out, hf_grad = run_hf(block, hf_layout(x))
    result = {}
    for name, layer in layers.items():
        out, grad = run_ours(layer, x)
        result[name] = max(max_diff(hf_layout(out), hf_out), max_diff(hf_layout(grad), hf_grad))
    return result


def setup_rank(args, rank):
    """(the two EP=2 layers, HF's block, this rank's tokens)."""
    block = hf_block(args)
    layers = {name: ep_layer(args, block, name) for name in ("alltoall", "allgather")}
    return layers, block, tokens_batch(args, seed=10 + rank)


def run_rank(rank, world_size, args):
    torch.set_num_threads(args.threads)
    parallel_state.initialize_model_parallel(expert_model_parallel_size=EP)
    try:
        layers, block, x = setup_rank(args, rank)
        check = dispatch_check(args, layers, block, x)
        checks = [None] * world_size
        dist.all_gather_object(checks, check)
        variants = {f"EP=2 {name}": (lambda layer=layer: run_ours(layer, x))
                    for name, layer in layers.items()}
        times = alternate(variants, args.repeats, args.warmup, sync=dist.barrier)
        if rank == 0:
            print("EP=2 vs HF block on each rank's tokens, largest relative |difference|:", checks)
            print_summary("EP=2 MoE layer (2 processes), forward + backward", times,
                          "EP=2 allgather", "EP=2 alltoall")
    finally:
        parallel_state.destroy_model_parallel()


def bench_dispatch(args):
    launch(run_rank, EP, args, "bench/moe.py dispatch", threads=args.threads)
