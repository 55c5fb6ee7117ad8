"""The sharded format (``--ckpt-format torch_dist``) against the torch format and one
``torch.save`` at DP ranks, and the engine under it (our safetensors shards) against
``torch.distributed.checkpoint`` (DCP) on the same bytes.

    torchrun --standalone --nproc-per-node 1 bench/checkpoint_formats.py [--size-gb 1] [--repeats 3]
    torchrun --standalone --nproc-per-node 2 bench/checkpoint_formats.py [...]
    python3 bench/checkpoint.py --parts formats        # both, one after the other

Every rank builds the run as bench/checkpoint.py does (``pretrain()``'s construction, LLaMA
fp32 whose params + Adam state come to ``--size-gb``), with ``--use-distributed-optimizer``
(each DP rank owns 1/DP of the Adam state: the case the sharded format is for), takes one
training step (so the Adam state exists), then times, side by side in each repeat (the order
rotated every repeat, one untimed warm-up of each first, ``os.sync()`` before each):

- Saves (synchronous, fsynced, published): ``sharded`` = ``save_checkpoint`` with
  ``--ckpt-format torch_dist`` (every rank writes its shard); ``torch`` = ``--ckpt-format
  torch`` (the optimizer gathered to DP rank 0, which writes every file); ``torch.save`` = one
  ``torch.save`` + fsync of ``{"model": state_dict, "optimizer": optimizer.state_dict()}`` by
  rank 0 (the dict gathered once, untimed). Wall time = the slowest rank's, from a barrier.
- The engine, on identical bytes: each rank's pieces of the sharded save (read back once into
  memory, keys made unique over ranks) written with our ``write_shard_file`` (safetensors,
  fsync) against ``dcp.save`` of the same dict (FileSystemWriter defaults: one file per rank,
  fsync); read back with ``ShardFile.read`` of every key against ``dcp.load`` into fresh tensors.
- Loads (cold: the files' pages evicted after an fsync): ``load_checkpoint`` of each format
  into the model and optimizer at the same layout, and ``torch.load`` of the single file on
  rank 0. The first load of each kind is checked exact against the saved state (model params
  and this rank's Adam state), the engines' reads against the pieces written.
- ``--async-save`` of each format: the time ``save_checkpoint`` blocks the caller (it takes
  host copies and starts the writer thread; for the torch format that includes the gather to
  DP rank 0) against the time until ``wait()`` returns with the checkpoint published.
- Bytes written per rank, measured from the files (a rank's shard, plus the index on rank 0).
"""
import argparse
import glob
import os
import shutil
import statistics
import sys
import tempfile
import time

os.environ.setdefault("MEGATRON_DEVICE", "cpu")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from megatron.training.checkpointing import CheckpointWriter, load_checkpoint  # noqa: E402
from megatron.training.checkpointing.shard_file import ShardFile, write_shard_file  # noqa: E402
from megatron.training.checkpointing.sharded_index import (  # noqa: E402
    METADATA_FILE,
    shard_file_name,
)

from checkpoint_run import GB, Run, model_shape  # noqa: E402
from checkpoint_files import evict, fsync_file, remove_iterations, settle, size_of  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size-gb", type=float, default=1.0)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dir", default=tempfile.gettempdir())
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--idle", type=float, default=0.0)
    return p.parse_args(argv)


def slowest(seconds: float) -> float:
    t = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def timed(fn, idle: float) -> float:
    """The slowest rank's time for ``fn`` started together (after os.sync on every rank)."""
    settle(idle)
    dist.barrier()
    start = time.perf_counter()
    fn()
    return slowest(time.perf_counter() - start)


def on_rank0(fn):
    """``fn`` on rank 0 once every rank is done with what it changes."""
    dist.barrier()
    if dist.get_rank() == 0:
        fn()
    dist.barrier()


