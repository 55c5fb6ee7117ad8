"""From a data-loader batch to model inputs: tokens, labels, masks and position ids."""
from typing import Dict, Iterator, Optional, Tuple

import torch

from megatron.core import parallel_state, tensor_parallel


def get_ltor_masks_and_position_ids(data: torch.Tensor, eod_token: int,
                                    reset_position_ids: bool, reset_attention_mask: bool,
                                    eod_mask_loss: bool
                                    ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Left-to-right masks for ``data`` [b, s] (Megatron semantics).

    Returns ``attention_mask`` bool [b, 1, s, s] with ``reset_attention_mask`` else
    [1, 1, s, s], True where attention is *not* allowed (the future, and with the reset, any
    earlier document); ``loss_mask`` float [b, s], 0 at EOD tokens with ``eod_mask_loss``;
    ``position_ids`` long [b, s], restarting at 0 after every EOD with ``reset_position_ids``.
    An EOD token belongs to the document it ends.
    """
    b, s = data.shape
    dev = data.device
    positions = torch.arange(s, dtype=torch.long, device=dev)
    causal = positions[None, :] > positions[:, None]  # [q, k]: key after query
    loss_mask = torch.ones((b, s), dtype=torch.float, device=dev)
    if eod_mask_loss:
        loss_mask[data == eod_token] = 0.0
    if not (reset_position_ids or reset_attention_mask):
        return causal.view(1, 1, s, s), loss_mask, positions.unsqueeze(0).expand(b, s)

    is_eod = (data == eod_token).long()
    # Document number of each position: EODs strictly before it (an EOD ends its document).
    doc = torch.cumsum(is_eod, dim=1) - is_eod
    if reset_attention_mask:
        attention_mask = causal[None] | (doc[:, :, None] != doc[:, None, :])
        attention_mask = attention_mask.unsqueeze(1)
    else:
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


def get_batch(data_iterator: Optional[Iterator[Dict[str, torch.Tensor]]], eod_token: int = 0,
              reset_position_ids: bool = False, reset_attention_mask: bool = False,
              eod_mask_loss: bool = False) -> Tuple[torch.Tensor, ...]:
    """(tokens, labels, loss_mask, attention_mask, position_ids) for this micro batch.

    Only tensor-parallel rank 0 reads ``data_iterator`` (others may pass None); its
    ``{'text': [b, s + 1]}`` is broadcast over the TP group, so every TP rank gets the same
    batch. ``tokens`` are text[:, :-1], ``labels`` text[:, 1:].
    """
    data = None
    if parallel_state.get_tensor_model_parallel_rank() == 0:
        if data_iterator is None:
            raise ValueError("get_batch: tensor-parallel rank 0 needs a data iterator.")
        data = next(data_iterator)
        data = {"text": torch.as_tensor(data["text"])}
    text = tensor_parallel.broadcast_data(["text"], data, torch.int64)["text"]
    tokens = text[:, :-1].contiguous()
    labels = text[:, 1:].contiguous()
    attention_mask, loss_mask, position_ids = get_ltor_masks_and_position_ids(
        tokens, eod_token, reset_position_ids, reset_attention_mask, eod_mask_loss)
    return tokens, labels, loss_mask, attention_mask, position_ids


def get_batch_from_config(data_iterator, config) -> Tuple[torch.Tensor, ...]:
    """get_batch with the EOD/reset/mask options of a GPTDatasetConfig."""
    return get_batch(data_iterator, config.eod_token, config.reset_position_ids,
                     config.reset_attention_mask, config.eod_mask_loss)
