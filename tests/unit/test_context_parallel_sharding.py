"""The load-balanced (head-tail) sequence layout of context parallelism."""
import pytest
import torch

from megatron.core.transformer.context_parallel import (
    load_balanced_positions,
    shard_sequence,
    unshard_sequence,
)


def test_positions_cp1_is_the_whole_sequence():
    assert load_balanced_positions(8, 1, 0).tolist() == list(range(8))


def test_positions_cp2():
    # 4 chunks of 2: rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2
    assert load_balanced_positions(8, 2, 0).tolist() == [0, 1, 6, 7]
    assert load_balanced_positions(8, 2, 1).tolist() == [2, 3, 4, 5]


def test_positions_cp4():
    # 8 chunks of 2: rank r holds chunks r and 7 - r
    expected = [[0, 1, 14, 15], [2, 3, 12, 13], [4, 5, 10, 11], [6, 7, 8, 9]]
    assert [load_balanced_positions(16, 4, r).tolist() for r in range(4)] == expected


def test_positions_cover_the_sequence_once_and_balance_causal_work():
    s, cp = 48, 4
    per_rank = [load_balanced_positions(s, cp, r) for r in range(cp)]
    assert sorted(torch.cat(per_rank).tolist()) == list(range(s))
    # causal work of a rank = keys its queries see = sum(pos + 1): equal on every rank
    work = {int((p + 1).sum()) for p in per_rank}
    assert len(work) == 1


def test_positions_error_names_lengths_and_fix():
    with pytest.raises(ValueError, match=r"sequence length 12 .*2\*CP = 8.*multiple of 8"):
        load_balanced_positions(12, 4, 0)
    with pytest.raises(ValueError, match="cp_rank 2"):
        load_balanced_positions(16, 2, 2)


@pytest.mark.parametrize("cp", [1, 2, 4])
@pytest.mark.parametrize("dim", [0, 1, 2])
def test_shard_unshard_round_trip(cp, dim):
    full = torch.randn(16, 16, 16)
    shards = [shard_sequence(full, dim, cp, r) for r in range(cp)]
    assert all(s.shape[dim] == 16 // cp and s.is_contiguous() for s in shards)
    assert torch.equal(unshard_sequence(shards, dim), full)


def test_shard_picks_the_positions():
    tokens = torch.arange(16).view(1, 16)
    assert shard_sequence(tokens, 1, 4, 1).tolist() == [[2, 3, 12, 13]]


def test_shard_is_identity_at_cp1():
    full = torch.randn(3, 5)  # odd length is fine without CP
    assert shard_sequence(full, 1, 1, 0) is full
