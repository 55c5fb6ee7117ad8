"""One block of context-parallel attention: some local queries against one block of keys,
forward (output and log-sum-exp) and backward (given the GLOBAL output and log-sum-exp), and
the log-sum-exp merge of partial outputs.

A block is causal (its queries and keys hold the same global positions: lower-triangular) or
fully visible (every key precedes every query); packed documents add a same-document mask and
a sliding window a distance mask (a query sees keys at most ``window`` positions before it).
Backward of a block needs only the final output O and log-sum-exp L of its queries:
P = exp(S - L) is the block's share of the global softmax and D = rowsum(dO * O), so the block
grads computed independently sum to the grads of the whole attention (as in flash attention).
"""
import math
from dataclasses import dataclass
from typing import List, Optional, Tuple, Union

import torch
import torch.distributed as dist

from megatron.core.transformer.context_parallel.dropout_hash import attention_dropout_keep

# Where torch's flash kernels apply (shared with attention.py's SDPA kernel choice).
HALF_DTYPES = (torch.float16, torch.bfloat16)
FLASH_MAX_HEAD_DIM = 256
FLASH_HEAD_DIM_MULTIPLE = 8  # the CUDA flash op does not pad (SDPA pads before calling it)
_CPU_FLASH = "_scaled_dot_product_flash_attention_for_cpu"
_CUDA_FLASH = "_scaled_dot_product_flash_attention"
# The private CUDA op's arguments as we call them (torch 2.11-2.13); checked against the
# registered schema once, so a changed signature picks the reference kernel up front instead
# of failing (or being caught) at the first call.
_CUDA_FLASH_ARGS = ("query", "key", "value", "dropout_p", "is_causal", "return_debug_mask",
                    "scale")
_CUDA_FLASH_BACKWARD_ARGS = ("grad_out", "query", "key", "value", "out", "logsumexp",
                             "cum_seq_q", "cum_seq_k", "max_q", "max_k", "dropout_p",
                             "is_causal", "philox_seed", "philox_offset", "scale")


@dataclass
class BlockSettings:
    """What every block of one attention call shares."""
    scale: float
    dropout_p: float = 0.0
    dropout_seed: Union[int, torch.Tensor, None] = None  # a tensor stays on its device
    head_offset: int = 0  # global index of local head 0 (heads are sharded over TP)
    document_ids: Optional[torch.Tensor] = None  # long [b, s_global]
    kernel: str = "reference"
    window: Optional[int] = None  # sliding window W: keys i - W .. i (None: all earlier)

    @property
    def masked(self) -> bool:
        """Whether blocks need an explicit mask (the kernels' is_causal cannot express it)."""
        return self.document_ids is not None or self.window is not None

    def block_is_empty(self, q_first: int, k_last: int) -> bool:
        """Whether a block whose earliest query is at ``q_first`` and latest key at ``k_last``
        (global positions) lies wholly outside the window: nothing to compute."""
        return self.window is not None and q_first - k_last > self.window


@dataclass
class CPLayout:
    """Where this rank sits in the CP group and which global positions every rank holds."""
    group: Optional[dist.ProcessGroup]
    rank: int
    size: int
    global_ranks: List[int]
    positions: List[torch.Tensor]  # positions[j]: long [s_local], CP rank j's positions

    def position(self, rank: int, index: int, s_local: int) -> int:
        """Global position of row ``index`` of CP rank ``rank`` (host arithmetic, no sync).
        Increasing in ``index``: a rank's head chunk precedes its tail chunk."""
        if self.size == 1:
            return index
        chunk = s_local // 2
        if index < chunk:
            return rank * chunk + index
        return (2 * self.size - 1 - rank) * chunk + index - chunk

    @property
    def next_peer(self) -> int:
        return self.global_ranks[(self.rank + 1) % self.size]

    @property
    def prev_peer(self) -> int:
        return self.global_ranks[(self.rank - 1) % self.size]


def _has_aten_op(name: str) -> bool:
    return hasattr(torch.ops.aten, name)


