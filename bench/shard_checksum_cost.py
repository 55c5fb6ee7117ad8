"""What the checksums cost a shard file's write, isolated from the rest of a save.

    python3 bench/shard_checksum_cost.py [--size-gb 1.0] [--repeats 8] [--dir /tmp]
                                         [--chunk-mib 64,2]

``write_shard_file`` (CRC-32 of every 1 MiB block on a second thread while the same chunk is
written, header rewritten in place) against the same streaming write without checksums (the
loop write_shard_file ran before issue 38, copied below), on the same ~``--size-gb`` of fp32
tensors, alternating (order swapped each repeat), each write fsynced and its file removed;
dirty pages flushed (os.sync, untimed) before each. bench/checkpoint.py --ckpt-format
torch_dist gives the whole save, whose spread on a shared 2-core VM hides a few percent.
``--chunk-mib A,B``: both writers at each of these chunk sizes (MiB, multiples of the 1 MiB
CRC block) in place of the one ``write_shard_file`` uses, every writer first in turn; the
ratios are against the first size's writer without checksums.
"""
import argparse
import functools
import json
import os
import statistics
import struct
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir))

from megatron.training.checkpointing import shard_file  # noqa: E402
from megatron.training.checkpointing.shard_file import (  # noqa: E402
    DTYPES,
    _tensor_bytes,
    write_shard_file,
)


def write_without_checksums(path, tensors, on_chunk=None):
    """write_shard_file as it was before checksums (same header, same streaming);
    ``on_chunk(bytes)`` runs on each chunk before its write (an inline checksum, say)."""
    header, offset = {}, 0
    for key, tensor in tensors:
        nbytes = tensor.numel() * tensor.element_size()
        header[key] = {"dtype": DTYPES[tensor.dtype], "shape": list(tensor.shape),
                       "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(encoded)))
        f.write(encoded)
        for _, tensor in tensors:
            flat = tensor.detach().reshape(-1)
            step = max(1, shard_file._CHUNK_BYTES // max(1, flat.element_size()))
            for lo in range(0, flat.numel(), step):
                data = _tensor_bytes(flat[lo:lo + step].contiguous().cpu())
                if on_chunk is not None:
                    on_chunk(data)
                f.write(data)
        f.flush()
        os.fsync(f.fileno())


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--size-gb", type=float, default=1.0)
    p.add_argument("--repeats", type=int, default=8)
    p.add_argument("--dir", default=tempfile.gettempdir())
    p.add_argument("--chunk-mib", default=None,
                   help="comma-separated chunk sizes in MiB to compare (default: the writer's)")
    args = p.parse_args()
    gen = torch.Generator().manual_seed(0)
    sizes = [s * 1024 for s in (4096, 1024, 4096, 11, 2048, 32)]  # mixed, some < 1 block
    tensors, total, n = [], 0, 0
    while total < args.size_gb * 1e9:
        numel = sizes[n % len(sizes)]
        tensors.append((f"t{n}", torch.randn(numel, generator=gen)))
        total += numel * 4
        n += 1
    path = os.path.join(tempfile.mkdtemp(dir=args.dir), "shard.safetensors")

    def at_chunk(mib, writer):
        if mib is not None:
            shard_file._CHUNK_BYTES = mib << 20  # both writers read it at call time
        writer(path, tensors)

    chunks = [int(c) for c in args.chunk_mib.split(",")] if args.chunk_mib else [None]
    sides = {}
    for mib in chunks:
        suffix = "" if mib is None else f", {mib} MiB"
        sides["with checksums" + suffix] = functools.partial(at_chunk, mib, write_shard_file)
        sides["without" + suffix] = functools.partial(at_chunk, mib, write_without_checksums)
    times = {name: [] for name in sides}
    names = list(sides)
    for r in range(args.repeats + 1):  # the first round is a warm-up
        for name in names[r % len(names):] + names[:r % len(names)]:
            os.sync()
            start = time.perf_counter()
            sides[name]()
            if r:
                times[name].append(time.perf_counter() - start)
            os.remove(path)
    print(f"shard write of {total / 1e9:.3f} GB in {len(tensors)} tensors, "
          f"{args.repeats} repeats, {os.cpu_count()} CPUs")
    base = statistics.median(times[names[1]])
    for name, xs in times.items():
        print(f"  {name:24s} min {min(xs):.3f} s  median {statistics.median(xs):.3f} s  "
              f"max {max(xs):.3f} s  over 0.9 s {sum(x > 0.9 for x in xs):2d}  median / "
              f"{names[1]} {statistics.median(xs) / base:.3f}  ["
              + " ".join(f"{x:.2f}" for x in xs) + "]")
    os.rmdir(os.path.dirname(path))


if __name__ == "__main__":
    main()
