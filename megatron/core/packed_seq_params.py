"""Document boundaries of packed sequences (Megatron-core's PackedSeqParams, 'thd' format).

With ``--reset-attention-mask`` each sample packs several documents and a token may attend only
to earlier tokens of its own document. Instead of a [b, 1, s, s] mask (which also pushes SDPA
onto its math kernel), attention gets the cumulative document lengths over the b * s tokens
flattened sample by sample, and attends within each document (see attention.py).
"""
from dataclasses import dataclass
from typing import Optional, Tuple

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
    the end of each sample."""
    b, s = tokens.shape
    # One copy to the host (a sync on CUDA, once per microbatch; the layers then need none).
    ends = (tokens == eod_token).cpu()
    ends[:, -1] = True
    cu = torch.nonzero(ends.reshape(-1)).squeeze(1) + 1
    cu = torch.cat((cu.new_zeros(1), cu))
    seqlens = tuple((cu[1:] - cu[:-1]).tolist())
    return PackedSeqParams(cu.to(device=tokens.device, dtype=torch.int32), max(seqlens),
                           seqlens, document_ids_from_eod(tokens, eod_token))
