"""The printed table of bench/context_parallel.py (rank 0, from every rank's measurements)."""
import os
import statistics

import torch

from bench.context_parallel_trace import peer_wait

MIB = 2 ** 20
CP = 2


def expected_saved(args, seq, name):
    """Saved-for-backward bytes per rank from the kernels' own formulas (fp32, lse fp32):
    CP=1 SDPA's flash path and the ring keep q, k, v, out, lse of the rank's tokens;
    all_gather keeps q, out, lse of its tokens and the gathered K/V of the whole sequence."""
    b, hq, hkv, d, item = args.batch, args.heads, args.kv_heads, args.head_dim, 4
    s = seq if name == "cp1" else seq // CP
    q_out_lse = 2 * b * hq * s * d * item + b * hq * s * 4
    kv_tokens = seq if name == "all_gather" else s
    return q_out_lse + 2 * b * hkv * kv_tokens * d * item


def step_times(per_rank, name, steps):
    """A step lasts until the slower rank is done (cp1: rank 0 alone)."""
    ranks = per_rank[:1] if name == "cp1" else per_rank
    return [max(r["times"][name][i][0] for r in ranks) for i in range(steps)]


def cpu_time(per_rank, name, steps):
    """Median over steps of the CPU seconds of all ranks doing the work."""
    ranks = per_rank[:1] if name == "cp1" else per_rank
    return statistics.median(sum(r["times"][name][i][1] for r in ranks) for i in range(steps))


def _ms(x):
    return f"{x * 1e3:.1f}"


def _mib(x):
    return f"{x / MIB:.2f}"


def print_times(args, per_rank):
    times = {n: step_times(per_rank, n, args.steps) for n in ("cp1", "p2p", "all_gather")}
    med = {n: statistics.median(t) for n, t in times.items()}
    print("  step (fwd+bwd), ms: median (min-max) | CPU ms/step, ranks working summed | cores "
          "the step got = CPU / wall (CP=2 ranks sharing one core when the machine is busy: ~1)")
    for name, label in (("cp1", "CP=1 SDPA, 1 proc"), ("p2p", "CP=2 p2p"),
                        ("all_gather", "CP=2 all_gather")):
        ts = sorted(times[name])
        cpu = cpu_time(per_rank, name, args.steps)
        print(f"    {label:>18}: {_ms(med[name]):>8} ({_ms(ts[0])}-{_ms(ts[-1])}) | "
              f"CPU {_ms(cpu)} | cores {cpu / med[name]:.2f}")
    print("  ratios (median/median; median of per-round ratios):")
    for a, b in (("cp1", "p2p"), ("cp1", "all_gather"), ("all_gather", "p2p")):
        rounds = statistics.median(x / y for x, y in zip(times[a], times[b]))
        print(f"    time {a}/{b}: {med[a] / med[b]:.3f}; {rounds:.3f}")
    return med


def max_over_ranks(per_rank, name, key):
    return max(r["memory"][name][key] for r in per_rank if r["memory"][name] is not None)


def print_memory(args, seq, per_rank):
    print("  memory per rank, MiB: saved for backward [expected] | alive after forward | "
          "peak in forward | peak in fwd+bwd | transient peak (freed by the step's end)")
    for name in ("cp1", "p2p", "all_gather"):
        expected = expected_saved(args, seq, name)
        for r in per_rank:
            mem = r["memory"][name]
            if mem is None:
                continue
            ok = "ok" if mem["saved"] == expected else "MISMATCH"
            print(f"    {name:>10} rank {r['rank']}: {_mib(mem['saved'])} [{_mib(expected)} "
                  f"{ok}] | {_mib(mem['alive_after_forward'])} | {_mib(mem['forward_peak'])} "
                  f"| {_mib(mem['step_peak'])} | {_mib(mem['transient_peak'])}")
    cp1 = per_rank[0]["memory"]["cp1"]
    for name in ("p2p", "all_gather"):
        worst = {k: max_over_ranks(per_rank, name, k) for k in cp1}
        print(f"    {name}/cp1, larger rank: saved {worst['saved'] / cp1['saved']:.3f}, "
              f"peak fwd+bwd {worst['step_peak'] / cp1['step_peak']:.3f}")


def _median_field(traces, phase, key):
    return statistics.median(t[phase][key] for t in traces)


