"""Seeded weight initialisation that does not depend on how the model is partitioned.

Each part of the model (embedding, layer L, output layer) draws its master weights from the CPU
generator seeded with ``base_seed + offset``: a layer gets the same initial weights whether it
sits on pipeline stage 0 or 3, in virtual chunk 0 or 1, at TP 1 or 8.
"""
import contextlib

import torch

EMBEDDING_OFFSET = 0
OUTPUT_LAYER_OFFSET = 1
POSITION_EMBEDDING_OFFSET = 2
FIRST_LAYER_OFFSET = 100


def draw_base_seed() -> int:
    """One draw from the CPU generator (seeded alike on every rank by the training script)."""
    return int(torch.randint(0, 2**31 - 1 - 100_000, (1,)).item())


@contextlib.contextmanager
def init_rng(seed: int):
    """Run a block with the CPU generator seeded; restore the outer state afterwards."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield
