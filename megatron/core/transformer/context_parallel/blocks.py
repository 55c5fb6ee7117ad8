"""One block of context-parallel attention: some local queries against one block of keys,
forward (output and log-sum-exp) and backward (given the GLOBAL output and log-sum-exp), and
the log-sum-exp merge of partial outputs.

A block is causal (its queries and keys hold the same global positions: lower-triangular) or
fully visible (every key precedes every query); packed documents add a same-document mask.
Backward of a block needs only the final output O and log-sum-exp L of its queries:
P = exp(S - L) is the block's share of the global softmax and D = rowsum(dO * O), so the block
grads computed independently sum to the grads of the whole attention (as in flash attention).
"""
import math
from dataclasses import dataclass
from typing import List, Optional, Tuple

import torch
import torch.distributed as dist

from megatron.core.transformer.context_parallel.dropout_hash import attention_dropout_keep

# Where torch's flash kernels apply (shared with attention.py's SDPA kernel choice).
HALF_DTYPES = (torch.float16, torch.bfloat16)
FLASH_MAX_HEAD_DIM = 256
_CPU_FLASH = "_scaled_dot_product_flash_attention_for_cpu"
_CUDA_FLASH = "_scaled_dot_product_flash_attention"
_disabled_kernels = set()  # a kernel whose op raised once is not tried again in this process


@dataclass
class BlockSettings:
    """What every block of one attention call shares."""
    scale: float
    dropout_p: float = 0.0
    dropout_seed: Optional[int] = None
    head_offset: int = 0  # global index of local head 0 (heads are sharded over TP)
    document_ids: Optional[torch.Tensor] = None  # long [b, s_global]
    kernel: str = "reference"


@dataclass
class CPLayout:
    """Where this rank sits in the CP group and which global positions every rank holds."""
    group: Optional[dist.ProcessGroup]
    rank: int
    size: int
    global_ranks: List[int]
    positions: List[torch.Tensor]  # positions[j]: long [s_local], CP rank j's positions

    @property
    def next_peer(self) -> int:
        return self.global_ranks[(self.rank + 1) % self.size]

    @property
    def prev_peer(self) -> int:
        return self.global_ranks[(self.rank - 1) % self.size]


def _has_aten_op(name: str) -> bool:
    return hasattr(torch.ops.aten, name)


def choose_block_kernel(device_type: str, dtype: torch.dtype, head_dim: int, has_mask: bool,
                        dropout: bool) -> str:
    """'cpu_flash', 'cuda_flash' or 'reference' (plain torch ops, our own LSE and dropout).

    torch's flash kernels return the log-sum-exp we merge with, but have no hash dropout;
    the CUDA one also takes no mask (packed documents) and needs fp16/bf16, d <= 256. The CPU
    op takes hq != hkv directly (forward and backward, checked against SDPA with torch 2.13);
    for the CUDA op K/V are expanded per block, after they travelled."""
    if dropout:
        return "reference"
    if device_type == "cpu" and _has_aten_op(_CPU_FLASH) and "cpu_flash" not in _disabled_kernels:
        return "cpu_flash"
    if (device_type == "cuda" and dtype in HALF_DTYPES and head_dim <= FLASH_MAX_HEAD_DIM
            and not has_mask and _has_aten_op(_CUDA_FLASH)
            and "cuda_flash" not in _disabled_kernels):
        return "cuda_flash"
    return "reference"


def visible_mask(st: BlockSettings, q_pos, k_pos, causal: bool) -> Optional[torch.Tensor]:
    """bool [b|1, 1, sq, sk], True where a query may attend to a key; None: all visible."""
    mask = None
    if causal:
        mask = (k_pos[None, :] <= q_pos[:, None])[None, None]
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
    if st.document_ids is None:  # causal blocks hold identical q/k positions: is_causal fits
        out, lse = op(q, k, v, 0.0, causal, scale=st.scale)
        return out.float(), lse.float()
    mask = visible_mask(st, q_pos, k_pos, causal)
    out, lse = op(q, k, v, 0.0, False, attn_mask=_additive_mask(mask, q.dtype), scale=st.scale)
    sees_nothing = ~mask.any(-1)  # the op reports LSE 0 there; merging needs -inf
    lse = lse.float().masked_fill(sees_nothing, -math.inf)
    return out.float().masked_fill(sees_nothing[..., None], 0.0), lse


def _cpu_flash_backward(dout, q, k, v, out, lse, q_pos, k_pos, causal, st: BlockSettings):
    op = getattr(torch.ops.aten, _CPU_FLASH + "_backward")
    if st.document_ids is None:
        return op(dout, q, k, v, out, lse, 0.0, causal, scale=st.scale)
    mask = _additive_mask(visible_mask(st, q_pos, k_pos, causal), q.dtype)
    return op(dout, q, k, v, out, lse, 0.0, False, attn_mask=mask, scale=st.scale)


def _repeat_kv(k, v, groups: int):
    if groups == 1:
        return k, v
    return k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)


def _cuda_flash_forward(q, k, v, q_pos, k_pos, causal, st: BlockSettings):
    k, v = _repeat_kv(k, v, q.shape[1] // k.shape[1])  # per block, transient, after the send
    res = getattr(torch.ops.aten, _CUDA_FLASH)(q, k, v, 0.0, causal, False, scale=st.scale)
    return res[0].float(), res[1].float()


def _cuda_flash_backward(dout, q, k, v, out, lse, q_pos, k_pos, causal, st: BlockSettings):
    hkv, groups = k.shape[1], q.shape[1] // k.shape[1]
    k, v = _repeat_kv(k, v, groups)
    sq, sk = q.shape[2], k.shape[2]
    no_rng = torch.zeros((), dtype=torch.int64, device=q.device)  # no dropout: unused
    op = getattr(torch.ops.aten, _CUDA_FLASH + "_backward")
    dq, dk, dv = op(dout, q, k, v, out, lse, None, None, sq, sk, 0.0, causal, no_rng, no_rng,
                    scale=st.scale)
    if groups > 1:
        b, _, s, d = dk.shape
        dk = dk.view(b, hkv, groups, s, d).sum(2)
        dv = dv.view(b, hkv, groups, s, d).sum(2)
    return dq, dk, dv


_FORWARD = {"cpu_flash": _cpu_flash_forward, "cuda_flash": _cuda_flash_forward,
            "reference": _reference_forward}
_BACKWARD = {"cpu_flash": _cpu_flash_backward, "cuda_flash": _cuda_flash_backward,
             "reference": _reference_backward}


def _run(table, kernel: str, *args):
    """Run ``kernel``. The CUDA flash op's private signature has changed between torch
    versions: if it refuses, disable it for the process and use the reference (same math)."""
    if kernel != "cuda_flash":
        return table[kernel](*args)
    try:
        return table[kernel](*args)
    except (RuntimeError, TypeError, AttributeError, NotImplementedError):
        _disabled_kernels.add(kernel)
        return table["reference"](*args)


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
