"""Batch construction: masks and position ids at EOD (hand-written), get_batch under TP=2."""
import pytest
import torch

from megatron.training.batch import get_batch, get_ltor_masks_and_position_ids
from tests.distributed import run_distributed

EOD = 0
T, F = True, False
DATA = torch.tensor([[5, 0, 7, 8, 0, 9],
                     [1, 2, 3, 4, 5, 6]])
CAUSAL = [[F, T, T, T, T, T],
          [F, F, T, T, T, T],
          [F, F, F, T, T, T],
          [F, F, F, F, T, T],
          [F, F, F, F, F, T],
          [F, F, F, F, F, F]]


def test_masks_reset_at_eod():
    attention, loss, positions = get_ltor_masks_and_position_ids(DATA, EOD, True, True, True)
    # Row 0 has three documents: [5, 0], [7, 8, 0], [9]; an EOD ends its own document.
    assert positions.tolist() == [[0, 1, 0, 1, 2, 0],
                                  [0, 1, 2, 3, 4, 5]]
    assert loss.dtype == torch.float32
    assert loss.tolist() == [[1.0, 0.0, 1.0, 1.0, 0.0, 1.0],
                             [1.0, 1.0, 1.0, 1.0, 1.0, 1.0]]
    assert attention.dtype == torch.bool and attention.shape == (2, 1, 6, 6)
    assert attention[0, 0].tolist() == [[F, T, T, T, T, T],
                                        [F, F, T, T, T, T],
                                        [T, T, F, T, T, T],
                                        [T, T, F, F, T, T],
                                        [T, T, F, F, F, T],
                                        [T, T, T, T, T, F]]
    assert attention[1, 0].tolist() == CAUSAL


def test_masks_without_resets():
    attention, loss, positions = get_ltor_masks_and_position_ids(DATA, EOD, False, False, False)
    assert attention.shape == (1, 1, 6, 6) and attention[0, 0].tolist() == CAUSAL
    assert loss.tolist() == [[1.0] * 6] * 2
    assert positions.tolist() == [list(range(6))] * 2
    # Each reset on its own.
    attention, _, positions = get_ltor_masks_and_position_ids(DATA, EOD, True, False, False)
    assert attention.shape == (1, 1, 6, 6) and positions[0].tolist() == [0, 1, 0, 1, 2, 0]
    attention, _, positions = get_ltor_masks_and_position_ids(DATA, EOD, False, True, False)
    assert attention.shape == (2, 1, 6, 6) and positions[0].tolist() == list(range(6))
    assert attention[0, 0, 5].tolist() == [T, T, T, T, T, F]


def megatron_masks(data, eod_token, reset_position_ids, reset_attention_mask, eod_mask_loss):
    """Megatron's loop implementation (the reference)."""
    b, s = data.size()
    att_b = b if reset_attention_mask else 1
    attention_mask = torch.tril(torch.ones((att_b, s, s))).view(att_b, 1, s, s)
    loss_mask = torch.ones(data.size(), dtype=torch.float)
    if eod_mask_loss:
        loss_mask[data == eod_token] = 0.0
    position_ids = torch.arange(s, dtype=torch.long).unsqueeze(0).expand_as(data).clone()
    for i in range(b):
        eod_index = position_ids[i, data[i] == eod_token].clone()
        prev = 0
        for j in eod_index.tolist():
            if reset_attention_mask:
                attention_mask[i, 0, (j + 1):, :(j + 1)] = 0
            if reset_position_ids:
                position_ids[i, (j + 1):] -= j + 1 - prev
                prev = j + 1
    return attention_mask < 0.5, loss_mask, position_ids


@pytest.mark.parametrize("flags", [(True, True, True), (True, False, False), (False, True, True)])
def test_masks_match_megatrons_loop_on_random_data(flags):
    data = torch.randint(0, 4, (3, 37), generator=torch.Generator().manual_seed(0))
    got = get_ltor_masks_and_position_ids(data, 0, *flags)
    want = megatron_masks(data, 0, *flags)
    for g, w in zip(got, want):
        assert g.shape == w.shape and torch.equal(g, w)


def _get_batch_on_tp_ranks():
    from megatron.core import parallel_state

    text = torch.tensor([[11, 12, 0, 13, 14], [21, 0, 22, 23, 24]])
    source = parallel_state.get_tensor_model_parallel_rank() == 0
    iterator = iter([{"text": text}]) if source else None
    tokens, labels, loss_mask, attention_mask, position_ids = get_batch(
        iterator, eod_token=0, reset_position_ids=True, reset_attention_mask=True,
        eod_mask_loss=True)
    return (source, tokens.tolist(), labels.tolist(), loss_mask.tolist(),
            attention_mask.tolist(), position_ids.tolist())


def test_get_batch_is_identical_on_every_tp_rank():
    rank0, rank1 = run_distributed(_get_batch_on_tp_ranks, world_size=2, tp=2)
    assert rank0[0] is True and rank1[0] is False  # only TP rank 0 had an iterator
    assert rank0[1:] == rank1[1:]
    _, tokens, labels, loss_mask, _, position_ids = rank1
    assert tokens == [[11, 12, 0, 13], [21, 0, 22, 23]]
    assert labels == [[12, 0, 13, 14], [0, 22, 23, 24]]
    assert loss_mask == [[1.0, 1.0, 0.0, 1.0], [1.0, 0.0, 1.0, 1.0]]
    assert position_ids == [[0, 1, 2, 0], [0, 1, 0, 1]]
