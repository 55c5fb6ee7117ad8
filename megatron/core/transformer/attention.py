"""Self-attention: fused QKV (column-parallel), rotary embedding, causal SDPA, output projection
(row-parallel).

The fused QKV weight is laid out by query group: for each group g, the rows of its
``heads / groups`` query heads, then its key head, then its value head. Splitting the rows
evenly over TP ranks then hands every rank whole groups, so attention needs no communication.

Packed documents (``PackedSeqParams``) attend within each document: on CUDA through torch's
variable-length flash attention, elsewhere one causal SDPA per document; never an s x s mask.
Which SDPA kernel runs is decided here (``sdpa_kernel_for``), so config validation can refuse a
configuration that would silently land on the math kernel on CUDA.
"""
import contextlib
import inspect
from typing import Optional, Tuple

import torch
import torch.nn.functional as F

from megatron.core import device, parallel_state
from megatron.core.compiled import compiled
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    checkpoint,
    get_rng_tracker,
)
from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes
from megatron.core.transformer.attention_logits import FusedQKVRows, record_max_logits
from megatron.core.transformer.context_parallel import context_parallel_attention
from megatron.core.transformer.context_parallel.blocks import FLASH_MAX_HEAD_DIM, HALF_DTYPES
from megatron.core.transformer.norms import build_norm
from megatron.core.transformer.rope import apply_rotary, rotary_function
from megatron.core.transformer.sliding_window import blocked_window_attention, layer_window
from megatron.core.utils import divide, init_method_normal, scaled_init_method_normal

# torch's variable-length flash attention (CUDA only), imported on first CUDA use: importing
# it imports torch._dynamo, about 2 s of every process start (CPU runs never need it).
_NOT_LOADED = object()
_varlen_attn, _VARLEN_PARAMS = _NOT_LOADED, {}


def varlen_kernel():
    """torch's varlen_attn, or None where this torch lacks it."""
    global _varlen_attn, _VARLEN_PARAMS
    if _varlen_attn is _NOT_LOADED:
        try:
            from torch.nn.attention.varlen import varlen_attn
        except ImportError:
            _varlen_attn = None
        else:
            _varlen_attn, _VARLEN_PARAMS = varlen_attn, inspect.signature(varlen_attn).parameters
    return _varlen_attn



def _heads_for_sdpa(qkv, cos, sin, heads_per_group: int):
    """QKV [s, b, groups, heads_per_group + 2, d] -> Q [b, s, heads, d] and K, V [b, s, groups,
    d], RoPE applied to Q and K (``cos``/``sin`` [b|1, s, 1, rot], or None), each a transposed
    view of a contiguous [s, b, ..., d] tensor. Compiled (the compiled path), this is one pass
    that reads the QKV buffer once and writes the three, and its backward one pass that writes
    the QKV gradient: in place of the eager path's Q reshape copy, two RoPE passes, the split's
    concatenation and the copy of the transposed gradient before the QKV GEMM.

    Why [s, b] memory: the fused SDPA kernels (flash, cuDNN, memory-efficient) take any strides
    with a contiguous last dim and write their output, and in backward the Q/K/V gradients, in
    Q's layout. The output is then [s, b, heads, d] in memory, so the output projection's
    [s, b, heads * d] input is a contiguous view (no copy before its GEMM nor before its weight
    gradient), and the output gradient arriving from that projection already has the output's
    layout (no copy in SDPA's backward)."""
    s, b, groups, _, d = qkv.shape
    query, key, value = torch.split(qkv, [heads_per_group, 1, 1], dim=3)
    query = query.reshape(s, b, groups * heads_per_group, d)
    key, value = key.squeeze(3), value.squeeze(3)
    if cos is not None:  # [b|1, s, 1, rot] -> [s, b|1, 1, rot]
        cos, sin = cos.transpose(0, 1), sin.transpose(0, 1)
        query, key = apply_rotary(query, cos, sin), apply_rotary(key, cos, sin)
    return tuple(t.contiguous().transpose(0, 1) for t in (query, key, value))