def print_overlap(args, per_rank):
    print(f"  ring overlap (median of {args.trace_steps} traced steps; window = post .. wait "
          f"return, hidden = window under block compute, exposed = blocked in wait):")
    for r in per_rank:
        hop, nbytes = r["exchange"]
        for phase in ("forward", "backward"):
            f = {k: _median_field(r["ring"], phase, k) for k in r["ring"][0][phase]}
            hidden = f["hidden"] / f["window"] if f["window"] else 0.0
            print(f"    rank {r['rank']} {phase:>8}: {int(f['exchanges'])} exchanges, window "
                  f"{_ms(f['window'])} ms, hidden {_ms(f['hidden'])} ms ({hidden:.1%}), "
                  f"exposed {f['exposed'] * 1e3:.2f} ms, compute {_ms(f['compute'])} of "
                  f"{_ms(f['span'])} ms; arrived before wait {int(f['arrived_before_wait'])}/"
                  f"{int(f['exchanges'])}; with no compute in window "
                  f"{int(f['unhidden_exchanges'])} (exposed {f['unhidden_exposed'] * 1e3:.2f} "
                  f"ms)")
        waits = [peer_wait(t["final_hop"], peer["final_hop"])
                 for t, peer in zip(r["ring"], per_rank[1 - r["rank"]]["ring"])]
        print(f"    rank {r['rank']} final dK/dV hop's wait (median): "
              f"{statistics.median(w[0] for w in waits) * 1e3:.2f} ms before the peer posted "
              f"it (the peer still computing), {statistics.median(w[1] for w in waits) * 1e3:.2f}"
              f" ms after")
        print(f"    rank {r['rank']} one hop alone ({_mib(nbytes)} MiB each way, post+wait, "
              f"no compute): {hop * 1e3:.2f} ms")
    for r in per_rank:
        coll = statistics.median(g["collectives"] for g in r["gather"])
        step = statistics.median(g["step"] for g in r["gather"])
        print(f"    all_gather rank {r['rank']}: {r['gather'][0]['calls']} blocking collectives "
              f"{coll * 1e3:.2f} ms of a {_ms(step)} ms step (none hidden)")


def summary(args, seq, per_rank, med):
    """One line per sequence length, for BENCHMARKS.md."""
    cp1 = per_rank[0]["memory"]["cp1"]
    mem = {n: {k: max_over_ranks(per_rank, n, k) for k in cp1} for n in ("p2p", "all_gather")}
    exposed = max(statistics.median(t["forward"]["exposed"] + t["backward"]["exposed"]
                                    for t in r["ring"]) for r in per_rank)
    final_hop = max(statistics.median(t["backward"]["unhidden_exposed"] for t in r["ring"])
                    for r in per_rank)
    hop = max(r["exchange"][0] for r in per_rank)
    hidden = min(statistics.median(
        (t["forward"]["hidden"] + t["backward"]["hidden"])
        / max(t["forward"]["window"] + t["backward"]["window"], 1e-12) for t in r["ring"])
        for r in per_rank)
    cores = {n: cpu_time(per_rank, n, args.steps) / med[n] for n in ("p2p", "all_gather")}
    print(f"SUMMARY seq={seq} | ms cp1 {_ms(med['cp1'])} p2p {_ms(med['p2p'])} all_gather "
          f"{_ms(med['all_gather'])} | cores p2p {cores['p2p']:.2f} ag "
          f"{cores['all_gather']:.2f} | cp1/p2p {med['cp1'] / med['p2p']:.3f} cp1/ag "
          f"{med['cp1'] / med['all_gather']:.3f} ag/p2p {med['all_gather'] / med['p2p']:.3f} | "
          + " | ".join(f"{label} MiB cp1 {_mib(cp1[k])} p2p {_mib(mem['p2p'][k])} ag "
                       f"{_mib(mem['all_gather'][k])}" for k, label in
                       (("saved", "saved"), ("step_peak", "peak"),
                        ("transient_peak", "transient")))
          + f" | ring hidden {hidden:.1%} exposed {exposed * 1e3:.2f} ms (final dK/dV hop "
          f"{final_hop * 1e3:.2f}) | one hop alone {hop * 1e3:.2f} ms")


def report(args, results):
    print("=" * 78)
    print(f"context parallel bench: CP={CP} (2 processes) vs CP=1 (1 process), gloo, 1 thread/"
          f"rank, torch {torch.__version__}")
    print("load average (1, 5, 15 min) at the end: "
          + ", ".join(f"{x:.2f}" for x in os.getloadavg()))
    print(f"attention core: b={args.batch} heads={args.heads} kv heads={args.kv_heads} "
          f"d={args.head_dim} fp32 causal, forward + backward; {args.steps} timed steps each "
          f"(after {args.warmup} warmup), alternating")
    lines = []
    for seq, per_rank in results.items():
        print(f"-- seq {seq} (CP=2: {seq // CP} tokens per rank)")
        for name, errors in per_rank[0]["check"].items():
            print(f"  check {name} vs CP=1, max |diff| out/dq/dk/dv: "
                  + " ".join(f"{e:.1e}" for e in errors))
        med = print_times(args, per_rank)
        print_memory(args, seq, per_rank)
        print_overlap(args, per_rank)
        lines.append((seq, per_rank, med))
    for seq, per_rank, med in lines:
        summary(args, seq, per_rank, med)
    print("=" * 78)
