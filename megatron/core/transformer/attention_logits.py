"""The largest pre-softmax attention logit per head (QK-clip's S_max, Kimi K2), over exactly the
entries an attention call attends: causal, within the layer's sliding window, within packed
documents, or an explicit mask; under context parallelism this rank's queries against the
keys of the whole sequence (gathered over CP), at their global positions.

``SelfAttention._attention`` records it (every kernel path, multi-latent attention's too,
goes through there) when ``config.qk_clip`` or ``config.log_max_attention_logit`` is set, as a
running max per layer over an iteration's microbatches; ``optimizer/qk_clip.py`` reduces it
and rescales W_q / W_k after the step. The kernels do not return it, so it is recomputed
from Q and K in fp32 under no_grad, a block of query rows at a time against only the keys
that block can reach: about one more Q K^T per layer and microbatch, nothing kept for
backward, and the loss and gradients untouched.
"""
from typing import NamedTuple, Optional

import torch
import torch.distributed as dist

from megatron.core import parallel_state
from megatron.core.transformer.context_parallel import load_balanced_positions, unshard_sequence


class FusedQKVRows(NamedTuple):
    """What QK-clip rescales in SelfAttention: the fused QKV weight's (and bias') rows, laid
    out by query group (this TP rank's groups: its heads' query rows, its key, its value)."""
    weight: torch.nn.Parameter
    bias: Optional[torch.nn.Parameter]
    heads_per_group: int
    head_dim: int


class LatentRows(NamedTuple):
    """What QK-clip rescales in multi-latent attention: the query projection's rows (or its
    up-projection's) and the KV up-projection's, this TP rank's heads."""
    q_weight: torch.nn.Parameter
    kv_up_weight: torch.nn.Parameter
    nope_dim: int
    rope_dim: int
    v_head_dim: int


@torch.no_grad()
def max_attention_logits(query: torch.Tensor, key: torch.Tensor, softmax_scale: float,
                         allowed: Optional[torch.Tensor] = None, causal: bool = True,
                         block: int = 256) -> torch.Tensor:
    """query [b, s_q, heads, d], key [b, s_k, groups, d] (heads a multiple of groups; query
    head h uses key group h // (heads // groups)) -> [heads] fp32 max pre-softmax logit over
    the entries allowed: ``allowed`` [s_q, s_k] or [b, s_q, s_k] bool (True = attended), else
    causal (query i sees keys j <= i + s_k - s_q) or everything. Computed a block of query
    rows at a time (never the whole s_q x s_k per head at once). -inf for a head that attends
    nothing."""
    b, s_q, heads, d = query.shape
    groups = key.size(2)
    per_group = heads // groups
    q = query.float().reshape(b, s_q, groups, per_group, d)
    k = key.float()
    out = torch.full((heads,), float("-inf"), device=query.device)
    s_k = k.size(1)
    cols = torch.arange(s_k, device=query.device)
    for start in range(0, s_q, block):
        stop = min(start + block, s_q)
        # [b, groups, per_group, rows, s_k]
        logits = torch.einsum("bigpd,bjgd->bgpij", q[:, start:stop], k) * softmax_scale
        if allowed is not None:
            mask = allowed[..., start:stop, :]
            mask = mask.unsqueeze(-3).unsqueeze(-3) if mask.dim() == 3 else mask
        elif causal:
            rows = torch.arange(start, stop, device=query.device) + (s_k - s_q)
            mask = cols[None, :] <= rows[:, None]
        else:
            mask = None
        if mask is not None:
            logits = logits.masked_fill(~mask, float("-inf"))
        out = torch.maximum(out, logits.amax(dim=(0, 3, 4)).reshape(heads))
    return out


def _document_ids(packed_seq_params, b: int, s: int, device) -> Optional[torch.Tensor]:
    """[b, s] document number of each position (of the whole sequence under CP), or None."""
    if packed_seq_params is None:
        return None
    if packed_seq_params.document_ids is not None:
        return packed_seq_params.document_ids
    # From the host lengths (no device read): numbered over the flattened b * s tokens, so
    # equal numbers within a sample are one document.
    lengths = torch.tensor(packed_seq_params.seqlens)
    ids = torch.repeat_interleave(torch.arange(len(lengths)), lengths)
    return ids.view(b, s).to(device)