def compiled_head_layout(config) -> bool:
    """Whether attention lays out Q, K, V with ``_heads_for_sdpa`` compiled: the compiled path,
    without QK norms between the split and RoPE, outside context parallelism (and, per call,
    without packed documents)."""
    return config.torch_compile and not config.qk_layernorm and \
        config.context_parallel_size == 1


def sdpa_kernel_for(device_type: str, dtype: torch.dtype, head_dim: int, gqa: bool,
                    has_mask: bool, dropout: bool) -> Tuple[str, bool]:
    """(kernel, repeat_kv): the fused SDPA kernel our call can run, following torch's
    selection rules (aten/src/ATen/native/transformers/{cuda/sdp_utils.cpp,sdp_utils_cpp.cpp},
    torch 2.5-2.13), and whether we expand K/V to all heads first to get it. On Hopper torch
    2.11 tries cuDNN's attention before these (the first GPU run saw it take our causal GQA
    bf16 call, BENCHMARKS.md): also fused, no s x s; the kernel named here is the one that
    takes the call where cuDNN does not (tests/gpu/test_attention_gpu.py runs each).

    CPU: the flash kernel unless attention dropout is on (it has none), then math.
    CUDA (sm80+): flash needs fp16/bf16, head dim <= 256 and no explicit mask; the
    memory-efficient kernel takes fp32 too and masks, needs the head dim to be a multiple of
    8 (fp16/bf16) or 4 (fp32), and in these torch versions equal query and key/value head
    counts, so under grouped-query attention we expand K/V (b*heads*s*d, not s x s); otherwise
    math, which keeps [b, heads, s, s] per layer."""
    if device_type != "cuda":
        return ("math" if dropout else "flash"), False
    half = dtype in HALF_DTYPES
    if half and head_dim <= FLASH_MAX_HEAD_DIM and not has_mask:
        return "flash", False
    if (half or dtype == torch.float32) and head_dim % (8 if half else 4) == 0:
        return "efficient", gqa
    return "math", False


def math_attention_reason(config, device_type: str) -> Optional[str]:
    """Why training ``config`` on ``device_type`` would run SDPA's math kernel (s x s scores
    per head and layer: slow, and out of memory at long sequences), or None. Only CUDA is
    checked: on CPU the unfused path is the expected one."""
    if device_type != "cuda":
        return None
    d, dtype = config.kv_channels, config.params_dtype
    kernel, _ = sdpa_kernel_for(device_type, dtype, d, False, False,
                                config.attention_dropout > 0)
    if kernel != "math":
        return None
    if dtype in HALF_DTYPES:
        cause = (f"head dim {d} is above flash attention's {FLASH_MAX_HEAD_DIM} and not a "
                 f"multiple of 8 (memory-efficient attention's alignment)")
    else:
        cause = (f"{str(dtype).replace('torch.', '')} rules out flash attention (fp16/bf16 "
                 f"only) and head dim {d} is not a multiple of 4 (memory-efficient "
                 f"attention's alignment)")
    return (f"attention would fall back to SDPA's math kernel on CUDA: {cause}. Fix: make the "
            f"head dim (--kv-channels, or --hidden-size / --num-attention-heads) a multiple of "
            f"8 and at most {FLASH_MAX_HEAD_DIM} and train with --bf16, or pass "
            f"--allow-math-attention to accept the math kernel.")


def context_parallel_dropout_seed(device) -> torch.Tensor:
    """The seed of one call's attention-dropout mask under CP: a 0-dim int64 tensor on
    ``device``, drawn from the per-TP-rank stream (heads are sharded over TP; CP ranks share
    the stream) and never read on the host, so no per-layer sync. Recomputation replays the
    stream; the mask is a hash of (seed, global head and positions), the same on every rank
    that computes a block."""
    with get_rng_tracker().fork():
        return torch.randint(0, 2 ** 62, (1,), device=device)[0]


