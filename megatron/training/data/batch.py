"""From a data-loader batch to model inputs: tokens, labels, masks and position ids."""
from typing import Dict, Iterator, Optional, Tuple

import numpy as np
import torch

from megatron.core import parallel_state, tensor_parallel
from megatron.core.packed_seq_params import (
    PackedSeqParams,
    document_ids_from_eod,
    packed_seq_params_from_eod,
    packed_seq_params_from_host,
)
from megatron.core.transformer.context_parallel import shard_sequence
from megatron.training.guards.token_guard import get_token_guard


def get_ltor_masks_and_position_ids(data: torch.Tensor, eod_token: int,
                                    reset_position_ids: bool, reset_attention_mask: bool,
                                    eod_mask_loss: bool, create_attention_mask: bool = True
                                    ) -> Tuple[Optional[torch.Tensor], torch.Tensor,
                                               torch.Tensor]:
    """Left-to-right masks for ``data`` [b, s] (Megatron semantics).

    Returns ``attention_mask`` bool [b, 1, s, s] with ``reset_attention_mask`` else
    [1, 1, s, s], True where attention is *not* allowed (the future, and with the reset, any
    earlier document), or None without ``create_attention_mask`` (training: attention is
    causal, per document through ``packed_seq_params_from_eod``, never an s x s mask);
    ``loss_mask`` float [b, s], 0 at EOD tokens with ``eod_mask_loss``;
    ``position_ids`` long [b, s], restarting at 0 after every EOD with ``reset_position_ids``.
    An EOD token belongs to the document it ends.
    """
    b, s = data.shape
    dev = data.device
    positions = torch.arange(s, dtype=torch.long, device=dev)
    causal = positions[None, :] > positions[:, None] if create_attention_mask else None
    loss_mask = torch.ones((b, s), dtype=torch.float, device=dev)
    if eod_mask_loss:
        loss_mask[data == eod_token] = 0.0
    if not (reset_position_ids or reset_attention_mask):
        mask = causal.view(1, 1, s, s) if create_attention_mask else None
        return mask, loss_mask, positions.unsqueeze(0).expand(b, s)

    is_eod = (data == eod_token).long()
    # Document number of each position: EODs strictly before it (an EOD ends its document).
    doc = torch.cumsum(is_eod, dim=1) - is_eod
    attention_mask = None
    if create_attention_mask and reset_attention_mask:
        attention_mask = causal[None] | (doc[:, :, None] != doc[:, None, :])
        attention_mask = attention_mask.unsqueeze(1)
    elif create_attention_mask:
        attention_mask = causal.view(1, 1, s, s)
    if reset_position_ids:
        # Position of the first token of each document: one past the previous EOD.
        after_eod = torch.where(is_eod.bool(), positions + 1, torch.zeros_like(positions))
        doc_start = torch.cummax(after_eod, dim=1).values
        doc_start = torch.cat((doc_start.new_zeros(b, 1), doc_start[:, :-1]), dim=1)
        position_ids = positions[None, :] - doc_start
    else:
        position_ids = positions.unsqueeze(0).expand(b, s)
    return attention_mask, loss_mask, position_ids


def stage_needs_data(reset_position_ids: bool = False,
                     reset_attention_mask: bool = False) -> bool:
    """Whether this pipeline stage (the current model chunk under interleaving) reads batches.

    The first stage embeds the tokens, the last computes the loss from labels and loss mask;
    middle stages get their input from the previous stage. With per-document position ids or
    attention masks every stage needs the batch: each layer uses them (RoPE, attention)."""
    return (parallel_state.is_pipeline_first_stage() or parallel_state.is_pipeline_last_stage()
            or reset_position_ids or reset_attention_mask)


def get_batch(data_iterator: Optional[Iterator[Dict[str, torch.Tensor]]], eod_token: int = 0,
              reset_position_ids: bool = False, reset_attention_mask: bool = False,
              eod_mask_loss: bool = False, micro_batch_size: Optional[int] = None,
              seq_length: Optional[int] = None) -> Tuple[Optional[torch.Tensor], ...]:
    """(tokens, labels, loss_mask, attention_mask, position_ids) for this micro batch.

    Megatron's scheme: only stages that need data read it (``stage_needs_data``); a middle
    stage returns all None without touching ``data_iterator``. The first stage gets tokens,
    masks and position ids, the last labels and loss mask too (None where not needed). Only
    tensor-parallel rank 0 reads ``data_iterator`` (others may pass None); its
    ``{'text': [b, s + 1]}`` is broadcast over the TP group (not at TP=1). With
    ``micro_batch_size`` and ``seq_length`` given the shape is known and the whole path runs
    without a host sync. ``tokens`` are text[:, :-1], ``labels`` text[:, 1:]. With a token
    guard set (token_guard.set_token_guard), ids outside the vocabulary are flagged and
    replaced by 0, on device.
    """
    return _get_batch(data_iterator, eod_token, reset_position_ids, reset_attention_mask,
                      eod_mask_loss, micro_batch_size, seq_length)[0]


