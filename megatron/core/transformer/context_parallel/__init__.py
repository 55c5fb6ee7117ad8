"""Context parallelism: the sequence is sharded over the CP group, and attention runs over the
whole sequence by passing K/V around a ring (``p2p``) or gathering them (``all_gather``).

Layout (load-balanced, "head-tail"): the sequence is cut into 2*CP equal chunks and CP rank r
holds chunk r followed by chunk 2*CP-1-r, so under causal attention every rank has the same
work. This package's entry point is ``context_parallel_attention`` (here); ring and all-gather
kernels: ring.py, all_gather.py; per-block attention and the log-sum-exp merge: blocks.py;
dropout mask: dropout_hash.py.
"""
import math
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from megatron.core.transformer.context_parallel.all_gather import AllGatherAttention
from megatron.core.transformer.context_parallel.blocks import (
    FLASH_HEAD_DIM_MULTIPLE,
    FLASH_MAX_HEAD_DIM,
    HALF_DTYPES,
    BlockSettings,
    CPLayout,
    choose_block_kernel,
)
from megatron.core.transformer.context_parallel.dropout_hash import attention_dropout_keep
from megatron.core.transformer.context_parallel.ring import RingAttention

__all__ = ["load_balanced_positions", "shard_sequence", "unshard_sequence",
           "context_parallel_attention", "attention_dropout_keep", "COMM_TYPES",
           "reference_kernel_reason"]

COMM_TYPES = ("p2p", "all_gather")
# Above this many tokens per rank the reference block kernel's fp32 scores are refused on CUDA
# (at 8192: 8.6 GB per block for 32 heads of one sample).
MAX_REFERENCE_LOCAL_TOKENS = 4096


def _check_divisible(seq_length: int, cp_size: int) -> None:
    if cp_size < 1:
        raise ValueError(f"context-parallel size must be >= 1, got {cp_size}")
    if seq_length % (2 * cp_size) != 0:
        raise ValueError(
            f"sequence length {seq_length} is not divisible by 2 * context-parallel size "
            f"(2*CP = {2 * cp_size}): context parallelism cuts the sequence into 2*CP equal "
            f"chunks. Fix: choose --seq-length a multiple of {2 * cp_size}, or a smaller "
            f"--context-parallel-size.")


def load_balanced_positions(seq_length: int, cp_size: int, cp_rank: int,
                            device=None) -> torch.Tensor:
    """long [seq_length // cp_size]: the global positions CP rank ``cp_rank`` holds. The
    sequence is cut into 2*cp_size equal chunks; rank r holds chunk r then chunk
    2*cp_size-1-r (head-tail layout, so causal attention work is equal on every rank).
    Raises ValueError if seq_length % (2*cp_size)."""
    _check_divisible(seq_length, cp_size)
    if not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank {cp_rank} is outside [0, {cp_size})")
    chunk = seq_length // (2 * cp_size)
    heads = torch.arange(cp_rank * chunk, (cp_rank + 1) * chunk, device=device)
    tail_start = (2 * cp_size - 1 - cp_rank) * chunk
    tails = torch.arange(tail_start, tail_start + chunk, device=device)
    return torch.cat([heads, tails])


def shard_sequence(tensor: torch.Tensor, dim: int, cp_size: int, cp_rank: int) -> torch.Tensor:
    """This rank's part of ``tensor`` along ``dim`` (a contiguous copy, identity at cp 1)."""
    if cp_size == 1:
        return tensor
    positions = load_balanced_positions(tensor.shape[dim], cp_size, cp_rank, tensor.device)
    return tensor.index_select(dim, positions).contiguous()


def unshard_sequence(shards: Sequence[torch.Tensor], dim: int) -> torch.Tensor:
    """Inverse of shard_sequence: the per-rank shards (in CP rank order) in global order."""
    cp_size = len(shards)
    if cp_size == 1:
        return shards[0]
    halves = [half for shard in shards for half in shard.chunk(2, dim=dim)]
    # halves[2r] is chunk r, halves[2r + 1] is chunk 2*CP-1-r
    by_chunk = [halves[2 * m] if m < cp_size else halves[2 * (2 * cp_size - 1 - m) + 1]
                for m in range(2 * cp_size)]
    return torch.cat(by_chunk, dim=dim)