def check_attention_partition(config, tp_size: int) -> None:
    """Clear errors for head counts that TP cannot split into whole heads and groups."""
    if config.num_attention_heads % tp_size != 0:
        raise ValueError(f"num_attention_heads {config.num_attention_heads} is not divisible by "
                         f"tensor-model-parallel size {tp_size}; choose a TP size that divides it.")
    if config.num_query_groups % tp_size != 0:
        raise ValueError(f"num_query_groups {config.num_query_groups} is not divisible by "
                         f"tensor-model-parallel size {tp_size}; each TP rank must hold whole "
                         f"key/value groups.")


def _build_head_norm(config):
    """A norm over one head's dim, shared by all heads. TP splits the heads, so each rank's
    weight gradient covers only its heads: marked (sequence_parallel) for finalize_model_grads'
    sum over TP, with or without sequence parallelism."""
    norm = build_norm(config, config.kv_channels)
    for p in norm.parameters():
        p.sequence_parallel = True
    return norm


def _learned_sinks(config, local_heads: int) -> torch.nn.Parameter:
    """gpt-oss's per-head sink logits of this rank's heads: drawn for all heads, then this
    rank's slice (the same model at any TP), split over TP with the heads."""
    full = torch.empty(config.num_attention_heads, dtype=torch.float32)
    torch.nn.init.normal_(full, std=config.init_method_std)
    first = parallel_state.get_tensor_model_parallel_rank() * local_heads
    sinks = torch.nn.Parameter(full[first:first + local_heads].to(
        device=device.current_device(), dtype=config.params_dtype))
    set_tensor_model_parallel_attributes(sinks, True, 0)
    return sinks


