"""Document boundaries of packed sequences (Megatron-core's PackedSeqParams, 'thd' format).

With ``--reset-attention-mask`` each sample packs several documents and a token may attend only
to earlier tokens of its own document. Instead of a [b, 1, s, s] mask (which also pushes SDPA
onto its math kernel), attention gets the cumulative document lengths over the b * s tokens
flattened sample by sample, and attends within each document (see attention.py).
"""
from dataclasses import dataclass
from typing import Optional, Tuple

import numpy as np
import torch


@dataclass(frozen=True)
class PackedSeqParams:
    cu_seqlens: torch.Tensor  # int32 [documents + 1], on the model's device: 0, ends..., b * s
    max_seqlen: int  # longest document
    seqlens: Tuple[int, ...]  # document lengths (host copy, for the per-document path)
    # Document number of every position [b, s] (of the whole sequence, also when context
    # parallelism shards it: the ring masks blocks by it).
    document_ids: Optional[torch.Tensor] = None


def document_ids_from_eod(tokens: torch.Tensor, eod_token: int) -> torch.Tensor:
    """[b, s] document number of each position: EODs strictly before it (an EOD ends its
    document), on the tokens' device without a host sync."""
    is_eod = (tokens == eod_token).long()
    return torch.cumsum(is_eod, dim=1) - is_eod


def packed_seq_params_from_eod(tokens: torch.Tensor, eod_token: int) -> PackedSeqParams:
    """Boundaries of ``tokens`` [b, s]: a document ends at each EOD (which it includes) and at
    the end of each sample. On a device this reads the EOD positions back (a sync);
    ``packed_seq_params_from_host`` needs none when the host batch is at hand."""
    ends = np.asarray((tokens == eod_token).cpu())  # one copy to the host (a sync on CUDA)
    return _from_document_ends(ends, tokens.device, document_ids_from_eod(tokens, eod_token))


def packed_seq_params_from_host(host_tokens, eod_token: int, device: torch.device,
                                document_ids: Optional[torch.Tensor] = None) -> PackedSeqParams:
    """``packed_seq_params_from_eod`` from the host copy of the tokens ([b, s], a numpy array or
    a CPU tensor, as the data loader gave them) before they go to the device: nothing is read
    back from the device, and ``cu_seqlens`` is copied to ``device``. ``document_ids``: the
    device tokens' ``document_ids_from_eod`` (computed there, without a sync)."""
    return _from_document_ends(np.asarray(host_tokens) == eod_token, device, document_ids)


def _from_document_ends(ends: np.ndarray, device, document_ids) -> PackedSeqParams:
    """From a fresh host [b, s] bool array (changed here), True at EODs. numpy, not torch:
    host arithmetic that never waits on a device (which the tests' sync counter, counting
    torch's reads of any tensor, would count)."""
    ends[:, -1] = True  # a sample's end ends its last document
    cu = np.concatenate(([0], np.flatnonzero(ends) + 1)).astype(np.int32)
    seqlens = tuple(np.diff(cu).tolist())
    cu_seqlens = torch.from_numpy(cu)
    if torch.device(device).type != "cpu":  # host to device: the host does not wait
        cu_seqlens = cu_seqlens.to(device, non_blocking=True)
    return PackedSeqParams(cu_seqlens, max(seqlens), seqlens, document_ids)
