"""Checkpoint save/load throughput against plain torch.save/torch.load, and how long
--async-save blocks training against a synchronous save.

    python3 bench/checkpoint.py [--size-gb 1.0] [--repeats 5] [--dir /tmp] [--threads 2]
                               [--parts save,load,async] [--idle 0] [--ckpt-format torch]
    python3 bench/checkpoint.py --parts formats [--size-gb 1.0] [--format-repeats 3]

``--parts formats`` runs bench/checkpoint_formats.py under torchrun at DP=1 and then DP=2 (the
sharded ``--ckpt-format torch_dist`` against ``--ckpt-format torch`` and one torch.save, the
safetensors engine against torch.distributed.checkpoint, and ``--async-save`` of both formats:
see that file). The parts below are the one-process comparison with plain torch.save.

One process (world size 1, gloo, CPU), built as ``pretrain()`` builds a run: Megatron flags ->
``build_configs`` -> ``initialize_megatron`` -> ``build_model`` (LLaMA, fp32, DDP-wrapped) ->
``get_megatron_optimizer`` (fused AdamW) -> ``OptimizerParamScheduler``; mock data,
NullTokenizer. The model's shape is chosen so that its parameters plus Adam's exp_avg and
exp_avg_sq (12 bytes per parameter) come to about ``--size-gb``; one real training step
(``train_step``) runs first, so the Adam state exists. Everything is written under a fresh
directory in ``--dir`` (same disk for both sides) and removed at the end. Saves and loads each
get one untimed warm-up of every contender first (the VM's first touch of fresh page-cache and
heap memory is slow and would land on whichever side runs first).

1. Save. Ours: ``save_checkpoint`` with a synchronous ``CheckpointWriter`` (state capture,
   torch.save to a staging file, fsync, rename, publish: directory rename + tracker file).
   Peer: ``torch.save({"model": model.state_dict(), "optimizer": adam.state_dict()}, path)``,
   the same tensors as one dict, then (timed separately) an fsync of the file: ours fsyncs
   (atomic save), plain torch.save does not, so both figures are given. Dirty pages are
   flushed (os.sync, untimed) before every timed save, so neither side pays for the other's
   writeback. With ``--ckpt-format torch_dist`` a third contender is ours without the
   checksums (each shard file written by the streaming loop of before them,
   bench/shard_checksum_cost.py): what they cost a whole save. The contenders take turns
   going first, repeat by repeat; medians and bests.
   Separately, ``optimizer.state_dict()`` alone (the part of ours that copies the Adam state).
2. Load. Ours: ``load_checkpoint`` (memory-maps the file with weights_only=True, copies the
   weights into the model, clones the Adam state into the optimizer): timed until the tensors
   are in the model and the optimizer. Peer: ``torch.load(path, weights_only=True)`` +
   ``model.load_state_dict`` + ``adam.load_state_dict``; also ``torch.load`` alone. Each is
   timed cold (the file's pages evicted from the page cache with posix_fadvise(DONTNEED)
   after an fsync: the read comes from the disk, or whatever caches the VM's disk on the host)
   and warm (right after: the file is in the page cache). After the first load of each kind
   the model and optimizer state (overwritten before it) are compared with the state that
   was saved (exact).
3. Async. With ``CheckpointWriter(async_save=True)``: the time ``save_checkpoint`` blocks the
   caller (it clones the state, starts the writer thread and returns), then training steps
   with ``writer.poll()`` after each, as in ``pretrain()``, until the checkpoint is published
   (the publish runs inside the poll that sees the write done: counted as blocking too).
   Each repeat also takes, side by side, steps without any save, a synchronous save between
   steps, and an async save followed at once by ``wait()`` (the background write on its own).
   The honest cost of an async save is the blocked time plus how much longer the steps that
   ran during the background write took than steps without one.

On the 2-vCPU development VM a 1 GB write into the page cache takes 0.5 to 3.5 s depending on
whether the kernel can reuse memory freed moments before (see ``settle``); single samples
swing by 2-3x for both sides alike, hence the repeats, the alternation and the bests.
"""
import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("MEGATRON_DEVICE", "cpu")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir))

