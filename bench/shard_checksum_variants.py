"""The shard write three ways, rotating (15 rounds of 1 GB each): as before checksums, as it
is (CRC-32 on a second thread, the header rewritten at the end), and with the CRCs computed
inline (no thread):

    python3 bench/shard_checksum_variants.py [--rounds 15]

Prints min / median / max of each and how many writes took over 0.9 s (page-cache writeback
stalls, which decide the median on a small VM; BENCHMARKS.md, "Checkpoint checksums")."""
import argparse
import os
import statistics
import sys
import tempfile
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, os.pardir))
sys.path.insert(0, HERE)

from megatron.training.checkpointing import checksums  # noqa: E402
from megatron.training.checkpointing.shard_file import write_shard_file  # noqa: E402
from shard_checksum_cost import write_without_checksums  # noqa: E402


def write_with_inline_checksums(path, tensors):
    """The pre-checksum loop with each chunk's block CRCs computed before its write."""
    write_without_checksums(path, tensors, on_chunk=checksums.block_sums)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=15)
    args = p.parse_args()
    tensors = [(f"t{i}", torch.randn(2 * 1024 * 1024)) for i in range(120)]  # 1.0 GB fp32
    path = os.path.join(tempfile.gettempdir(), "shard_checksum_variants.safetensors")
    variants = {"before checksums": write_without_checksums, "as it is": write_shard_file,
                "inline CRC": write_with_inline_checksums}
    times = {name: [] for name in variants}
    try:
        for _ in range(args.rounds):
            for name, write in variants.items():
                start = time.perf_counter()
                write(path, tensors)
                times[name].append(time.perf_counter() - start)
    finally:
        if os.path.exists(path):
            os.remove(path)
    base = statistics.median(times["before checksums"])
    for name, values in times.items():
        median = statistics.median(values)
        print(f"{name:17s} min {min(values):.3f} s  median {median:.3f} s  max {max(values):.3f}"
              f" s  over 0.9 s: {sum(v > 0.9 for v in values)}  median / before: "
              f"{median / base:.3f}")


if __name__ == "__main__":
    main()