class Bench:
    def __init__(self, args, work):
        self.args, self.work = args, work
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.roots = {f: os.path.join(work, f) for f in ("torch_dist", "torch")}
        self.run = Run(args, self.roots["torch_dist"], extra="--use-distributed-optimizer")
        self.run.step()  # Adam state now exists
        self.whole_path = os.path.join(work, "whole", "state.pt")
        self.engine_dirs = {e: os.path.join(work, e) for e in ("safetensors", "dcp")}
        self.whole = None
        self.pieces = None

    # --- state -------------------------------------------------------------------------------

    def state_tensors(self):
        """(name, tensor, n) of this rank's params and its part of the Adam state (live): n =
        how many leading elements of the flat tensor are compared. The sharded format neither
        saves nor reads vocabulary padding rows (they load as zeros; the loss masks them), so
        a vocabulary tensor is compared on its first vocab_size rows only."""
        vocab = self.run.configs.model_kwargs["vocab_size"]

        def real(name, shape, begin, end):
            if not name.endswith(("word_embeddings.weight", "output_layer.weight")):
                return end - begin
            return max(0, min(end, vocab * shape[1]) - begin)

        shapes = {n: p.shape for n, p in self.run.module.named_parameters()}
        out = [(n, p, real(n, p.shape, 0, p.numel()))
               for n, p in self.run.module.named_parameters()]
        parts, _ = self.run.optimizer.sharded_state()
        for name, begin, end, values in parts:
            local = name.split("/", 1)[1]
            n = real(local, shapes[local], begin, end)
            out += [(f"{name}[{begin}:].{k}", v, n) for k, v in values.items()]
        return out

    def check(self, reference) -> str:
        bad = [n for (n, t, k), (_, ref, _) in zip(self.state_tensors(), reference)
               if not torch.equal(t.reshape(-1)[:k], ref.reshape(-1)[:k])]
        bad = [n for names in gathered(bad) for n in names]
        return "exact" if not bad else f"MISMATCH in {len(bad)} tensors (e.g. {bad[:4]})"

    def scramble(self):
        with torch.no_grad():
            for _, t, _ in self.state_tensors():
                t.fill_(0.5)

    # --- saves -------------------------------------------------------------------------------

    def save(self, fmt, writer):
        c = self.run.configs.training
        c.ckpt_format = fmt
        self.run.save(self.roots[fmt], writer)

    def fresh_iteration(self, fmt):
        on_rank0(lambda: remove_iterations(self.roots[fmt]))
        self.run.iteration += 1

    def bytes_per_rank(self, fmt):
        it = latest_dir(self.roots[fmt])
        if fmt == "torch_dist":
            mine = size_of(os.path.join(it, shard_file_name(self.rank)))
            if self.rank == 0:
                mine += size_of(os.path.join(it, METADATA_FILE))
        else:  # DP rank 0 writes every file (TP = PP = 1 here)
            mine = size_of(it) if self.rank == 0 else 0
        return gathered(mine)

    def prepare_engines(self):
        """This rank's pieces of the last sharded save, in memory, keys unique over ranks."""
        it = latest_dir(self.roots["torch_dist"])
        shard = ShardFile(os.path.join(it, shard_file_name(self.rank)))
        self.pieces = {f"r{self.rank}/{k}": shard.read(k) for k in shard.entries}

    def save_safetensors(self):
        path = os.path.join(self.engine_dirs["safetensors"], shard_file_name(self.rank))
        write_shard_file(path, list(self.pieces.items()))

    def save_dcp(self):
        dcp.save(self.pieces, checkpoint_id=self.engine_dirs["dcp"])

    def clear_engine(self, engine):
        def clear():
            shutil.rmtree(self.engine_dirs[engine], ignore_errors=True)
            os.makedirs(self.engine_dirs[engine])
        on_rank0(clear)

    def engine_bytes(self, engine):
        d = self.engine_dirs[engine]
        if engine == "safetensors":
            return gathered(size_of(os.path.join(d, shard_file_name(self.rank))))
        mine = sum(size_of(f) for f in glob.glob(os.path.join(d, f"__{self.rank}_*.distcp")))
        if self.rank == 0:
            mine += size_of(os.path.join(d, ".metadata"))
        return gathered(mine)

    def save_whole(self):
        if self.rank == 0:
            torch.save(self.whole, self.whole_path)
            fsync_file(self.whole_path)

    def bench_saves(self):
        idle = self.args.idle
        self.whole = {"model": self.run.module.state_dict(),
                      "optimizer": self.run.optimizer.state_dict()}  # gathers to rank 0
        if self.rank != 0:
            self.whole = None
        os.makedirs(os.path.dirname(self.whole_path), exist_ok=True)
        steps = {
            "sharded": (lambda: self.fresh_iteration("torch_dist"),
                        lambda: self.save("torch_dist", CheckpointWriter())),
            "torch": (lambda: self.fresh_iteration("torch"),
                      lambda: self.save("torch", CheckpointWriter())),
            "torch.save": (lambda: None, self.save_whole),
            "safetensors": (lambda: self.clear_engine("safetensors"), self.save_safetensors),
            "dcp": (lambda: self.clear_engine("dcp"), self.save_dcp),
        }
        times = {k: [] for k in steps}
        self.fresh_iteration("torch_dist")
        self.save("torch_dist", CheckpointWriter())
        self.prepare_engines()
        for name, (prep, fn) in steps.items():  # warm-up
            prep(), fn()
        for r in range(self.args.repeats):
            names = list(steps)
            names = names[r % len(names):] + names[:r % len(names)]
            for name in names:
                prep, fn = steps[name]
                prep()
                times[name].append(timed(fn, idle))
        sizes = {"sharded": self.bytes_per_rank("torch_dist"),
                 "torch": self.bytes_per_rank("torch"),
                 "torch.save": gathered(size_of(self.whole_path) if self.rank == 0 else 0),
                 "safetensors": self.engine_bytes("safetensors"),
                 "dcp": self.engine_bytes("dcp")}
        return times, sizes

    # --- loads -------------------------------------------------------------------------------

    def load(self, fmt):
        self.run.configs.training.load = self.roots[fmt]
        load_checkpoint(self.run.model, self.run.optimizer, self.run.scheduler,
                        self.run.configs)

    def load_whole(self):
        if self.rank == 0:
            torch.load(self.whole_path, weights_only=True)

    def read_safetensors(self):
        shard = ShardFile(os.path.join(self.engine_dirs["safetensors"],
                                       shard_file_name(self.rank)))
        return {k: shard.read(k) for k in shard.entries}

    def read_dcp(self):
        out = {k: torch.empty_like(v) for k, v in self.pieces.items()}
        dcp.load(out, checkpoint_id=self.engine_dirs["dcp"])
        return out

    def bench_loads(self):
        idle = self.args.idle
        reference = [(n, t.detach().clone(), k) for n, t, k in self.state_tensors()]
        checks = {}

        def checked(name, fn):
            def run():
                got = fn()
                if isinstance(got, dict) and name not in checks:
                    same = all(torch.equal(got[k], v) for k, v in self.pieces.items())
                    checks[name] = same
                return got
            return run

        steps = {
            "sharded": (self.roots["torch_dist"], lambda: self.load("torch_dist")),
            "torch": (self.roots["torch"], lambda: self.load("torch")),
            "torch.load": (self.whole_path, self.load_whole),
            "safetensors": (self.engine_dirs["safetensors"],
                            checked("safetensors", self.read_safetensors)),
            "dcp": (self.engine_dirs["dcp"], checked("dcp", self.read_dcp)),
        }
        times = {k: [] for k in steps}
        for _, fn in steps.values():  # warm-up
            fn()
        for r in range(self.args.repeats):
            names = list(steps)
            names = names[r % len(names):] + names[:r % len(names)]
            for name in names:
                path, fn = steps[name]
                on_rank0(lambda p=path: evict(p))
                first_model_load = r == 0 and name in ("sharded", "torch")
                if first_model_load:
                    self.scramble()
                times[name].append(timed(fn, idle))
                if first_model_load:
                    checks[name] = self.check(reference)
        checks = {k: v if isinstance(v, str) else
                  ("exact" if all(gathered(int(v))) else "MISMATCH") for k, v in checks.items()}
        return times, checks

    # --- async -------------------------------------------------------------------------------

    def bench_async(self):
        out = {}
        for fmt in ("torch_dist", "torch"):
            writer = CheckpointWriter(async_save=True)  # kept: its host buffers are reused
            self.fresh_iteration(fmt)
            self.save(fmt, writer), writer.wait()  # warm-up: allocates the host buffers
            blocked, published = [], []
            for _ in range(self.args.repeats):
                self.fresh_iteration(fmt)
                settle(self.args.idle)
                dist.barrier()
                start = time.perf_counter()
                self.save(fmt, writer)
                returned = time.perf_counter()
                writer.wait()
                done = time.perf_counter()
                blocked.append(slowest(returned - start))
                published.append(slowest(done - start))
            out[fmt] = (blocked, published)
        return out