def _op_arguments(name: str) -> Tuple[str, ...]:
    return tuple(arg.name for arg in getattr(torch.ops.aten, name).default._schema.arguments)


def _cuda_flash_op_matches() -> bool:
    """Whether this torch registers the CUDA flash op with the arguments we pass."""
    if not (_has_aten_op(_CUDA_FLASH) and _has_aten_op(_CUDA_FLASH + "_backward")):
        return False
    return (_op_arguments(_CUDA_FLASH) == _CUDA_FLASH_ARGS
            and _op_arguments(_CUDA_FLASH + "_backward") == _CUDA_FLASH_BACKWARD_ARGS)


_CUDA_FLASH_AVAILABLE = _cuda_flash_op_matches()


def cuda_flash_fits(dtype: torch.dtype, head_dim: int, has_mask: bool) -> bool:
    """The CUDA flash op's own checks (flash_api.cpp mha_fwd): fp16/bf16, head dim a multiple
    of 8 and at most 256, no mask; grouped-query K/V (hq % hkv == 0) are taken as they are."""
    return (_CUDA_FLASH_AVAILABLE and dtype in HALF_DTYPES and head_dim <= FLASH_MAX_HEAD_DIM
            and head_dim % FLASH_HEAD_DIM_MULTIPLE == 0 and not has_mask)


def choose_block_kernel(device_type: str, dtype: torch.dtype, head_dim: int, has_mask: bool,
                        dropout: bool) -> str:
    """'cpu_flash', 'cuda_flash' or 'reference' (plain torch ops, our own LSE and dropout),
    decided once per attention call from what the kernels accept; the chosen kernel's errors
    (out of memory included) propagate, nothing falls back at run time.

    torch's flash kernels return the log-sum-exp we merge with, but have no hash dropout;
    the CUDA one also takes no mask (packed documents) and needs fp16/bf16 and a head dim that
    is a multiple of 8, at most 256 (cuda_flash_fits). Both ops take hq != hkv directly
    (GQA: K/V are never expanded to the query heads; the CPU op checked against SDPA with
    torch 2.13, the CUDA op is what SDPA's enable_gqa=True calls)."""
    if dropout:
        return "reference"
    if device_type == "cpu" and _has_aten_op(_CPU_FLASH):
        return "cpu_flash"
    if device_type == "cuda" and cuda_flash_fits(dtype, head_dim, has_mask):
        return "cuda_flash"
    return "reference"


def visible_mask(st: BlockSettings, q_pos, k_pos, causal: bool) -> Optional[torch.Tensor]:
    """bool [b|1, 1, sq, sk], True where a query may attend to a key; None: all visible."""
    mask = None
    if causal:
        mask = (k_pos[None, :] <= q_pos[:, None])[None, None]
    if st.window is not None:
        near = (q_pos[:, None] - k_pos[None, :] <= st.window)[None, None]
        mask = near if mask is None else mask & near
    if st.document_ids is not None:
        docs = st.document_ids
        same_doc = (docs[:, q_pos][:, :, None] == docs[:, k_pos][:, None, :])[:, None]
        mask = same_doc if mask is None else mask & same_doc
    return mask