from megatron.training.checkpointing import (  # noqa: E402
    CheckpointWriter,
    load_checkpoint,
)

from checkpoint_run import GB, Run, model_shape  # noqa: E402  (bench/ is on sys.path)
from checkpoint_files import (  # noqa: E402
    evict,
    fsync_file,
    remove_iterations,
    resident_fraction,
    settle,
    size_of,
)



def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size-gb", type=float, default=1.0,
                   help="target size of fp32 params + Adam exp_avg + exp_avg_sq (1e9 bytes)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--dir", default=tempfile.gettempdir(),
                   help="a fresh directory is made (and removed) under this one")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seq", type=int, default=128, help="tokens per training step")
    p.add_argument("--steps", type=int, default=3,
                   help="steps without a save per repeat of the async part (step-time baseline)")
    p.add_argument("--max-steps-during-write", type=int, default=100)
    p.add_argument("--parts", default="save,load,async",
                   help="which parts to run (load needs save; formats: DP=1 and DP=2 runs)")
    p.add_argument("--format-repeats", type=int, default=3,
                   help="repeats of bench/checkpoint_formats.py (--parts formats)")
    p.add_argument("--ckpt-format", default="torch", choices=["torch", "torch_dist"],
                   help="the format ours saves and loads in the save/load/async parts")
    p.add_argument("--idle", type=float, default=0.0,
                   help="seconds to wait before each timed save/load (see settle())")
    return p.parse_args(argv)


# --- the three parts ------------------------------------------------------------------------

def bench_save(run, args, root, peer_path):
    ours, unchecked, peer, peer_fsync, optim_sd = [], [], [], [], []
    ours_bytes = peer_bytes = 0

    def save_ours(times=ours):
        nonlocal ours_bytes
        remove_iterations(root)
        run.iteration += 1  # a new iteration directory each time (nothing to replace)
        settle(args.idle)
        start = time.perf_counter()
        run.save(root, CheckpointWriter(async_save=False))
        times.append(time.perf_counter() - start)
        ours_bytes = size_of(root)

    def save_unchecked():
        """torch_dist: the same save with each shard file written by the streaming loop of
        before the checksums (same chunks, no CRC): what the checksums cost a whole save."""
        from shard_checksum_cost import write_without_checksums

        from megatron.training.checkpointing import sharded_save

        checked = sharded_save.write_shard_file
        sharded_save.write_shard_file = \
            lambda path, tensors, *_, **__: write_without_checksums(path, tensors)
        try:
            save_ours(unchecked)
        finally:
            sharded_save.write_shard_file = checked

    def save_peer():
        nonlocal peer_bytes
        if os.path.exists(peer_path):
            os.remove(peer_path)
        settle(args.idle)
        start = time.perf_counter()
        torch.save({"model": run.module.state_dict(), "optimizer": run.adam.state_dict()},
                   peer_path)
        mid = time.perf_counter()
        fsync_file(peer_path)
        end = time.perf_counter()
        peer.append(mid - start)
        peer_fsync.append(end - start)
        peer_bytes = size_of(peer_path)

    contenders = [save_ours, save_peer] + \
        ([save_unchecked] if args.ckpt_format == "torch_dist" else [])
    for fn in contenders:  # untimed warm-up: the VM's first touch of page-cache memory
        fn()
    for lst in (ours, unchecked, peer, peer_fsync):
        lst.clear()
    for r in range(args.repeats):  # each contender first in turn
        for fn in contenders[r % len(contenders):] + contenders[:r % len(contenders)]:
            fn()
        # the part of ours that clones the Adam state (optimizer.state_dict()), on its own
        settle(args.idle)
        start = time.perf_counter()
        sd = run.optimizer.state_dict()
        optim_sd.append(time.perf_counter() - start)
        del sd
    return dict(ours=ours, unchecked=unchecked, peer=peer, peer_fsync=peer_fsync,
                ours_bytes=ours_bytes,
                peer_bytes=peer_bytes, optim_state_dict=optim_sd)


