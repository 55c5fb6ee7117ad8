"""Batch construction: masks and position ids at EOD (hand-written), get_batch under TP=2."""
import pytest
import torch

from megatron.training.data.batch import get_batch, get_ltor_masks_and_position_ids
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
    from megatron.core.packed_seq_params import packed_seq_params_from_eod

    # No [b, 1, s, s] mask: packed documents go to attention as boundaries.
    packed = packed_seq_params_from_eod(tokens, 0)
    return (source, tokens.tolist(), labels.tolist(), loss_mask.tolist(),
            (attention_mask, packed.cu_seqlens.tolist(), packed.max_seqlen),
            position_ids.tolist())


def test_get_batch_is_identical_on_every_tp_rank():
    rank0, rank1 = run_distributed(_get_batch_on_tp_ranks, world_size=2, tp=2)
    assert rank0[0] is True and rank1[0] is False  # only TP rank 0 had an iterator
    assert rank0[1:] == rank1[1:]
    _, tokens, labels, loss_mask, packed, position_ids = rank1
    assert tokens == [[11, 12, 0, 13], [21, 0, 22, 23]]
    # Documents [11 12 0] [13] | [21 0] [22 23]: an EOD ends its document, so does a row.
    assert packed == (None, [0, 3, 4, 6, 8], 3)
    assert labels == [[12, 0, 13, 14], [0, 22, 23, 24]]
    assert loss_mask == [[1.0, 1.0, 0.0, 1.0], [1.0, 0.0, 1.0, 1.0]]
    assert position_ids == [[0, 1, 2, 0], [0, 1, 0, 1]]


# ---------------------------------------------------------------- the data path per stage

MBS, SEQ = 2, 4
TEXT = torch.tensor([[11, 12, 0, 13, 14], [21, 0, 22, 23, 24]])  # [MBS, SEQ + 1]


class _CountingIterator:
    def __init__(self, batches):
        self._batches, self.calls = iter(batches), 0

    def __iter__(self):
        return self

    def __next__(self):
        self.calls += 1
        return next(self._batches)


def _as_lists(batch):
    return [None if t is None else t.tolist() for t in batch]


def _reads_on_each_stage(reset):
    from megatron.core import parallel_state

    iterator = _CountingIterator([{"text": TEXT}])
    batch = get_batch(iterator, 0, reset, reset, True, MBS, SEQ)
    return (parallel_state.get_pipeline_model_parallel_rank(), iterator.calls,
            _as_lists(batch))


def test_middle_stages_never_read_their_iterator():
    want = [[11, 12, 0, 13], [21, 0, 22, 23]]
    for stage, calls, batch in run_distributed(_reads_on_each_stage, world_size=4, pp=4,
                                               reset=False):
        if stage in (1, 2):
            assert calls == 0 and batch == [None] * 5, stage
            continue
        assert calls == 1
        tokens, labels, loss_mask, _, _ = batch
        assert tokens == want
        # The first stage embeds; labels and loss mask only on the last.
        if stage == 0:
            assert labels is None and loss_mask is None
        else:
            assert labels == [[12, 0, 13, 14], [0, 22, 23, 24]]
            assert loss_mask == [[1.0, 1.0, 0.0, 1.0], [1.0, 0.0, 1.0, 1.0]]
    # Per-document positions and masks are used by every layer: every stage reads then.
    results = run_distributed(_reads_on_each_stage, world_size=4, pp=4, reset=True)
    assert [calls for _, calls, _ in results] == [1, 1, 1, 1]
    assert {str(batch[4]) for _, _, batch in results} == {str([[0, 1, 2, 0], [0, 1, 0, 1]])}


def _reads_per_model_chunk():
    from megatron.core import parallel_state

    calls = []
    for chunk in range(2):
        parallel_state.set_virtual_pipeline_model_parallel_rank(chunk)
        iterator = _CountingIterator([{"text": TEXT}])
        get_batch(iterator, 0, False, False, False, MBS, SEQ)
        calls.append(iterator.calls)
    parallel_state.set_virtual_pipeline_model_parallel_rank(0)
    return calls


def test_interleaved_only_the_first_and_last_virtual_stages_read():
    # Virtual stages: rank 0 holds 0 and 2, rank 1 holds 1 and 3 (the last).
    assert run_distributed(_reads_per_model_chunk, world_size=2, pp=2, vpp=2) == [[1, 0],
                                                                                [0, 1]]


def _count_broadcasts():
    from megatron.core import parallel_state
    from tests.collective_counter import count_collectives

    source = parallel_state.get_tensor_model_parallel_rank() == 0
    with count_collectives() as counts:
        batch = get_batch(iter([{"text": TEXT}]) if source else None, 0, False, False, True,
                          MBS, SEQ)
    return dict(counts), _as_lists(batch)


def test_batch_broadcast_once_over_tp_and_not_at_tp1():
    (counts, single), = run_distributed(_count_broadcasts, world_size=1, tp=1)
    assert counts == {}
    for counts, batch in run_distributed(_count_broadcasts, world_size=2, tp=2):
        assert counts == {"broadcast": 1}  # shapes are known: no shape broadcast
        assert batch == single


_HOST_SYNCS = ("item", "tolist", "__bool__", "__int__", "__float__", "__index__", "numpy")


def _host_syncs_per_microbatch():
    from megatron.core import parallel_state
    from megatron.training.gpt_step import loss_func

    source = parallel_state.get_tensor_model_parallel_rank() == 0
    iterator = iter([{"text": TEXT}] * 2) if source else None
    counts = {}
    originals = {name: getattr(torch.Tensor, name) for name in _HOST_SYNCS}

    def counting(name):
        def wrapper(self, *args, **kwargs):
            counts[name] = counts.get(name, 0) + 1
            return originals[name](self, *args, **kwargs)
        return wrapper

    for name in _HOST_SYNCS:
        setattr(torch.Tensor, name, counting(name))
    try:
        for _ in range(2):
            _, labels, loss_mask, _, _ = get_batch(iterator, 0, True, True, True, MBS, SEQ)
            loss_func(loss_mask, labels.float())
    finally:
        for name, fn in originals.items():
            setattr(torch.Tensor, name, fn)
    return counts


def test_per_microbatch_path_reads_nothing_back_to_the_host():
    # On CPU a host read costs nothing, so count the calls that would wait for a GPU
    # (tests/gpu/test_data_path_gpu.py checks the same path under CUDA's sync debug mode).
    assert run_distributed(_host_syncs_per_microbatch, world_size=1, tp=1) == [{}]
    assert run_distributed(_host_syncs_per_microbatch, world_size=2, tp=2) == [{}, {}]


def _bad_batch_shape():
    from megatron.core import parallel_state

    source = parallel_state.get_tensor_model_parallel_rank() == 0
    try:
        get_batch(iter([{"text": TEXT[:, :3]}]) if source else None, 0, False, False, False,
                  MBS, SEQ)
    except (ValueError, RuntimeError) as exc:
        return str(exc)
    return None


def test_batch_of_the_wrong_shape_fails_every_tp_rank():
    source, other = run_distributed(_bad_batch_shape, world_size=2, tp=2, timeout=60)
    assert "'text' has shape (2, 3), expected (2, 5)" in source
    assert "TP source rank 0 could not send its batch" in other
