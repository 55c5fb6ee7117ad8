import pytest

from megatron.core.tensor_parallel import vocab_range_for_rank, vocab_size_with_padding


@pytest.mark.parametrize("vocab,divisible_by,tp,want", [
    (50257, 128, 1, 50304),  # GPT-2's vocabulary as Megatron pads it
    (50257, 128, 2, 50432),
    (32000, 128, 8, 32768),
    (32000, 1, 1, 32000),
    (13, 1, 4, 16),
    (16, 1, 4, 16),
])
def test_vocab_size_with_padding(vocab, divisible_by, tp, want):
    assert vocab_size_with_padding(vocab, divisible_by, tp) == want


def test_bad_values():
    with pytest.raises(ValueError, match="must all be positive"):
        vocab_size_with_padding(100, 0, 1)


def test_vocab_range_for_rank():
    assert [vocab_range_for_rank(16, r, 4) for r in range(4)] == [(0, 4), (4, 8), (8, 12),
                                                                  (12, 16)]
    with pytest.raises(ValueError, match="14 is not divisible by 4"):
        vocab_range_for_rank(14, 0, 4)