def _get_batch(data_iterator, eod_token, reset_position_ids, reset_attention_mask,
               eod_mask_loss, micro_batch_size, seq_length):
    """get_batch's tuple and the host text it came from (None where this rank read none)."""
    if not stage_needs_data(reset_position_ids, reset_attention_mask):
        return (None, None, None, None, None), None
    data = None
    if parallel_state.get_tensor_model_parallel_rank() == 0:
        if data_iterator is None:
            raise ValueError("get_batch: tensor-parallel rank 0 needs a data iterator.")
        data = {key: torch.as_tensor(value) for key, value in next(data_iterator).items()}
    shapes = None
    if micro_batch_size is not None and seq_length is not None:
        shapes = {"text": (micro_batch_size, seq_length + 1)}
    text = tensor_parallel.broadcast_data(["text"], data, torch.int64, shapes)["text"]
    guard = get_token_guard()
    if guard is not None:  # ids outside the vocabulary: flagged on device, made harmless
        text = guard.sanitize(text)
    tokens = text[:, :-1].contiguous()
    labels = text[:, 1:].contiguous()
    # No s x s mask: the model is causal, per document with packed_seq_params_from_eod.
    attention_mask, loss_mask, position_ids = get_ltor_masks_and_position_ids(
        tokens, eod_token, reset_position_ids, reset_attention_mask, eod_mask_loss,
        create_attention_mask=False)
    if not parallel_state.is_pipeline_last_stage():
        labels = loss_mask = None
    return (tokens, labels, loss_mask, attention_mask, position_ids), \
        None if data is None else data.get("text")


def documents_of(host_text: Optional[torch.Tensor], tokens: torch.Tensor,
                 eod_token: int) -> PackedSeqParams:
    """The packed documents of ``tokens`` (get_batch's, on the device), from the host batch
    they were copied from when this rank has it (TP rank 0, and every rank at TP=1): no
    device-to-host read per microbatch. Other TP ranks got only the device copy and read its
    EOD positions back (one sync per microbatch)."""
    if host_text is None or host_text.device.type != "cpu":
        return packed_seq_params_from_eod(tokens, eod_token)
    host_tokens = np.asarray(host_text)[:, :-1]
    guard = get_token_guard()
    if guard is not None:  # as sanitize did on the device: an id outside the vocabulary is 0
        host_tokens = np.where((host_tokens < 0) | (host_tokens >= guard.vocab_size), 0,
                               host_tokens)
    return packed_seq_params_from_host(host_tokens, eod_token, tokens.device,
                                       document_ids_from_eod(tokens, eod_token))


def shard_for_context_parallel(*tensors: Optional[torch.Tensor]
                               ) -> Tuple[Optional[torch.Tensor], ...]:
    """This CP rank's part of each [b, s] tensor (None stays None): chunks r and 2CP-1-r of
    the sequence cut into 2 x CP (the load-balanced layout attention expects); unchanged at
    CP 1."""
    cp = parallel_state.get_context_parallel_world_size()
    if cp == 1:
        return tensors
    rank = parallel_state.get_context_parallel_rank()
    return tuple(None if t is None else shard_sequence(t, 1, cp, rank) for t in tensors)


def get_batch_from_config(data_iterator, config, micro_batch_size: Optional[int] = None
                          ) -> Tuple[Optional[torch.Tensor], ...]:
    """get_batch with the EOD/reset/mask options and sequence length of a GPTDatasetConfig;
    with ``micro_batch_size`` the batch shape is known (no host sync)."""
    return get_batch_and_documents(data_iterator, config, micro_batch_size)[0]


def get_batch_and_documents(data_iterator, config, micro_batch_size: Optional[int] = None
                            ) -> Tuple[Tuple[Optional[torch.Tensor], ...],
                                       Optional[PackedSeqParams]]:
    """get_batch_from_config's tuple and, with ``reset_attention_mask``, the boundaries of the
    documents packed in its tokens (``documents_of``; None otherwise or where the stage has
    no tokens), of the whole sequence (before any context-parallel sharding)."""
    batch, host_text = _get_batch(
        data_iterator, config.eod_token, config.reset_position_ids,
        config.reset_attention_mask, config.eod_mask_loss, micro_batch_size,
        config.seq_length if micro_batch_size is not None else None)
    tokens = batch[0]
    documents = documents_of(host_text, tokens, config.eod_token) \
        if config.reset_attention_mask and tokens is not None else None
    return batch, documents
