"""bench/memory_modes.py, run tiny at DP=2: the memory it prints is the bytes of the tensors
each mode holds (counted here from shapes, not storages), and every mode trains to the same
losses.

Loss tolerance: 1e-6 relative (a few ulps of a loss near 5.5). The modes differ only in the
order of sums: the gradient norm for clipping taken whole or over shards, gradients reduced
by all-reduce or reduce-scatter; at DP=2 the reductions themselves are exact-order.
"""
import math

import pytest

from bench import memory_modes as bench
from tests.distributed import run_distributed

TINY = ("--layers 2 --hidden 64 --heads 4 --ffn 128 --vocab 256 --seq 32 --steps 1 "
        "--warmup 0 --repeats 1").split()
F32 = 4  # bytes


def _state_bytes(optimizer):
    """Adam's exp_avg, exp_avg_sq and step tensors, as this rank holds them (FSDP2: local
    shards of DTensors)."""
    local = [bench._local(t) for s in optimizer.optimizer.state.values() for t in s.values()]
    return sum(t.numel() * t.element_size() for t in local)


def _expected(name, chunks, optimizer):
    """(device, host) bytes of params + grads + optimizer state after the step, from the
    tensors' sizes: FSDP2 shards every parameter's dim 0 (padded up to a multiple of DP),
    the distributed optimizer shards buckets padded to a multiple of DP."""
    flags, shard_gradients, fsdp2 = bench.MODES[name]
    state = _state_bytes(optimizer)
    if fsdp2 is not None:
        shard = sum(math.ceil(p.shape[0] / bench.DP) * math.prod(p.shape[1:])
                    for p in chunks[0].module.parameters())
        return F32 * shard * 2 + state, 0  # sharded params and their gradients
    buckets = [b for chunk in chunks for b in chunk._buckets()]
    padded = sum(b.numel for b in buckets)
    if not flags:  # DDP: each parameter its own tensor, one gradient buffer
        return F32 * 2 * sum(p.numel() for p in chunks[0].module.parameters()) + state, 0
    grads = padded // bench.DP if shard_gradients else padded
    device = F32 * (padded + grads)  # the parameter buffer and the gradient buffer
    if flags.get("optimizer_cpu_offload"):  # host: main params, their gradients, the state
        return device, F32 * 2 * (padded // bench.DP) + state
    return device + state, 0  # fp32: the main params are the parameter buffer's shard


def _run_tiny():
    result = bench.run_modes(bench.parse_args(TINY))
    built = result.pop("built")
    expected = {name: _expected(name, chunks, optimizer)
                for name, (chunks, optimizer) in built.items()}
    result["parameters"] = sum(p.numel() for p in built["DDP"][0][0].module.parameters())
    return result, expected


def test_printed_memory_is_the_tensors_bytes_and_the_losses_agree(capsys):
    ranks = run_distributed(_run_tiny, world_size=2, tp=1)
    for result, expected in ranks:
        memory = result["memory"]
        for name, (device, host) in expected.items():
            assert (memory[name]["device"], memory[name]["host"]) == (device, host), name
        # Held through forward/backward: everything (no gradient or state freed there);
        # FSDP2 adds gathered params and full grads.
        base = bench.BASELINE
        for name in ("DDP", base):
            assert memory[name]["peak"] == memory[name]["device"]
        # ZeRO-2 with 2 microbatches: every full bucket lives next to the persistent shards
        # (the distributed optimizer's device state minus ZeRO-2's: the other DP-1 shards).
        zero2_dist = memory["ZeRO-2 (--shard-gradients)"]
        shard = (memory[base]["device"] - zero2_dist["device"]) // (bench.DP - 1)
        assert shard > 0 and zero2_dist["peak"] == memory[base]["device"] + shard
        offload = memory["dist. opt. + CPU offload"]
        assert offload["peak"] == offload["device"] + offload["host"]
        zero3, zero2 = memory["FSDP2 ZeRO-3"], memory["FSDP2 ZeRO-2"]
        assert zero3["device"] < zero3["peak"] <= zero2["peak"] < memory["DDP"]["device"]
        # Reducing once: the whole model's unsharded fp32 gradients held from the first
        # microbatch's backward to the reduction, on top of ZeRO-3's state
        once = memory["FSDP2 ZeRO-3, reduce once"]
        params = result["parameters"]
        assert once["device"] == zero3["device"]
        assert once["peak"] >= zero3["device"] + F32 * params and once["peak"] > zero3["peak"]
        steps = len(result["losses"][base])
        assert steps == 3  # first, instrumented, one timed
        for name, losses in result["losses"].items():
            assert losses == pytest.approx(result["losses"][base], rel=1e-6), name
    # The report prints the largest figure over the ranks.
    result = ranks[0][0]
    result["memory"] = {name: {k: max(r[0]["memory"][name][k] for r in ranks)
                               for k in bench.FIGURES} for name in result["memory"]}
    bench.report(bench.parse_args(TINY), result)
    lines = capsys.readouterr().out.splitlines()
    for name, m in result["memory"].items():
        row = next(line for line in lines if line.startswith(name))
        assert f"{bench._mib(m['device'])} + {bench._mib(m['host'])}" in row
        assert bench._mib(m["peak"]) in row
