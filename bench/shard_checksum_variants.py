"""The shard write three ways, rotating (15 rounds): as before checksums, as it is (CRC-32 on a
second thread, the header rewritten at the end), and with the CRCs inline (no thread):
    python3 bench/shard_checksum_variants.py
Prints min / median / max and how many writes took over 0.9 s (page-cache writeback stalls)."""
import os, sys, time, tempfile, statistics
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, os.pardir)); sys.path.insert(0, HERE)
import torch
from shard_checksum_cost import write_without_checksums
from megatron.training.checkpointing.shard_file import write_shard_file, _CHUNK_BYTES, _tensor_bytes, DTYPES
from megatron.training.checkpointing import checksums
import json, struct

def inline_crc(path, tensors):
    """without's loop, with the CRCs computed inline (no thread, no header rewrite)."""
    header, offset = {}, 0
    for key, tensor in tensors:
        nbytes = tensor.numel() * tensor.element_size()
        header[key] = {"dtype": DTYPES[tensor.dtype], "shape": list(tensor.shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    encoded = json.dumps(header, separators=(",", ":")).encode(); encoded += b" " * (-len(encoded) % 8)
    sums = []
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(encoded))); f.write(encoded)
        for _, tensor in tensors:
            flat = tensor.detach().reshape(-1)
            step = max(1, _CHUNK_BYTES // max(1, flat.element_size()))
            for lo in range(0, flat.numel(), step):
                data = _tensor_bytes(flat[lo:lo + step].contiguous().cpu())
                sums += checksums.block_sums(data)
                f.write(data)
        f.flush(); os.fsync(f.fileno())

tensors = [(f"t{i}", torch.randn(2 * 1024 * 1024)) for i in range(120)]
path = os.path.join(tempfile.gettempdir(), "ckv.safetensors")
variants = {"without": write_without_checksums, "current": write_shard_file, "inline": inline_crc}
times = {k: [] for k in variants}
for r in range(15):
    for k, fn in variants.items():
        t = time.perf_counter(); fn(path, tensors); times[k].append(time.perf_counter() - t)
for k, v in times.items():
    print(f"{k:8s} min {min(v):.3f} median {statistics.median(v):.3f} max {max(v):.3f} over0.9s {sum(x > 0.9 for x in v)}")
os.remove(path)