def _group_layout(group, s_local: int, device) -> CPLayout:
    if group is None or not dist.is_initialized():
        size, rank, ranks = 1, 0, [0]
    else:
        size, rank = dist.get_world_size(group), dist.get_rank(group)
        ranks = dist.get_process_group_ranks(group)
    if size == 1:  # one block, causal: no chunking, so any length works
        return CPLayout(group, 0, 1, ranks, [torch.arange(s_local, device=device)])
    s_global = s_local * size
    _check_divisible(s_global, size)
    positions = [load_balanced_positions(s_global, size, r, device) for r in range(size)]
    return CPLayout(group, rank, size, ranks, positions)


def _check_inputs(query, key, value, comm_type, dropout_p, dropout_seed, document_ids):
    if comm_type not in COMM_TYPES:
        raise ValueError(f"unknown context-parallel comm_type {comm_type!r}; "
                         f"expected one of {COMM_TYPES}")
    if query.dim() != 4 or key.shape != value.shape or key.dim() != 4:
        raise ValueError(f"expected query [b, hq, s, d] and key/value [b, hkv, s, d], got "
                         f"{tuple(query.shape)}, {tuple(key.shape)}, {tuple(value.shape)}")
    b, hq, s, d = query.shape
    if key.shape[0] != b or key.shape[2] != s or key.shape[3] != d:
        raise ValueError(f"key/value {tuple(key.shape)} do not match query {tuple(query.shape)}"
                         f" in batch, sequence or head dim")
    if hq % key.shape[1] != 0:
        raise ValueError(f"query heads {hq} are not a multiple of key/value heads "
                         f"{key.shape[1]} (grouped-query attention needs hq % hkv == 0)")
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"attention dropout must be in [0, 1), got {dropout_p}")
    if dropout_p > 0 and dropout_seed is None:
        raise ValueError("attention dropout under context parallelism needs dropout_seed "
                         "(the same on every CP rank: the mask is a hash of global positions)")
    if document_ids is not None and (document_ids.dim() != 2 or document_ids.shape[0] != b):
        raise ValueError(f"document_ids must be long [b, s_global] with b = {b}, got "
                         f"{tuple(document_ids.shape)}")


def context_parallel_attention(query, key, value, *, group, comm_type: str = "p2p",
                               dropout_p: float = 0.0, dropout_seed: Optional[int] = None,
                               head_offset: int = 0, document_ids=None,
                               softmax_scale: Optional[float] = None,
                               window: Optional[int] = None,
                               sinks: Optional[torch.Tensor] = None,
                               kernel_device_type: Optional[str] = None) -> torch.Tensor:
    """Causal attention of this rank's queries over the whole sequence, which is sharded over
    the CP ``group`` in the load-balanced layout (see load_balanced_positions).

    query [b, hq, s_local, d]; key, value [b, hkv, s_local, d] with hq % hkv == 0 (GQA: only
    the hkv key/value heads travel); returns [b, hq, s_local, d], differentiable in query,
    key and value. ``comm_type``: 'p2p' (ring) or 'all_gather'. ``document_ids``: None, or
    long [b, s_global], each GLOBAL position's document (a query attends only to
    earlier-or-equal positions of its own document); the same full tensor on every CP rank.
    ``dropout_seed`` and ``head_offset`` (global index of local head 0) make the dropout mask
    a pure function of (seed, batch, global head, global query and key position): see
    attention_dropout_keep. ``window`` W: each query sees only the keys at most W positions
    before it (blocks wholly outside are skipped). ``sinks`` [hq] (gpt-oss): one learned
    logit per local head added to every softmax's denominator, differentiable. ``group`` None
    (or one rank) is plain causal attention, in query blocks when masked (never s x s).
    ``kernel_device_type``: whose block kernels to choose from (choose_block_kernel; default
    the query's device; "cuda" on CPU in tests, with a stand-in for the CUDA flash op)."""
    _check_inputs(query, key, value, comm_type, dropout_p, dropout_seed, document_ids)
    layout = _group_layout(group, query.shape[2], query.device)
    if document_ids is not None and document_ids.shape[1] != query.shape[2] * layout.size:
        raise ValueError(f"document_ids covers {document_ids.shape[1]} positions, the "
                         f"sequence has {query.shape[2] * layout.size}")
    if sinks is not None and sinks.shape != (query.shape[1],):
        raise ValueError(f"sinks must be [hq] = [{query.shape[1]}], got {tuple(sinks.shape)}")
    kernel = choose_block_kernel(kernel_device_type or query.device.type, query.dtype,
                                 query.shape[3],
                                 document_ids is not None or window is not None, dropout_p > 0)
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(query.shape[3])
    settings = BlockSettings(scale=scale, dropout_p=dropout_p, dropout_seed=dropout_seed,
                             head_offset=head_offset, document_ids=document_ids, kernel=kernel,
                             window=window)
    # One rank has nothing to pass around; the all-gather plan then is its query blocks.
    ring = comm_type == "p2p" and layout.size > 1
    function = RingAttention if ring else AllGatherAttention
    return function.apply(query, key, value, sinks, layout, settings)