def _gather_keys(key: torch.Tensor, group) -> torch.Tensor:
    """[b, s/CP, groups, d] of this CP rank -> [b, s, groups, d] in global order."""
    shards = [torch.empty_like(key) for _ in range(dist.get_world_size(group))]
    dist.all_gather(shards, key.contiguous(), group=group)
    return unshard_sequence(shards, dim=1)


@torch.no_grad()
def attended_max_logits(query: torch.Tensor, key: torch.Tensor, softmax_scale: float,
                        window: Optional[int] = None, attention_mask=None,
                        packed_seq_params=None, cp_group=None, block: int = 256
                        ) -> torch.Tensor:
    """query [b, s, heads, d], key [b, s, groups, d] as ``SelfAttention._attention`` gets them
    (RoPE and QK norms applied) -> [heads] fp32: the max logit over the entries that call
    attends. The precedence is the attention's: packed documents, then the window, then an
    explicit mask (Megatron's: True = not attended); ``cp_group`` (more than one rank): the
    sequence is CP-sharded in the load-balanced layout (no explicit mask there)."""
    b, s = query.shape[:2]
    cp = 1 if cp_group is None else dist.get_world_size(cp_group)
    if packed_seq_params is None and window is None and attention_mask is not None and cp == 1:
        mask = attention_mask
        if mask.dim() == 4:
            if mask.size(1) != 1:
                raise ValueError("QK-clip records one max per head from a mask shared by the "
                                 "heads ([b, 1, s, s]); got a per-head mask.")
            mask = mask[:, 0]
        return max_attention_logits(query, key, softmax_scale, allowed=~mask, block=block)
    # Query positions (host, ascending: under CP the rank's head chunk, then its tail chunk)
    # and the keys of the whole sequence in global order.
    if cp > 1:
        positions = load_balanced_positions(s * cp, cp, dist.get_rank(cp_group))
        key = _gather_keys(key, cp_group)
    else:
        positions = torch.arange(s)
    documents = _document_ids(packed_seq_params, b, s * cp, query.device)
    out = torch.full((query.size(2),), float("-inf"), device=query.device)
    for start in range(0, s, block):
        rows = positions[start:start + block]
        first, last = int(rows[0]), int(rows[-1])
        # the keys this block can reach: causal, and within the window where there is one
        lo = 0 if window is None else max(0, first - window)
        q_pos = rows.to(query.device)
        k_pos = torch.arange(lo, last + 1, device=query.device)
        diff = q_pos[:, None] - k_pos[None, :]
        allowed = diff >= 0
        if window is not None:
            allowed = allowed & (diff <= window)
        if documents is not None:  # [b, rows, keys]
            allowed = allowed & (documents[:, q_pos, None] == documents[:, None, lo:last + 1])
        out = torch.maximum(out, max_attention_logits(
            query[:, start:start + block], key[:, lo:last + 1], softmax_scale, allowed=allowed,
            block=block))
    return out


def record_max_logits(attention, query, key, attention_mask, packed_seq_params) -> None:
    """Raise ``attention.max_logits`` (a SelfAttention's running max per local head) to this
    call's, from the Q and K its kernels get."""
    config = attention.config
    scale = attention.softmax_scale if attention.softmax_scale is not None else \
        query.size(-1) ** -0.5  # SDPA's default
    cp_group = parallel_state.get_context_parallel_group() \
        if config.context_parallel_size > 1 else None
    new = attended_max_logits(query, key, scale, window=attention.window,
                              attention_mask=attention_mask,
                              packed_seq_params=packed_seq_params, cp_group=cp_group)
    attention.max_logits = new if attention.max_logits is None else \
        torch.maximum(attention.max_logits, new)
