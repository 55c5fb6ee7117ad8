"""Attention's device-chosen branches, each run on CPU: ``SelfAttention(...,
kernel_device_type="cuda")`` picks the path CUDA picks, and that path's own code runs with
CPU kernels (torch.nn.attention.sdpa_kernel's math or flash backend) or, for kernels CPU has
not, a stand-in with the same contract. Each branch, with grouped-query attention (8 heads
in 4 groups) and causal or a padding / document mask where it takes one, gives the default
CPU path's output and gradients (input and every parameter):

- SDPA's memory-efficient kernel (fp32): K/V expanded to the query heads (repeat_interleave,
  the kernel wants equal head counts), causal and with an explicit padding mask;
- SDPA's math kernel where CUDA falls back to it (head dim 6: no fused kernel's alignment),
  under selective recomputation, which only that kernel pays for;
- SDPA's flash kernel (bf16): K/V unexpanded, enable_gqa;
- torch's variable-length flash kernel (bf16; CUDA only, a stand-in here): packed
  documents, a sliding window, both;
- the context-parallel block kernels at one rank (attention sinks take that path): CUDA's
  flash op (the CPU stand-in of test_context_parallel_kernel_choice.py) where CPU runs its
  own flash op, and the fp32 reference blocks for packed documents where CPU runs its flash
  op with a mask.
"""
import inspect

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from megatron.core.packed_seq_params import packed_seq_params_from_eod
from megatron.core.tensor_parallel import model_parallel_manual_seed
from megatron.core.transformer import TransformerConfig
from tests.distributed import run_distributed

B, S, HEADS, GROUPS, EOD = 2, 24, 8, 4, 0
# The largest difference, relative to the largest entry, of the output and of each gradient.
# fp32: the same arithmetic summed in another order (math against flash; measured <= 3e-7).
# bf16: an fp32 softmax (the stand-ins, the reference blocks) against bf16 kernels, through
# bf16 projections (measured <= 7.2e-3, about one bf16 rounding step of 2^-7): two steps.
TOLERANCE = {torch.float32: 2e-6, torch.bfloat16: 1.6e-2}

# name -> (dtype, head dim, TransformerConfig fields, inputs, the path CUDA takes)
CASES = {
    "efficient-causal": (torch.float32, 8, {}, "causal", ("sdpa", "efficient", True)),
    "efficient-padding-mask": (torch.float32, 8, {}, "mask", ("sdpa", "efficient", True)),
    "math-causal-selective": (torch.float32, 6, {"recompute_granularity": "selective"},
                              "causal", ("sdpa", "math", False)),
    "math-padding-mask-selective": (torch.float32, 6, {"recompute_granularity": "selective"},
                                    "mask", ("sdpa", "math", False)),
    "flash-causal": (torch.bfloat16, 8, {}, "causal", ("sdpa", "flash", False)),
    "varlen-documents": (torch.bfloat16, 8, {}, "documents", ("varlen",)),
    "varlen-window": (torch.bfloat16, 8, {"window_size": (5, 0)}, "causal", ("varlen",)),
    "varlen-window-documents": (torch.bfloat16, 8, {"window_size": (5, 0)}, "documents",
                                ("varlen",)),
    "cp-flash-sinks": (torch.bfloat16, 8, {"softmax_type": "learnable"}, "causal",
                       ("block", "cuda_flash")),
    "cp-reference-sinks-documents": (torch.bfloat16, 8, {"softmax_type": "learnable"},
                                     "documents", ("block", "reference")),
}
# What the default CPU path runs (for all but flash-causal another branch).
CPU_PATHS = {"efficient-causal": ("sdpa", "flash", False),
             "efficient-padding-mask": ("sdpa", "flash", False),
             "math-causal-selective": ("sdpa", "flash", False),
             "math-padding-mask-selective": ("sdpa", "flash", False),
             "flash-causal": ("sdpa", "flash", False),
             "varlen-documents": ("sdpa", "flash", False),  # one SDPA per document
             "varlen-window": ("blocked",), "varlen-window-documents": ("blocked",),
             "cp-flash-sinks": ("block", "cpu_flash"),
             "cp-reference-sinks-documents": ("block", "cpu_flash")}
# The SDPA backend the forced run uses on CPU for each kernel CUDA would run (CPU has no
# memory-efficient kernel: its K/V expansion goes through the math kernel).
CPU_BACKEND = {"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.MATH,
               "math": SDPBackend.MATH}


