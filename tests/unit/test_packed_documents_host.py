"""Packed documents' boundaries (cu_seqlens, max_seqlen, seqlens) come from the host batch,
before it goes to the device: forward_step reads nothing back per microbatch for them (the
old path copied the EOD positions to the host: .cpu, nonzero, tolist), and they equal the
device path's, as do the step's outputs."""
import os
import types

import pytest
import torch

from megatron.core import tensor_parallel
from megatron.core.packed_seq_params import (
    document_ids_from_eod,
    packed_seq_params_from_eod,
    packed_seq_params_from_host,
)
from tests.distributed import run_distributed
from tests.sync_counter import SyncCounter
from tests.unit.test_attention_paths import EOD, _model, _packed_tokens

B, S = 2, 40
_DATA_PY = os.path.join(os.path.dirname(tensor_parallel.__file__), "data.py")


def _assert_same(got, want):
    assert got.cu_seqlens.dtype == want.cu_seqlens.dtype == torch.int32
    assert torch.equal(got.cu_seqlens, want.cu_seqlens)
    assert got.max_seqlen == want.max_seqlen and got.seqlens == want.seqlens
    assert torch.equal(got.document_ids, want.document_ids)


@pytest.mark.parametrize("layout", ["several", "eod-first-and-last", "no-eod", "all-eod"])
def test_host_boundaries_equal_the_device_path(layout):
    tokens, _ = _packed_tokens(B, S)
    if layout == "eod-first-and-last":
        tokens[:, 0] = tokens[:, -1] = EOD
    elif layout == "no-eod":
        tokens[tokens == EOD] = 1
    elif layout == "all-eod":
        tokens[:] = EOD
    want = packed_seq_params_from_eod(tokens, EOD)
    ids = document_ids_from_eod(tokens, EOD)
    for host in (tokens.numpy().copy(), tokens.clone()):  # the loader's numpy or tensor
        _assert_same(packed_seq_params_from_host(host, EOD, tokens.device, ids), want)
    if layout == "no-eod":  # one document per sample
        assert want.cu_seqlens.tolist() == [0, S, 2 * S] and want.max_seqlen == S


def _configs(seq_length):
    return types.SimpleNamespace(
        dataset=types.SimpleNamespace(eod_token=EOD, reset_position_ids=True,
                                      reset_attention_mask=True, eod_mask_loss=False,
                                      seq_length=seq_length),
        training=types.SimpleNamespace(micro_batch_size=B))


def _packed_step_reads_and_outputs():
    from megatron.core import parallel_state
    from megatron.training.data.batch import get_ltor_masks_and_position_ids
    from megatron.training.gpt_step import forward_step

    text, _ = _packed_tokens(B, S + 1)
    model = _model("llama")
    source = parallel_state.get_tensor_model_parallel_rank() == 0
    with SyncCounter() as syncs:
        output, _ = forward_step(iter([{"text": text}]) if source else None, model,
                                 _configs(S))
    # The reference: the device path's boundaries (packed_seq_params_from_eod), as before.
    tokens, labels = text[:, :-1].contiguous(), text[:, 1:].contiguous()
    _, _, positions = get_ltor_masks_and_position_ids(tokens, EOD, True, True, False)
    want = model(tokens, position_ids=positions, labels=labels,
                 packed_seq_params=packed_seq_params_from_eod(tokens, EOD))
    return source, _reads(syncs.calls), torch.equal(output, want)


def _reads(calls):
    """The counted calls but the batch's copy to the device: ``.to(device)`` is host to device
    on CUDA, which the counter cannot tell from a read back when the device is the CPU."""
    return [c for c in calls if not (c.startswith("to(cpu)") and
                                     c.split(" at ")[1].startswith(_DATA_PY))]


def test_packed_forward_step_reads_nothing_back_for_the_documents():
    ((_, calls, equal),) = run_distributed(_packed_step_reads_and_outputs, world_size=1, tp=1)
    assert equal
    assert calls == [], calls  # the old path: cpu, nonzero and tolist per microbatch


def test_under_tp_the_source_rank_reads_nothing_and_every_rank_is_equal():
    # A TP rank other than 0 got only the device copy of the batch: it reads the EOD
    # positions back once per microbatch, as every rank did before.
    results = run_distributed(_packed_step_reads_and_outputs, world_size=2, tp=2)
    by_source = {source: (calls, equal) for source, calls, equal in results}
    assert by_source[True][1] and by_source[False][1]
    assert by_source[True][0] == [], by_source[True][0]
    assert by_source[False][0] and all("packed_seq_params.py" in c
                                       for c in by_source[False][0]), by_source[False][0]


def test_token_guard_zeroes_ids_on_the_host_as_on_the_device():
    """With a guard, an id outside the vocabulary becomes 0 on the device; with EOD 0 that id
    ends a document there, and the host path must see the same documents."""
    ((zeroed, cu, want_cu, seqlens, want_seqlens),) = run_distributed(
        _guarded_documents, world_size=1, tp=1)
    assert zeroed == EOD
    assert S + 8 in cu  # the zeroed id at row 1, position 7 ends a document
    assert cu == want_cu and seqlens == want_seqlens


def _guarded_documents():
    from megatron.training.data.batch import get_batch_and_documents
    from megatron.training.guards.token_guard import TokenGuard, set_token_guard

    text, _ = _packed_tokens(B, S + 1)
    text[1, 7] = 1000  # outside the vocabulary of 64
    set_token_guard(TokenGuard(64))
    try:
        (tokens, *_), packed = get_batch_and_documents(iter([{"text": text}]),
                                                       _configs(S).dataset, B)
    finally:
        set_token_guard(None)
    want = packed_seq_params_from_eod(tokens, EOD)
    return (int(tokens[1, 7]), packed.cu_seqlens.tolist(), want.cu_seqlens.tolist(),
            packed.seqlens, want.seqlens)
