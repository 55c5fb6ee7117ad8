"""Vocabulary partitioning and padding."""
from typing import Tuple

from megatron.core.utils import divide


def vocab_size_with_padding(orig_vocab_size: int, make_vocab_size_divisible_by: int = 128,
                            tensor_model_parallel_size: int = 1) -> int:
    """Pad the vocabulary to a multiple of ``make_vocab_size_divisible_by * TP`` so every TP
    rank holds an equal slice (and GEMMs get friendly shapes)."""
    if orig_vocab_size < 1 or make_vocab_size_divisible_by < 1 or tensor_model_parallel_size < 1:
        raise ValueError(
            f"vocab size ({orig_vocab_size}), make-vocab-size-divisible-by "
            f"({make_vocab_size_divisible_by}) and TP size ({tensor_model_parallel_size}) "
            f"must all be positive.")
    multiple = make_vocab_size_divisible_by * tensor_model_parallel_size
    return -(-orig_vocab_size // multiple) * multiple


def vocab_range_for_rank(padded_vocab_size: int, rank: int, world_size: int) -> Tuple[int, int]:
    """[start, end) of the vocabulary rows held by ``rank``."""
    per_partition = divide(padded_vocab_size, world_size, "vocab size by TP size")
    return rank * per_partition, (rank + 1) * per_partition
