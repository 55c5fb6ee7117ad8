"""Vocabulary partitioning (padding lives in megatron.core.utils, free of torch imports)."""
from typing import Tuple

from megatron.core.utils import divide, vocab_size_with_padding  # noqa: F401 (re-export)


def vocab_range_for_rank(padded_vocab_size: int, rank: int, world_size: int) -> Tuple[int, int]:
    """[start, end) of the vocabulary rows held by ``rank``."""
    per_partition = divide(padded_vocab_size, world_size, "vocab size by TP size")
    return rank * per_partition, (rank + 1) * per_partition
