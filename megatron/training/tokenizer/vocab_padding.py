"""How many embedding rows a run builds for a tokenizer: the vocabulary padded to a multiple of
``--make-vocab-size-divisible-by`` x TP (Megatron's rule), or exactly ``--padded-vocab-size``
when its authors padded it themselves (Qwen: 151,936 rows for ~151,669 tokens). Rows past the
tokenizer's tokens stay out of the softmax either way; the explicit ones are part of the model
(a checkpoint keeps them, conversion gives them back), TP padding is a layout detail."""
from typing import Optional


def padded_vocab_size(tokens: int, explicit: Optional[int], divisible_by: int,
                      tensor_parallel: int) -> int:
    """The embedding's row count; ValueError (one line: what and the fix) when ``explicit``
    cannot hold ``tokens`` or does not split evenly over the tensor-parallel ranks."""
    from megatron.core.utils import vocab_size_with_padding  # torch-free

    if explicit is None:
        return vocab_size_with_padding(tokens, divisible_by, tensor_parallel)
    if explicit < tokens:
        raise ValueError(f"--padded-vocab-size {explicit} is smaller than the tokenizer's "
                         f"{tokens} tokens; pass at least {tokens} (the checkpoint's embedding "
                         f"rows), or leave it out to pad to a multiple of "
                         f"--make-vocab-size-divisible-by x TP.")
    check_splits_over_tensor_parallel(explicit, tensor_parallel)
    return explicit


def check_splits_over_tensor_parallel(explicit: Optional[int], tensor_parallel: int) -> None:
    """Each TP rank holds an equal slice of the rows (known before the tokenizer is loaded)."""
    if explicit is not None and explicit % tensor_parallel:
        divisors = [d for d in range(2, min(explicit, 64) + 1) if explicit % d == 0][:6]
        hint = f" ({', '.join(map(str, divisors))} divide it)" if divisors else ""
        raise ValueError(f"--padded-vocab-size {explicit} does not split evenly over "
                         f"--tensor-model-parallel-size {tensor_parallel}; choose a "
                         f"tensor-parallel size that divides {explicit}{hint}, or 1.")


def rows_kept_in_checkpoints(tokens: int, explicit: Optional[int]) -> int:
    """The vocabulary rows a checkpoint holds: the explicit padding is the model's own."""
    return tokens if explicit is None else explicit