def _grouped(x: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """[b, hq, s, n] -> [b, hkv, g * s, n]: query head h uses key/value head h // g."""
    b, hq, s, n = x.shape
    return x.reshape(b, kv_heads, (hq // kv_heads) * s, n)


def _scores(q, k, st: BlockSettings, q_pos, k_pos, causal: bool) -> torch.Tensor:
    """Masked fp32 scores [b, hq, sq, sk] (transient: one block, never s_global x s_global)."""
    b, hq, sq, _ = q.shape
    scores = _grouped(q.float(), k.shape[1]) @ k.float().transpose(-1, -2)
    scores = scores.reshape(b, hq, sq, k.shape[2]) * st.scale
    mask = visible_mask(st, q_pos, k_pos, causal)
    return scores if mask is None else scores.masked_fill(~mask, -math.inf)


def _dropout_scale(st: BlockSettings, shape, q_pos, k_pos, device) -> torch.Tensor:
    """keep / (1 - p) for this block, fp32 [b, hq, sq, sk]."""
    b, hq = shape[0], shape[1]
    heads = torch.arange(hq, device=device) + st.head_offset
    keep = attention_dropout_keep(
        st.dropout_seed, torch.arange(b, device=device)[:, None, None, None],
        heads[None, :, None, None], q_pos[None, None, :, None], k_pos[None, None, None, :],
        st.dropout_p)
    return keep.float() / (1.0 - st.dropout_p)


def _finite(lse: torch.Tensor) -> torch.Tensor:
    """LSE with -inf (a row that sees no key in this block) replaced by 0, to subtract safely."""
    return torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)


def _reference_forward(q, k, v, q_pos, k_pos, causal, st: BlockSettings):
    scores = _scores(q, k, st, q_pos, k_pos, causal)
    lse = scores.logsumexp(-1)
    probs = torch.exp(scores - _finite(lse)[..., None])
    if st.dropout_p > 0:
        probs = probs * _dropout_scale(st, probs.shape, q_pos, k_pos, q.device)
    b, hq, sq, _ = q.shape
    out = (_grouped(probs, k.shape[1]) @ v.float()).reshape(b, hq, sq, -1)
    return out, lse


def _reference_backward(dout, q, k, v, out, lse, q_pos, k_pos, causal, st: BlockSettings):
    hkv = k.shape[1]
    probs = torch.exp(_scores(q, k, st, q_pos, k_pos, causal) - lse.float()[..., None])
    dout = dout.float()
    dprobs = (_grouped(dout, hkv) @ v.float().transpose(-1, -2)).reshape(probs.shape)
    weights = probs
    if st.dropout_p > 0:
        drop = _dropout_scale(st, probs.shape, q_pos, k_pos, q.device)
        weights, dprobs = probs * drop, dprobs * drop
    dv = _grouped(weights, hkv).transpose(-1, -2) @ _grouped(dout, hkv)
    row_dot = (dout * out.float()).sum(-1, keepdim=True)  # D = rowsum(dO * O), global O
    dscores = _grouped(probs * (dprobs - row_dot), hkv) * st.scale
    dq = (dscores @ k.float()).reshape(q.shape)
    dk = dscores.transpose(-1, -2) @ _grouped(q.float(), hkv)
    return dq, dk, dv


def _additive_mask(mask: torch.Tensor, dtype) -> torch.Tensor:
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, -math.inf)


def _cpu_flash_forward(q, k, v, q_pos, k_pos, causal, st: BlockSettings):
    op = getattr(torch.ops.aten, _CPU_FLASH)
    if not st.masked:  # causal blocks hold identical q/k positions: is_causal fits
        out, lse = op(q, k, v, 0.0, causal, scale=st.scale)
        return out.float(), lse.float()
    mask = visible_mask(st, q_pos, k_pos, causal)
    out, lse = op(q, k, v, 0.0, False, attn_mask=_additive_mask(mask, q.dtype), scale=st.scale)
    sees_nothing = ~mask.any(-1)  # the op reports LSE 0 there; merging needs -inf
    lse = lse.float().masked_fill(sees_nothing, -math.inf)
    return out.float().masked_fill(sees_nothing[..., None], 0.0), lse


def _cpu_flash_backward(dout, q, k, v, out, lse, q_pos, k_pos, causal, st: BlockSettings):
    op = getattr(torch.ops.aten, _CPU_FLASH + "_backward")
    if not st.masked:
        return op(dout, q, k, v, out, lse, 0.0, causal, scale=st.scale)
    mask = _additive_mask(visible_mask(st, q_pos, k_pos, causal), q.dtype)
    return op(dout, q, k, v, out, lse, 0.0, False, attn_mask=mask, scale=st.scale)


def _cuda_flash_ops():
    """(forward, backward) of torch's private CUDA flash op (a function so tests can stand in
    for it on CPU)."""
    aten = torch.ops.aten
    return getattr(aten, _CUDA_FLASH), getattr(aten, _CUDA_FLASH + "_backward")


def _cuda_flash_forward(q, k, v, q_pos, k_pos, causal, st: BlockSettings):
    forward, _ = _cuda_flash_ops()
    res = forward(q, k, v, 0.0, causal, False, scale=st.scale)  # hkv heads as they came
    return res[0].float(), res[1].float()


def _cuda_flash_backward(dout, q, k, v, out, lse, q_pos, k_pos, causal, st: BlockSettings):
    _, backward = _cuda_flash_ops()
    sq, sk = q.shape[2], k.shape[2]
    no_rng = torch.zeros((), dtype=torch.int64, device=q.device)  # no dropout: unused
    # Under GQA the op sums dK/dV over each group's query heads itself: [b, hkv, sk, d].
    return backward(dout, q, k, v, out, lse, None, None, sq, sk, 0.0, causal, no_rng, no_rng,
                    scale=st.scale)


_FORWARD = {"cpu_flash": _cpu_flash_forward, "cuda_flash": _cuda_flash_forward,
            "reference": _reference_forward}
_BACKWARD = {"cpu_flash": _cpu_flash_backward, "cuda_flash": _cuda_flash_backward,
             "reference": _reference_backward}


def _run(table, kernel: str, *args):
    """Run the kernel choose_block_kernel picked; its errors are the caller's."""
    return table[kernel](*args)


def block_forward(q, k, v, q_pos, k_pos, causal: bool,
                  st: BlockSettings) -> Tuple[torch.Tensor, torch.Tensor]:
    """q [b, hq, sq, d], k/v [b, hkv, sk, d] -> (out fp32 [b, hq, sq, d], lse fp32 [b, hq, sq]);
    a row that sees no key here has lse -inf and out 0."""
    return _run(_FORWARD, st.kernel, q.contiguous(), k.contiguous(), v.contiguous(),
                q_pos, k_pos, causal, st)


def block_backward(dout, q, k, v, out, lse, q_pos, k_pos, causal: bool, st: BlockSettings):
    """This block's share of (dq, dk, dv), given the global ``out`` and ``lse`` of its queries."""
    args = (dout.contiguous(), q.contiguous(), k.contiguous(), v.contiguous(),
            out.contiguous(), lse.contiguous(), q_pos, k_pos, causal, st)
    return _run(_BACKWARD, st.kernel, *args)


def merge_partial_(out, lse, block_out, block_lse) -> None:
    """Fold a block's softmax-normalised partial result into (``out``, ``lse``) in place, by
    their log-sum-exps (stable: weights are exp(lse_i - lse_new) <= 1); ``block_out`` is
    consumed. In place because the accumulator is as big as the queries: an out-of-place merge
    held three more such tensors at every step. Rows where both are -inf stay (0, -inf)."""
    new_lse = torch.logaddexp(lse, block_lse)
    ref = _finite(new_lse)
    out.mul_(torch.exp(lse - ref)[..., None])
    out.add_(block_out.mul_(torch.exp(block_lse - ref)[..., None]))
    lse.copy_(new_lse)


def add_sinks_(out, lse, sinks) -> None:
    """Attention sinks (gpt-oss): one more logit per head, ``sinks`` [hq], in each softmax's
    denominator with no value behind it; in place on the merged fp32 ``out`` [b, hq, s, d] and
    ``lse`` [b, hq, s]. The backward of the blocks then needs nothing else: it takes this
    final output and log-sum-exp, as it takes the merged ones."""
    sink = sinks.float()[None, :, None].expand_as(lse)
    new_lse = torch.logaddexp(lse, sink)
    out.mul_(torch.exp(lse - new_lse)[..., None])
    lse.copy_(new_lse)


def sinks_grad(dout, out, lse, sinks) -> torch.Tensor:
    """d loss / d sinks [hq]: a sink's probability p = exp(sink - L) scales every output down,
    so d out / d sink = -p out and the gradient is -sum over batch and queries of
    p * rowsum(dout * out)."""
    prob = torch.exp(sinks.float()[None, :, None] - lse)
    row_dot = (dout.float() * out.float()).sum(-1)
    return -(prob * row_dot).sum(dim=(0, 2)).to(sinks.dtype)