def varlen_stand_in(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None,
                    scale=None, window_size=(-1, -1), enable_gqa=False, seqused_k=None,
                    block_table=None, num_splits=None):
    """torch.nn.attention.varlen.varlen_attn's contract (its torch 2.13 signature), on CPU:
    [tokens, heads|groups, d] per sequence of ``cu_seq_q``; key j visible to query i when
    i - left <= j <= i + right (-1: unbounded); fp32 softmax, the input dtype out."""
    assert torch.equal(cu_seq_q, cu_seq_k) and max_q == max_k and return_aux is None
    bounds = cu_seq_q.tolist()
    assert bounds[-1] == query.shape[0] and max(b - a for a, b in zip(bounds, bounds[1:])) \
        <= max_q
    hq, hkv = query.shape[1], key.shape[1]
    if hq != hkv and not enable_gqa:
        raise ValueError("Expect query and key/value to have the same number of heads")
    left, right = window_size
    outs = []
    for start, end in zip(bounds[:-1], bounds[1:]):
        q, k, v = (t[start:end].transpose(0, 1).float() for t in (query, key, value))
        k, v = (t.repeat_interleave(hq // hkv, dim=0) for t in (k, v))
        i, j = torch.arange(end - start)[:, None], torch.arange(end - start)[None, :]
        visible = torch.ones(end - start, end - start, dtype=torch.bool)
        if left >= 0:
            visible &= j >= i - left
        if right >= 0:
            visible &= j <= i + right
        outs.append(F.scaled_dot_product_attention(q, k, v, attn_mask=visible, scale=scale)
                    .transpose(0, 1))
    return torch.cat(outs).to(query.dtype)


def _inputs(kind, dtype, hidden_size):
    g = torch.Generator().manual_seed(5)
    hidden = torch.randn(S, B, hidden_size, generator=g).to(dtype).requires_grad_()
    dout = torch.randn(S, B, hidden_size, generator=g)
    mask = packed = None
    if kind == "mask":  # True: not attended. Causal, and sample 1 ends in 5 padding keys.
        mask = torch.ones(S, S, dtype=torch.bool).triu(1)[None, None].repeat(B, 1, 1, 1)
        mask[1, :, :, S - 5:] = True
    if kind == "documents":
        tokens = torch.randint(1, 64, (B, S), generator=g)
        tokens[0, [4, 13]] = EOD
        tokens[1, 0] = EOD  # a one-token document
        packed = packed_seq_params_from_eod(tokens, EOD)
    return hidden, dout, mask, packed


def _recording(attention):
    """Record the branch each call of ``attention`` takes (as CASES names them)."""
    import megatron.core.transformer.attention as attention_module
    from megatron.core.transformer import context_parallel as cp_module

    taken, restore = [], []

    def wrap(owner, name, record):
        original = getattr(owner, name)

        def wrapper(*args, **kwargs):
            result = original(*args, **kwargs)
            record(result)
            return result
        setattr(owner, name, wrapper)
        restore.append((owner, name, original))

    sdpa = attention._sdpa

    def sdpa_recorded(query, key, value, attention_mask, dropout, is_causal=True):
        taken.append(("sdpa", *attention._kernel(query, attention_mask, dropout)))
        return sdpa(query, key, value, attention_mask, dropout, is_causal)
    attention._sdpa = sdpa_recorded
    restore.append((attention, "_sdpa", sdpa))
    wrap(attention, "_varlen", lambda result: taken.append(("varlen",)))
    wrap(attention_module, "blocked_window_attention", lambda result: taken.append(("blocked",)))
    wrap(cp_module, "choose_block_kernel", lambda result: taken.append(("block", result)))
    return taken, restore


def _run_case(name):
    """(branches taken by default, by the forced path; the largest difference of output and
    each gradient relative to its largest entry)."""
    import megatron.core.transformer.attention as attention_module
    from megatron.core.transformer.attention import SelfAttention
    from megatron.core.transformer.context_parallel import blocks
    from tests.unit.test_context_parallel_kernel_choice import _cpu_stand_in

    dtype, head_dim, fields, kind, _ = CASES[name]
    config = TransformerConfig(
        num_layers=1, hidden_size=HEADS * head_dim, num_attention_heads=HEADS,
        num_query_groups=GROUPS, attention_dropout=0.0, hidden_dropout=0.0,
        params_dtype=dtype, add_bias_linear=False, **fields)
    torch.manual_seed(3)
    model_parallel_manual_seed(3)
    attention = SelfAttention(config, 1).train()
    hidden, dout, mask, packed = _inputs(kind, dtype, config.hidden_size)

    def run(kernel_device_type):
        attention.kernel_device_type = kernel_device_type
        attention.zero_grad()
        hidden.grad = None
        taken, restore = _recording(attention)
        try:
            out, _ = attention(hidden, mask, None, None, packed)
            (out.float() * dout).sum().backward()
        finally:
            for owner, attr, original in reversed(restore):
                setattr(owner, attr, original)
        grads = [hidden.grad] + [p.grad for p in attention.parameters()]
        return taken, [t.detach().float() for t in [out] + grads]

    default_taken, want = run(None)
    saved = (attention_module._varlen_attn, attention_module._VARLEN_PARAMS,
             blocks._cuda_flash_ops)
    attention_module._varlen_attn = varlen_stand_in
    attention_module._VARLEN_PARAMS = inspect.signature(varlen_stand_in).parameters
    blocks._cuda_flash_ops = lambda: _cpu_stand_in([])
    try:
        forced_kernel = CASES[name][4]
        backend = CPU_BACKEND.get(forced_kernel[1]) if forced_kernel[0] == "sdpa" else None
        if backend is None:
            forced_taken, got = run("cuda")
        else:
            with sdpa_kernel(backend):
                forced_taken, got = run("cuda")
    finally:
        (attention_module._varlen_attn, attention_module._VARLEN_PARAMS,
         blocks._cuda_flash_ops) = saved
    errors = [((g - w).abs().max() / w.abs().max()).item() for g, w in zip(got, want)]
    return default_taken, forced_taken, errors


@pytest.mark.parametrize("name", CASES)
def test_cuda_branch_on_cpu_equals_the_default_path(name):
    default_taken, forced_taken, errors = run_distributed(_run_case, world_size=1, tp=1,
                                                          name=name)[0]
    assert set(forced_taken) == {CASES[name][4]}, forced_taken
    assert set(default_taken) == {CPU_PATHS[name]}, default_taken
    if "selective" in name:  # the math kernel recomputes in backward; CPU's flash does not
        assert len(forced_taken) == 2 * len(default_taken), (forced_taken, default_taken)
    assert max(errors) <= TOLERANCE[CASES[name][0]], errors
