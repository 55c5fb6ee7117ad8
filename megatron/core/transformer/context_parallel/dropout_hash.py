"""Attention dropout from a counter-based hash, so the mask is a pure function of
(seed, batch, global head, global query position, global key position).

Context parallelism computes the s x s attention in blocks on different ranks (and in a
different order in backward), and tensor parallelism shards the heads; a mask drawn from a
random stream would depend on that layout. A hash of the global coordinates does not: any
rank can rebuild any block's mask, in forward and again in backward, without storing it.

All arithmetic is in torch int64 with every intermediate kept below 2^62 (32-bit state times a
27-bit constant), so nothing relies on signed overflow.
"""
import torch

_MASK32 = (1 << 32) - 1
_MIX = 0x45D9F3B  # odd multiplier of a well-mixing 32-bit integer hash (multiply-xorshift)


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash of ``x`` (int64 holding values in [0, 2^32))."""
    x = ((x ^ (x >> 16)) * _MIX) & _MASK32
    x = ((x ^ (x >> 16)) * _MIX) & _MASK32
    return x ^ (x >> 16)


def _fold(h: torch.Tensor, counter) -> torch.Tensor:
    """Absorb one coordinate (non-negative, below 2^32) into the hash state."""
    return _mix32(h ^ (torch.as_tensor(counter, dtype=torch.int64, device=h.device) & _MASK32))


def attention_dropout_hash(seed, batch_idx, head_idx, q_pos, k_pos,
                           device=None) -> torch.Tensor:
    """int64 values uniform in [0, 2^32), broadcast over the long index tensors. ``seed``: an
    int in [0, 2^62) or a 0-dim int64 tensor holding one (used where it is, never read: a seed
    drawn on the GPU costs no sync; the same value gives the same bits either way)."""
    if device is None:
        device = next((t.device for t in (seed, batch_idx, head_idx, q_pos, k_pos)
                       if isinstance(t, torch.Tensor)), torch.device("cpu"))
    seed = torch.as_tensor(seed, dtype=torch.int64, device=device)
    folded = (seed ^ (seed >> 32)) & _MASK32
    h = _mix32(folded ^ 0x9E3779B9)
    # Fold the small tensors first so the full [.., sq, sk] tensor is touched last.
    for counter in (batch_idx, head_idx, q_pos, k_pos):
        h = _fold(h, counter)
    return h


def attention_dropout_keep(seed, batch_idx, head_idx, q_pos, k_pos,
                           p: float) -> torch.Tensor:
    """bool mask, True where the attention probability is kept (probability 1 - p).

    ``batch_idx``, ``head_idx`` (global head), ``q_pos`` and ``k_pos`` (global positions) are
    long tensors or ints that broadcast together, e.g. [b,1,1,1], [1,h,1,1], [1,1,sq,1] and
    [1,1,1,sk]. Kept probabilities are scaled by 1 / (1 - p) by the caller, as SDPA does."""
    if not 0.0 <= p < 1.0:
        raise ValueError(f"attention dropout p must be in [0, 1), got {p}")
    threshold = int(round(p * (1 << 32)))
    return attention_dropout_hash(seed, batch_idx, head_idx, q_pos, k_pos) >= threshold