class SelfAttention(torch.nn.Module):
    def __init__(self, config, layer_number: int, kernel_device_type: Optional[str] = None):
        """``kernel_device_type``: whose kernel rules pick the attention path, fixed here
        (``kernel_device``): None, the device each call's tensors are on; "cuda" on CPU runs
        the branches CUDA takes (the memory-efficient kernel's K/V expansion, the math kernel
        where CUDA falls back to it, the variable-length kernel, the CUDA flash block kernel)
        with CPU kernels or stand-ins (tests/unit/test_attention_kernel_branches.py)."""
        super().__init__()
        tp_size = parallel_state.get_tensor_model_parallel_world_size()
        check_attention_partition(config, tp_size)
        self.config = config
        self.layer_number = layer_number
        self.kernel_device_type = kernel_device_type
        self.apply_rotary = rotary_function(config)  # compiled under --torch-compile
        self.window = layer_window(config, layer_number)  # None: full causal attention
        self.softmax_scale = None  # None: 1 / sqrt(the query head dim), SDPA's default
        self._build_projections(config, tp_size)
        # QK-clip / --log-max-attention-logit: this iteration's running max pre-softmax logit
        # per local head (attention_logits.py), reset and read by optimizer/qk_clip.py.
        self.max_logits: Optional[torch.Tensor] = None
        # One more logit per head in the softmax's denominator, or none ("vanilla").
        if config.softmax_type == "off-by-one":  # a fixed 0: the denominator + 1
            self.register_buffer("sinks", device.zeros(self.local_heads), persistent=False)
        else:
            self.sinks = _learned_sinks(config, self.local_heads) \
                if config.softmax_type == "learnable" else None

    def _build_projections(self, config, tp_size: int) -> None:
        """The head layout (head_dim, heads_per_group, local_groups, local_heads) and the
        layers that make Q, K, V and project the output: here the fused QKV (a subclass,
        multi-latent attention, builds its own and reuses the attention below)."""
        self.heads_for_sdpa = compiled(_heads_for_sdpa) if compiled_head_layout(config) \
            else None
        self.head_dim = config.kv_channels
        self.heads_per_group = config.num_attention_heads // config.num_query_groups
        self.local_groups = divide(config.num_query_groups, tp_size)
        self.local_heads = self.local_groups * self.heads_per_group
        qkv_size = (config.num_attention_heads + 2 * config.num_query_groups) * self.head_dim
        out_init = (scaled_init_method_normal(config.init_method_std, config.num_layers)
                    if config.scaled_output_init else init_method_normal(config.init_method_std))
        self.linear_qkv = ColumnParallelLinear(
            config.hidden_size, qkv_size, config=config, bias=config.add_qkv_bias,
            init_method=init_method_normal(config.init_method_std))
        self.linear_proj = RowParallelLinear(
            config.num_attention_heads * self.head_dim, config.hidden_size, config=config,
            bias=config.add_bias_linear, input_is_parallel=True, skip_bias_add=True,
            init_method=out_init)
        if config.qk_layernorm:
            self.q_layernorm = _build_head_norm(config)
            self.k_layernorm = _build_head_norm(config)

    def qk_clip_layout(self) -> FusedQKVRows:
        """The rows QK-clip rescales (optimizer/qk_clip.py)."""
        return FusedQKVRows(self.linear_qkv.weight, self.linear_qkv.bias, self.heads_per_group,
                            self.head_dim)

    def forward(self, hidden, attention_mask=None, rotary_cos=None, rotary_sin=None,
                packed_seq_params: Optional[PackedSeqParams] = None):
        """hidden [s, b, h] (sequence-sharded under SP) -> (output [s, b, h], bias or None)."""
        qkv, _ = self.linear_qkv(hidden)
        s, b = qkv.shape[:2]
        qkv = qkv.view(s, b, self.local_groups, self.heads_per_group + 2, self.head_dim)
        if self.heads_for_sdpa is not None and packed_seq_params is None:
            # The compiled path: Q, K, V laid out for SDPA with RoPE in one pass (and back).
            query, key, value = self.heads_for_sdpa(qkv, rotary_cos, rotary_sin,
                                                    self.heads_per_group)
            return self._attend(query, key, value, attention_mask, packed_seq_params)
        qkv = qkv.transpose(0, 1)  # [b, s, groups, per-group, d]
        # split, not slicing: its backward is one concatenation, where each slice's backward
        # would zero-fill a qkv-sized buffer.
        query, key, value = torch.split(qkv, [self.heads_per_group, 1, 1], dim=3)
        query = query.reshape(b, s, self.local_heads, self.head_dim)
        key, value = key.squeeze(3), value.squeeze(3)
        if self.config.qk_layernorm:
            query, key = self.q_layernorm(query), self.k_layernorm(key)
        if rotary_cos is not None:
            query = self.apply_rotary(query, rotary_cos, rotary_sin)
            key = self.apply_rotary(key, rotary_cos, rotary_sin)
        return self._attend(query, key, value, attention_mask, packed_seq_params)

    def _attend(self, query, key, value, attention_mask, packed_seq_params):
        """[b, s, heads|groups, d] Q, K, V (RoPE applied) -> (output [s, b, h], bias)."""
        return self.linear_proj(self._attention(query, key, value, attention_mask,
                                                packed_seq_params))

    def _attention(self, query, key, value, attention_mask, packed_seq_params):
        """[b, s, heads|groups, d] Q, K, V -> [s, b, heads * d_v], d_v being V's head dim."""
        if self.training and (self.config.qk_clip or self.config.log_max_attention_logit):
            # Here, where every kernel path starts (SDPA, variable-length, windowed, per
            # document, context-parallel; multi-latent attention's too).
            record_max_logits(self, query, key, attention_mask, packed_seq_params)
        dropout = self.config.attention_dropout if self.training else 0.0
        if self.config.context_parallel_size > 1 or self.sinks is not None:
            return self._context_parallel_attention(query, key, value, attention_mask,
                                                    packed_seq_params, dropout)
        kernel, _ = self._kernel(query, attention_mask if packed_seq_params is None else None,
                                 dropout)
        # Selective recomputation pays only where the kernel keeps the s x s softmax (math);
        # flash / memory-efficient keep Q, K, V, the output and log-sum-exp, nothing to save.
        if self.config.recompute_granularity == "selective" and kernel == "math":
            context = checkpoint(self._core_attention, False, query, key, value,
                                 attention_mask, packed_seq_params)
        else:
            context = self._core_attention(query, key, value, attention_mask, packed_seq_params)
        return context

    def _context_parallel_attention(self, query, key, value, attention_mask, packed_seq_params,
                                    dropout: float):
        """[b, s/CP, heads|groups, d] of this rank's two chunks -> [s/CP, b, heads * d]: causal
        (per document with ``packed_seq_params``, within the layer's window) over the whole
        sequence, the other chunks' keys/values coming from the CP ranks (context_parallel/).
        Attention sinks take this path at any CP size (one rank: no communication, its
        kernels return the log-sum-exp the sinks need). It saves what flash attention saves
        (q, k, v, output, log-sum-exp), so selective recomputation has nothing to do here."""
        if attention_mask is not None:
            what = ("context parallelism cannot split" if self.config.context_parallel_size > 1
                    else "attention sinks cannot take")
            raise ValueError(f"{what} an explicit [b, 1, s, s] attention mask; pass document "
                             f"boundaries (packed_seq_params) instead, as "
                             f"--reset-attention-mask does.")
        b, s = query.shape[:2]
        seed = context_parallel_dropout_seed(query.device) if dropout > 0 else None
        out = context_parallel_attention(
            *(t.transpose(1, 2) for t in (query, key, value)),
            group=parallel_state.get_context_parallel_group(),
            comm_type=self.config.cp_comm_type, dropout_p=dropout, dropout_seed=seed,
            head_offset=parallel_state.get_tensor_model_parallel_rank() * self.local_heads,
            document_ids=None if packed_seq_params is None else packed_seq_params.document_ids,
            softmax_scale=self.softmax_scale, window=self.window, sinks=self.sinks,
            kernel_device_type=self.kernel_device(query))
        return out.permute(2, 0, 1, 3).reshape(s, b, -1)

    def kernel_device(self, query) -> str:
        """The device type whose kernel rules apply to this call (see ``__init__``)."""
        return self.kernel_device_type or query.device.type

    def _kernel(self, query, attention_mask, dropout: float) -> Tuple[str, bool]:
        return sdpa_kernel_for(self.kernel_device(query), query.dtype, self.head_dim,
                               self.heads_per_group > 1, attention_mask is not None, dropout > 0)

    def _core_attention(self, query, key, value, attention_mask, packed_seq_params=None):
        """[b, s, heads|groups, d] -> [s, b, heads * d]; causal unless a mask is given
        (Megatron's convention: True marks positions that may NOT be attended); within each
        document with ``packed_seq_params``."""
        b, s = query.shape[:2]
        dropout = self.config.attention_dropout if self.training else 0.0
        # Heads are sharded over TP, so dropout draws from the per-TP-rank stream.
        rng = get_rng_tracker().fork() if dropout > 0 else contextlib.nullcontext()
        with rng:
            if packed_seq_params is not None:
                out = self._packed_attention(query, key, value, packed_seq_params, dropout)
                return out.view(b, s, -1).transpose(0, 1).reshape(s, b, -1)
            if self.window is not None:
                return self._windowed_attention(query, key, value, attention_mask, dropout)
            out = self._sdpa(*(t.transpose(1, 2) for t in (query, key, value)),
                             attention_mask, dropout)
        return out.permute(2, 0, 1, 3).reshape(s, b, -1)

    def _sdpa(self, query, key, value, attention_mask, dropout, is_causal=True):
        """[b, heads|groups, s, d] -> [b, heads, s, d]."""
        kwargs = {}
        _, repeat_kv = self._kernel(query, attention_mask, dropout)
        if self.heads_per_group > 1:
            if not repeat_kv:
                kwargs["enable_gqa"] = True
            else:  # the memory-efficient kernel needs equal head counts (see sdpa_kernel_for)
                key = key.repeat_interleave(self.heads_per_group, dim=1)
                value = value.repeat_interleave(self.heads_per_group, dim=1)
        if attention_mask is None:
            return F.scaled_dot_product_attention(query, key, value, dropout_p=dropout,
                                                  is_causal=is_causal,
                                                  scale=self.softmax_scale, **kwargs)
        return F.scaled_dot_product_attention(query, key, value, attn_mask=~attention_mask,
                                              dropout_p=dropout, scale=self.softmax_scale,
                                              **kwargs)

    def _varlen_applies(self, query, dropout: float) -> bool:
        return (self.kernel_device(query) == "cuda" and varlen_kernel() is not None
                and dropout == 0
                and query.dtype in HALF_DTYPES and self.head_dim <= FLASH_MAX_HEAD_DIM
                and (self.window is None or "window_size" in _VARLEN_PARAMS))

    def _varlen(self, query, key, value, cu_seqlens, max_seqlen):
        """[tokens, heads|groups, d] -> [tokens, heads, d]: torch's variable-length flash
        kernel, causal, within this layer's window where it has one."""
        left = -1 if self.window is None else self.window
        kwargs = {"window_size": (left, 0)}
        if "is_causal" in _VARLEN_PARAMS and self.window is None:
            kwargs = {"is_causal": True}
        if "enable_gqa" in _VARLEN_PARAMS:
            kwargs["enable_gqa"] = self.heads_per_group > 1
        if self.softmax_scale is not None:
            kwargs["scale"] = self.softmax_scale
        return _varlen_attn(query, key, value, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen,
                            **kwargs)

    def _windowed_attention(self, query, key, value, attention_mask, dropout: float):
        """[b, s, heads|groups, d] -> [s, b, heads * d]: causal attention within this layer's
        window (sliding_window.py): the flash kernel's window on CUDA, query blocks
        elsewhere."""
        if attention_mask is not None:
            raise ValueError("a sliding window cannot combine with an explicit [b, 1, s, s] "
                             "attention mask; pass document boundaries (packed_seq_params) "
                             "instead, as --reset-attention-mask does.")
        b, s = query.shape[:2]
        if self._varlen_applies(query, dropout):
            cu = torch.arange(0, (b + 1) * s, s, device=query.device, dtype=torch.int32)
            out = self._varlen(*(t.reshape(b * s, t.shape[2], self.head_dim)
                                 for t in (query, key, value)), cu, s)
            return out.view(b, s, -1).transpose(0, 1).reshape(s, b, -1)
        out = blocked_window_attention(*(t.transpose(1, 2) for t in (query, key, value)),
                                       self.window, dropout,
                                       enable_gqa=self.heads_per_group > 1)
        return out.permute(2, 0, 1, 3).reshape(s, b, self.local_heads * self.head_dim)

    def _packed_attention(self, query, key, value, packed: PackedSeqParams, dropout: float):
        """[b, s, heads|groups, d] -> [b * s, heads, d], causal within each document."""
        b, s = query.shape[:2]
        query, key, value = (t.reshape(b * s, t.shape[2], t.shape[3])
                             for t in (query, key, value))
        if self._varlen_applies(query, dropout):
            # One flash kernel over all documents (it has no dropout).
            return self._varlen(query, key, value, packed.cu_seqlens, packed.max_seqlen)
        # One causal SDPA per document (within the window where the layer has one); split
        # (not slicing) so backward is one concatenation.
        outs = [self._document_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                         v.transpose(0, 1)[None], dropout)[0].transpose(0, 1)
                for q, k, v in zip(*(torch.split(t, packed.seqlens) for t in
                                     (query, key, value)))]
        return torch.cat(outs)

    def _document_attention(self, query, key, value, dropout):
        """[1, heads|groups, len, d] -> [1, heads, len, d], causal (within the window)."""
        if self.window is None:
            return self._sdpa(query, key, value, None, dropout)
        return blocked_window_attention(query, key, value, self.window, dropout,
                                        enable_gqa=self.heads_per_group > 1)