def check_state(run, reference):
    bad = [n for (n, t), (_, ref) in zip(run.state_tensors(), reference)
           if not torch.equal(t, ref)]
    return "exact" if not bad else f"MISMATCH in {len(bad)} tensors (e.g. {bad[0]})"


def scramble(run):
    """Overwrite params and Adam state, so a load that did nothing would be caught."""
    with torch.no_grad():
        for _, t in run.state_tensors():
            t.fill_(0.5)


def bench_load(run, args, root, peer_path, reference):
    times = {k: {"cold": [], "warm": []} for k in ("ours", "peer", "torch.load")}
    checks = {}
    residency = {}

    def ours():
        load_checkpoint(run.model, run.optimizer, run.scheduler, run.configs)

    def peer():
        sd = torch.load(peer_path, weights_only=True)
        run.module.load_state_dict(sd["model"])
        run.adam.load_state_dict(sd["optimizer"])

    def plain():
        return torch.load(peer_path, weights_only=True)

    contenders = (("ours", ours, root), ("peer", peer, peer_path), ("torch.load", plain,
                                                                     peer_path))
    ours(), peer(), plain()  # untimed warm-up, as for the saves
    for r in range(args.repeats):
        order = contenders if r % 2 == 0 else contenders[::-1]
        for name, fn, path in order:
            for temp in ("cold", "warm"):
                if temp == "cold":
                    evict(path)
                    if r == 0:
                        residency[name] = resident_fraction(path)
                if name != "torch.load" and r == 0 and temp == "cold":
                    scramble(run)
                settle(args.idle)
                start = time.perf_counter()
                out = fn()
                times[name][temp].append(time.perf_counter() - start)
                del out
                if name != "torch.load" and r == 0 and temp == "cold":
                    checks[name] = check_state(run, reference)
    return times, checks, residency


def bench_async(run, args, root):
    baseline, during, sync = [], [], []
    blocked_save, blocked_poll, published, steps_during, alone = [], [], [], [], []
    for r in range(args.repeats):
        # steps without a save
        for _ in range(args.steps):
            start = time.perf_counter()
            run.step()
            baseline.append(time.perf_counter() - start)
        # a synchronous save between steps
        remove_iterations(root)
        run.step()
        settle(args.idle)
        start = time.perf_counter()
        run.save(root, CheckpointWriter(async_save=False))
        sync.append(time.perf_counter() - start)
        # an async save, then steps polling as pretrain() does, until it is published
        remove_iterations(root)
        run.step()
        settle(args.idle)
        writer = CheckpointWriter(async_save=True)
        start = time.perf_counter()
        run.save(root, writer)
        returned = time.perf_counter()
        blocked_save.append(returned - start)
        poll_time, n = 0.0, 0
        while True:
            s = time.perf_counter()
            run.step()
            during.append(time.perf_counter() - s)
            n += 1
            s = time.perf_counter()
            done = writer.poll()
            poll_time += time.perf_counter() - s
            if done:
                break
            if n >= args.max_steps_during_write:
                writer.wait()
                break
        published.append(time.perf_counter() - start)
        blocked_poll.append(poll_time)
        steps_during.append(n)
        # the background write on its own: an async save, then wait() at once (no steps)
        remove_iterations(root)
        run.iteration += 1
        settle(args.idle)
        writer = CheckpointWriter(async_save=True)
        start = time.perf_counter()
        run.save(root, writer)
        writer.wait()
        alone.append(time.perf_counter() - start)
    return dict(baseline=baseline, during=during, sync=sync, blocked_save=blocked_save,
                blocked_poll=blocked_poll, published=published, steps_during=steps_during,
                alone=alone)


# --- report ---------------------------------------------------------------------------------

def med(xs):
    return statistics.median(xs)


def spread(xs):
    """median (best-worst) and every value, in run order."""
    return (f"{med(xs):6.3f} s ({min(xs):.3f}-{max(xs):.3f}) ["
            + " ".join(f"{x:.2f}" for x in xs) + "]")