def latest_dir(root):
    """The one iteration directory under ``root`` (each save removes the previous)."""
    (found,) = glob.glob(os.path.join(root, "iter_*"))
    return found


def gathered(value):
    values = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    return values


# --- report ---------------------------------------------------------------------------------

def med(xs):
    return statistics.median(xs)


def spread(xs):
    return f"{med(xs):6.3f} s ({min(xs):.3f}-{max(xs):.3f})"


def per_rank(sizes):
    return " / ".join(f"{b / GB:.3f}" for b in sizes)


def report(bench, saves, save_sizes, loads, checks, asyncs):
    w = bench.world
    print(f"SAVE (DP={w}; {bench.args.repeats} repeats, rotated; slowest rank; median "
          f"(best-worst); GB written by each rank; GB/s = all bytes / median)")
    for name in saves:
        ts, sizes = saves[name], save_sizes[name]
        print(f"  {name:12s} {spread(ts)}  {sum(sizes) / GB / med(ts):6.3f} GB/s  "
              f"per rank [{per_rank(sizes)}] GB")
    for a, b in (("sharded", "torch"), ("sharded", "torch.save"), ("dcp", "safetensors")):
        print(f"  time {a} / {b}: median {med(saves[a]) / med(saves[b]):.3f}, "
              f"best {min(saves[a]) / min(saves[b]):.3f}")
    print("LOAD (cold: pages evicted; same layout; into model + optimizer for the formats)")
    for name in loads:
        check = f"  state {checks[name]}" if name in checks else ""
        print(f"  {name:12s} {spread(loads[name])}{check}")
    for a, b in (("sharded", "torch"), ("dcp", "safetensors")):
        print(f"  time {a} / {b}: median {med(loads[a]) / med(loads[b]):.3f}, "
              f"best {min(loads[a]) / min(loads[b]):.3f}")
    print("ASYNC (--async-save: save_checkpoint returning vs wait() returning, published)")
    for fmt, (blocked, published) in asyncs.items():
        print(f"  {fmt:12s} blocks {spread(blocked)}, published after {spread(published)}, "
              f"blocked/published {med(blocked) / med(published):.3f}")