def _reference_causes(config, packed_documents: bool):
    """(cause, fix) pairs: why choose_block_kernel picks the reference kernel on CUDA."""
    d, dtype = config.kv_channels, config.params_dtype
    causes = []
    if config.attention_dropout > 0:
        causes.append((f"attention dropout {config.attention_dropout} (the flash kernels have "
                       f"no position-hash dropout)", "--attention-dropout 0"))
    if packed_documents:
        causes.append(("packed documents (the CUDA flash kernel takes no per-document mask)",
                       "train without --reset-attention-mask"))
    if getattr(config, "window_size", None) is not None:
        causes.append(("a sliding window (the CUDA flash kernel takes no window mask)",
                       "no --window-size"))
    if dtype not in HALF_DTYPES:
        causes.append((f"{str(dtype).replace('torch.', '')} (the CUDA flash kernel needs "
                       f"fp16/bf16)", "--bf16"))
    if d > FLASH_MAX_HEAD_DIM or d % FLASH_HEAD_DIM_MULTIPLE:
        causes.append((f"head dim {d} (the CUDA flash kernel needs a multiple of "
                       f"{FLASH_HEAD_DIM_MULTIPLE}, at most {FLASH_MAX_HEAD_DIM})",
                       f"a head dim (--kv-channels) that is a multiple of "
                       f"{FLASH_HEAD_DIM_MULTIPLE} and at most {FLASH_MAX_HEAD_DIM}"))
    return causes


def reference_kernel_reason(config, device_type: str, seq_length: int,
                            packed_documents: bool) -> Optional[str]:
    """Why training ``config`` (a TransformerConfig) with context parallelism on
    ``device_type`` would run the reference block kernel, whose fp32 scores of one block are
    [heads, s/CP, s/CP] per sample, at more than MAX_REFERENCE_LOCAL_TOKENS tokens per rank;
    or None. Only CUDA is checked (on CPU the reference kernel is the expected path for
    dropout) and only long local sequences (short ones fit)."""
    cp = config.context_parallel_size
    local = seq_length // cp
    if cp == 1 or device_type != "cuda" or local <= MAX_REFERENCE_LOCAL_TOKENS:
        return None
    masked = packed_documents or getattr(config, "window_size", None) is not None
    kernel = choose_block_kernel("cuda", config.params_dtype, config.kv_channels, masked,
                                 config.attention_dropout > 0)
    if kernel != "reference":
        return None
    causes = _reference_causes(config, packed_documents)
    heads = config.num_attention_heads // config.tensor_model_parallel_size
    gigabytes = heads * local * local * 4 / 1e9
    because = "; ".join(cause for cause, _ in causes) or "torch's CUDA flash op is missing"
    fixes = " and ".join(fix for _, fix in causes)
    fixes = f"{fixes} (the CUDA flash kernel then runs); or " if fixes else ""
    return (f"context parallelism would run its fp32 reference attention kernel on CUDA "
            f"({because}): {gigabytes:.1f} GB of scores per block and sample at {local} "
            f"tokens per rank. Fix: {fixes}raise --context-parallel-size so that each rank "
            f"holds at most {MAX_REFERENCE_LOCAL_TOKENS} tokens; or pass "
            f"--allow-math-attention to accept it.")