def report_save(s, repeats):
    ob, pb = s["ours_bytes"], s["peer_bytes"]
    print(f"SAVE ({repeats} repeats after a warm-up, alternating, order swapped each repeat; "
          f"median (best-worst) [each]; GB/s of the file written, at the median)")
    rows = (("ours", "ours save_checkpoint (sync, fsync+publish)", ob),
            ("peer", "peer torch.save (no fsync)", pb),
            ("peer_fsync", "peer torch.save + fsync", pb))
    for key, label, b in rows:
        print(f"  {label:44s} {b / GB / med(s[key]):6.3f} GB/s  {spread(s[key])}")
    print(f"  file sizes: ours {ob:,} bytes, peer {pb:,} bytes")
    for stat, fn in (("median", med), ("best", min)):
        ours = ob / fn(s["ours"])
        print(f"  ratio ours/peer GB/s ({stat}): vs torch.save+fsync "
              f"{ours / (pb / fn(s['peer_fsync'])):.3f}, vs torch.save alone "
              f"{ours / (pb / fn(s['peer'])):.3f}   (target >= 0.9)")
    if s["unchecked"]:
        print(f"  {'ours without checksums (same save, no CRC)':44s} "
              f"{ob / GB / med(s['unchecked']):6.3f} GB/s  {spread(s['unchecked'])}")
        print(f"  ratio ours with / without checksums, time: median "
              f"{med(s['ours']) / med(s['unchecked']):.3f}, best "
              f"{min(s['ours']) / min(s['unchecked']):.3f}   (target <= 1.05)")
    print(f"  in ours: optimizer.state_dict() (clones exp_avg, exp_avg_sq) alone "
          f"{spread(s['optim_state_dict'])}")


def report_load(times, checks, residency, ob, pb, repeats):
    print(f"LOAD ({repeats} repeats after a warm-up; cold = the file's pages evicted with "
          f"fadvise, warm = in the page cache; GB/s of the file read, at the median)")
    if any(v is not None for v in residency.values()):
        print("  in page cache after eviction (fincore): " + ", ".join(
            f"{k} {v:.1%}" for k, v in residency.items() if v is not None))
    for name, label, b in (("ours", "ours load_checkpoint (into model+optim)", ob),
                           ("peer", "peer torch.load + 2x load_state_dict", pb),
                           ("torch.load", "torch.load alone", pb)):
        for temp in ("cold", "warm"):
            ts = times[name][temp]
            check = f"  state {checks[name]}" if name in checks and temp == "cold" else ""
            print(f"  {label:40s} {temp} {b / GB / med(ts):6.3f} GB/s  {spread(ts)}{check}")
    for temp in ("cold", "warm"):
        for stat, fn in (("median", med), ("best", min)):
            ours = ob / fn(times["ours"][temp])
            print(f"  ratio ours/peer GB/s ({temp}, {stat}): vs torch.load+load_state_dict "
                  f"{ours / (pb / fn(times['peer'][temp])):.3f}, vs torch.load alone "
                  f"{ours / (pb / fn(times['torch.load'][temp])):.3f}")


def report_async(a, args):
    print(f"ASYNC ({args.repeats} repeats; training steps of seq {args.seq} with poll() after "
          f"each, as pretrain() does)")
    base = med(a["baseline"])
    blocked = [x + y for x, y in zip(a["blocked_save"], a["blocked_poll"])]
    bounds = [sum(a["steps_during"][:i]) for i in range(len(a["steps_during"]) + 1)]
    per_save = [a["during"][bounds[i]:bounds[i + 1]] for i in range(len(bounds) - 1)]
    extra = [sum(steps) - len(steps) * base for steps in per_save]
    sync, alone = med(a["sync"]), med(a["alone"])
    print(f"  sync save_checkpoint between steps      {spread(a['sync'])}")
    print(f"  async save + wait() at once (no steps)  {spread(a['alone'])}")
    print(f"  async: save_checkpoint blocks           {spread(a['blocked_save'])}")
    print(f"         poll() calls incl. publish       {spread(a['blocked_poll'])}")
    print(f"         blocked in all                   {spread(blocked)}")
    print(f"         -> {med(blocked) / sync:.3f} of the sync save, {med(blocked) / alone:.3f} "
          f"of async save + wait()   (target < 0.2)")
    print(f"         save to published                {spread(a['published'])}, "
          f"{a['steps_during']} steps meanwhile")
    print(f"  step time without a save                {spread(a['baseline'])}")
    print("  steps during each write: " + "; ".join(
        ", ".join(f"{x:.2f}" for x in steps) for steps in per_save) +
        f" s: median x{med(a['during']) / base:.2f} the step without a save")
    print(f"  extra step time during a write (sum of its steps - as many steps without a save) "
          f"{spread(extra)}")
    print(f"  blocked + extra = {med(blocked) + med(extra):.3f} s = "
          f"{(med(blocked) + med(extra)) / sync:.3f} of the sync save")