def main():
    args = parse_args()
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo")
    work = [tempfile.mkdtemp(prefix="bench_ckpt_formats_", dir=args.dir)
            if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(work, src=0)
    work = work[0]
    try:
        bench = Bench(args, work)
        hidden, ffn, layers = model_shape(args.size_gb)
        state = sum(t.numel() * t.element_size() for _, t, _ in bench.state_tensors())
        state = sum(gathered(state)) - (bench.world - 1) * sum(
            p.numel() * p.element_size() for p in bench.run.module.parameters())
        if bench.rank == 0:
            print("=" * 100)
            print(f"checkpoint formats bench: torch {torch.__version__}, DP={bench.world} gloo "
                  f"ranks x {args.threads} threads, {os.cpu_count()} CPUs, dir {work}")
            print(f"model: LLaMA fp32 layers={layers} hidden={hidden} ffn={ffn}, "
                  f"--use-distributed-optimizer; params + Adam state {state / GB:.3f} GB",
                  flush=True)
        saves, save_sizes = bench.bench_saves()
        loads, checks = bench.bench_loads()
        asyncs = bench.bench_async()
        if bench.rank == 0:
            report(bench, saves, save_sizes, loads, checks, asyncs)
            print("=" * 100, flush=True)
    finally:
        dist.barrier()
        if dist.get_rank() == 0:
            shutil.rmtree(work, ignore_errors=True)
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