def run_formats(args):
    """bench/checkpoint_formats.py at DP=1 and DP=2 (one torch thread per rank: 2 ranks on
    this 2-core machine), one after the other."""
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "checkpoint_formats.py")
    for dp in (1, 2):
        subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                        "--nproc-per-node", str(dp), script, "--size-gb", str(args.size_gb),
                        "--repeats", str(args.format_repeats), "--dir", args.dir,
                        "--seq", str(args.seq), "--idle", str(args.idle)], check=True)


def main():
    args = parse_args()
    parts = set(args.parts.split(","))
    if "formats" in parts:
        run_formats(args)
        parts.discard("formats")
        if not parts:
            return
    torch.set_num_threads(args.threads)
    work = tempfile.mkdtemp(prefix="bench_checkpoint_", dir=args.dir)
    root, peer_path = os.path.join(work, "ckpt"), os.path.join(work, "peer", "state.pt")
    os.makedirs(os.path.dirname(peer_path))
    try:
        # The torch format (one file per TP/PP position) by default, as the parts below
        # describe; --ckpt-format torch_dist: the sharded default (one shard file, world size 1).
        run = Run(args, root, extra=f"--ckpt-format {args.ckpt_format}")
        start = time.perf_counter()
        run.step()  # Adam state now exists
        first_step = time.perf_counter() - start
        n_params = sum(p.numel() for p in run.module.parameters())
        state_bytes = sum(t.numel() * t.element_size() for _, t in run.state_tensors())
        hidden, ffn, layers = model_shape(args.size_gb)
        print("=" * 100)
        print(f"checkpoint bench: --ckpt-format {args.ckpt_format}, torch {torch.__version__}, "
              f"{args.threads} threads, "
              f"{os.cpu_count()} CPUs, dir {work}")
        print(f"model: LLaMA fp32 layers={layers} hidden={hidden} heads={hidden // 64} "
              f"ffn={ffn} vocab={run.configs.model_kwargs['padded_vocab_size']} (untied), "
              f"{n_params:,} params")
        print(f"state: params + exp_avg + exp_avg_sq = {state_bytes:,} bytes "
              f"({state_bytes / GB:.3f} GB); first training step (seq {args.seq}) "
              f"{first_step:.2f} s; before each timed save/load: os.sync()"
              + (f" and {args.idle:g} s idle" if args.idle else ""), flush=True)
        if parts & {"save", "load"}:
            s = bench_save(run, args, root, peer_path)
            print("-" * 100)
            report_save(s, args.repeats)
            if "load" in parts:
                # The state stays as saved by bench_save's last saves (both sides) until the
                # loads are done; the reference is that state.
                reference = [(n, t.detach().clone()) for n, t in run.state_tensors()]
                times, checks, residency = bench_load(run, args, root, peer_path, reference)
                del reference
                report_load(times, checks, residency, s["ours_bytes"], s["peer_bytes"],
                            args.repeats)
        if "async" in parts:
            a = bench_async(run, args, root)
            report_async(a, args)
        print("=" * 100)
    finally:
        shutil.rmtree(work, ignore_errors=True)
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
