"""Attention paths: packed documents (no s x s tensor, equal to the masked reference), the
SDPA kernel decision and the math-kernel check for CUDA, selective recomputation only where the
kernel keeps the softmax, and a QKV split whose backward zero-fills nothing."""
import types

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from megatron.core import parallel_state as ps
from megatron.core.models import GPTModel, LlamaModel, llama_config
from megatron.core.packed_seq_params import packed_seq_params_from_eod
from megatron.core.tensor_parallel import model_parallel_manual_seed
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.attention import (
    SelfAttention,
    math_attention_reason,
    sdpa_kernel_for,
)
from megatron.training.data.batch import get_ltor_masks_and_position_ids
from tests.distributed import run_distributed

VOCAB, EOD = 64, 0


def _config(kind, **overrides):
    tp = ps.get_tensor_model_parallel_world_size()
    common = dict(num_layers=2, hidden_size=32, max_position_embeddings=512,
                  attention_dropout=0.0, hidden_dropout=0.0, tensor_model_parallel_size=tp)
    if kind == "llama":  # grouped-query attention: 8 heads in 4 groups
        return llama_config(**{**common, "num_attention_heads": 8, "num_query_groups": 4,
                               "ffn_hidden_size": 48, **overrides})
    return TransformerConfig(**{**common, "num_attention_heads": 4, **overrides})


def _model(kind, **overrides):
    torch.manual_seed(7)
    model_parallel_manual_seed(7)
    cls = LlamaModel if kind == "llama" else GPTModel
    return cls(_config(kind, **overrides), VOCAB).train()


def _packed_tokens(b, s, seed=1):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(1, VOCAB, (b, s), generator=g)
    tokens[0, [5, 17, s // 2]] = EOD  # several documents, one ending on the last token
    tokens[0, s - 1] = EOD
    if b > 1:
        tokens[1, 0] = EOD  # a one-token document first, then one long one
    return tokens, torch.randint(0, VOCAB, (b, s), generator=g)


# ------------------------------------------------------------ packed == masked reference

def _packed_vs_masked(kind):
    model = _model(kind)
    tokens, labels = _packed_tokens(2, 40)
    mask, _, positions = get_ltor_masks_and_position_ids(tokens, EOD, True, True, False)

    def run(**kwargs):
        model.zero_grad()
        loss = model(tokens, position_ids=positions, labels=labels, **kwargs)
        loss.sum().backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    # The reference: today's [b, 1, s, s] mask through SDPA.
    want_loss, want_grads = run(attention_mask=mask)
    got_loss, got_grads = run(packed_seq_params=packed_seq_params_from_eod(tokens, EOD))
    # Another path: a plain causal model differs, so the documents are really separated.
    causal_loss = model(tokens, position_ids=positions, labels=labels).detach()
    return want_loss, want_grads, got_loss, got_grads, causal_loss


@pytest.mark.parametrize("kind", ["llama", "gpt"])
@pytest.mark.parametrize("tp", [1, 2])
def test_packed_documents_equal_the_masked_reference(kind, tp):
    for want_loss, want_grads, got_loss, got_grads, causal in run_distributed(
            _packed_vs_masked, world_size=tp, tp=tp, kind=kind):
        # fp32; not bitwise: per-document softmax blocks sum in another order than the
        # masked full rows (observed differences ~5e-7).
        torch.testing.assert_close(got_loss, want_loss, rtol=1e-5, atol=1e-5)
        for name in want_grads:
            torch.testing.assert_close(got_grads[name], want_grads[name], rtol=1e-5,
                                       atol=1e-5, msg=name)
        assert (causal - want_loss).abs().max() > 1e-3


class _LargestTensor(TorchDispatchMode):
    """The largest tensor any op creates (forward and backward)."""

    def __init__(self):
        super().__init__()
        self.largest = (0, None)

    def __torch_dispatch__(self, func, types_, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.numel() > self.largest[0]:
                self.largest = (t.numel(), f"{func} {tuple(t.shape)}")
        return out


def _largest_tensor_in_packed_training_step(kind):
    from megatron.training.gpt_step import forward_step

    b, s = 2, 512
    tokens, _ = _packed_tokens(b, s + 1)
    model = _model(kind)
    configs = types.SimpleNamespace(
        dataset=types.SimpleNamespace(eod_token=EOD, reset_position_ids=True,
                                      reset_attention_mask=True, eod_mask_loss=False,
                                      seq_length=s),
        training=types.SimpleNamespace(micro_batch_size=b))
    with _LargestTensor() as seen:
        output, loss_func = forward_step(iter([{"text": tokens}]), model, configs)
        loss_func(output)[0].backward()
    return seen.largest, s * s


@pytest.mark.parametrize("kind", ["llama", "gpt"])
def test_packed_training_step_builds_no_s_by_s_tensor(kind):
    # The batch, forward and backward of a packed step: nothing of s x s elements (the old
    # path built a [b, 1, s, s] mask, and under GQA SDPA's math kernel [b, heads, s, s]).
    # Everything else here is far smaller (s * ffn * b = s * s / 2 at most).
    (largest, s_by_s), = run_distributed(_largest_tensor_in_packed_training_step,
                                         world_size=1, tp=1, kind=kind)
    assert largest[0] < s_by_s, largest


# ------------------------------------------------------------ which SDPA kernel on CUDA

@pytest.mark.parametrize("dtype,d,gqa,mask,dropout,want", [
    (torch.bfloat16, 128, True, False, True, ("flash", False)),
    (torch.float16, 256, False, False, False, ("flash", False)),
    (torch.bfloat16, 128, True, True, False, ("efficient", True)),  # flash takes no mask
    (torch.bfloat16, 128, False, True, False, ("efficient", False)),
    (torch.float32, 64, True, False, False, ("efficient", True)),  # flash is fp16/bf16 only
    (torch.float32, 64, False, False, True, ("efficient", False)),
    (torch.bfloat16, 320, True, False, False, ("efficient", True)),  # above flash's 256
    (torch.bfloat16, 260, False, False, False, ("math", False)),  # > 256 and not 8-aligned
    (torch.float32, 30, False, False, False, ("math", False)),  # fp32 and not 4-aligned
])
def test_sdpa_kernel_decision_on_cuda(dtype, d, gqa, mask, dropout, want):
    assert sdpa_kernel_for("cuda", dtype, d, gqa, mask, dropout) == want


def test_sdpa_kernel_decision_on_cpu():
    # CPU: the flash kernel unless attention dropout is on; never expanded K/V.
    assert sdpa_kernel_for("cpu", torch.float32, 30, True, True, False) == ("flash", False)
    assert sdpa_kernel_for("cpu", torch.float32, 64, True, False, True) == ("math", False)


def test_math_attention_reason_names_the_cause_and_the_fix():
    fp32_odd = TransformerConfig(num_layers=1, hidden_size=36, num_attention_heads=4)
    reason = math_attention_reason(fp32_odd, "cuda")
    assert "float32 rules out flash attention" in reason and "head dim 9" in reason
    assert "--allow-math-attention" in reason and "--bf16" in reason
    assert math_attention_reason(fp32_odd, "cpu") is None  # CPU: unfused is expected
    wide = TransformerConfig(num_layers=1, hidden_size=520, num_attention_heads=2,
                             params_dtype=torch.bfloat16)
    assert "head dim 260 is above flash attention's 256" in math_attention_reason(wide, "cuda")
    for fine in (TransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=4),
                 TransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=4,
                                   num_query_groups=2, params_dtype=torch.bfloat16)):
        assert math_attention_reason(fine, "cuda") is None


# ------------------------------------------------------------ selective recomputation

def _core_attention_calls(kind, recompute, attention_dropout, packed):
    calls = []
    original = SelfAttention._core_attention

    def counting(self, *args, **kwargs):
        calls.append(self.layer_number)
        return original(self, *args, **kwargs)

    SelfAttention._core_attention = counting
    try:
        model = _model(kind, recompute_granularity=recompute,
                       attention_dropout=attention_dropout)
        tokens, labels = _packed_tokens(2, 32)
        kwargs = {"packed_seq_params": packed_seq_params_from_eod(tokens, EOD)} if packed else {}
        model(tokens, labels=labels, **kwargs).sum().backward()
    finally:
        SelfAttention._core_attention = original
    return len(calls)


@pytest.mark.parametrize("packed", [False, True])
def test_selective_recompute_only_where_the_kernel_keeps_the_softmax(packed):
    def calls(**kw):
        return run_distributed(_core_attention_calls, world_size=1, tp=1, kind="llama",
                               packed=packed, **kw)[0]
    layers = 2
    # Fused kernel (CPU without attention dropout): selective == none, one run per layer.
    assert calls(recompute=None, attention_dropout=0.0) == layers
    assert calls(recompute="selective", attention_dropout=0.0) == layers
    # Unfused (CPU with attention dropout keeps the s x s softmax): recomputed in backward.
    assert calls(recompute=None, attention_dropout=0.1) == layers
    assert calls(recompute="selective", attention_dropout=0.1) == 2 * layers


# ------------------------------------------------------------ QKV split backward

class _ZeroFills(TorchDispatchMode):
    """Ops that fill a buffer of ``numel`` elements with zeros (directly, or as the
    backward of a slice / select, which zero-fills the whole input and copies one part)."""
    NAMES = ("zeros", "new_zeros", "zero_", "fill_", "zeros_like", "slice_backward",
             "select_backward")

    def __init__(self, numel):
        super().__init__()
        self.numel, self.seen = numel, []

    def __torch_dispatch__(self, func, types_, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if name in self.NAMES and isinstance(out, torch.Tensor) and out.numel() == self.numel:
            self.seen.append(name)
        return out


def _qkv_backward(rope):
    torch.manual_seed(3)
    config = _config("llama" if rope else "gpt", num_layers=1)
    attention = SelfAttention(config, 1)
    b, s = 2, 16
    hidden = torch.randn(s, b, config.hidden_size, requires_grad=True)
    cos = sin = None
    if rope:
        from megatron.core.transformer.rope import RotaryEmbedding
        cos, sin = RotaryEmbedding(config)(torch.arange(s).unsqueeze(0))
    out, _ = attention(hidden, None, cos, sin)
    qkv_numel = s * b * attention.linear_qkv.weight.shape[0]
    with _ZeroFills(qkv_numel) as fills:
        out.sum().backward()
    return fills.seen, [hidden.grad] + [p.grad for p in attention.parameters()]


# Gradients of the slicing version (before the split), fp32 CPU: the split must match bitwise.
def _qkv_slicing_reference(rope):
    import megatron.core.transformer.attention as attention_module
    from megatron.core.transformer.rope import apply_rotary

    def sliced_forward(self, hidden, attention_mask=None, rotary_cos=None, rotary_sin=None,
                       packed_seq_params=None):
        qkv, _ = self.linear_qkv(hidden)
        s, b = qkv.shape[:2]
        qkv = qkv.view(s, b, self.local_groups, self.heads_per_group + 2, self.head_dim)
        qkv = qkv.transpose(0, 1)
        query = qkv[:, :, :, :self.heads_per_group].reshape(b, s, self.local_heads,
                                                              self.head_dim)
        key, value = qkv[:, :, :, -2], qkv[:, :, :, -1]
        if rotary_cos is not None:
            query = apply_rotary(query, rotary_cos, rotary_sin)
            key = apply_rotary(key, rotary_cos, rotary_sin)
        return self.linear_proj(self._core_attention(query, key, value, None))

    original = attention_module.SelfAttention.forward
    attention_module.SelfAttention.forward = sliced_forward
    try:
        return _qkv_backward(rope)
    finally:
        attention_module.SelfAttention.forward = original


@pytest.mark.parametrize("rope", [False, True])
def test_qkv_split_backward_zero_fills_nothing_and_keeps_gradients(rope):
    (fills, grads), = run_distributed(_qkv_backward, world_size=1, tp=1, rope=rope)
    assert fills == []
    (old_fills, old_grads), = run_distributed(_qkv_slicing_reference, world_size=1, tp=1,
                                              rope=rope)
    assert len(old_fills) >= 3, old_fills  # what the slicing did: one per slice
    for got, want in zip(grads, old_grads):
        assert (got is None and want is None) or torch.equal(got, want)


@pytest.mark.parametrize("rope", [False, True])
def test_compiled_head_layout_is_the_eager_split_in_sequence_major_memory(rope):
    """``_heads_for_sdpa`` (the function the compiled path compiles; run eagerly here, so the
    arithmetic is the same ops) gives the eager path's Q, K, V and QKV gradient bit for bit,
    each a [b, s, ...] view of [s, b, ...] memory: the fused SDPA kernels then write their
    output [s, b, heads, d] in memory and the output projection's input is a view (the CUDA
    side: tests/gpu/test_attention_gpu.py counts the copies)."""
    from megatron.core.transformer.attention import _heads_for_sdpa
    from megatron.core.transformer.rope import apply_rotary

    s, b, groups, per_group, d = 6, 3, 2, 3, 8
    g = torch.Generator().manual_seed(0)
    qkv = torch.randn(s, b, groups, per_group + 2, d, generator=g, dtype=torch.float64)
    cos = torch.randn(1, s, 1, d, generator=g, dtype=torch.float64) if rope else None
    sin = torch.randn(1, s, 1, d, generator=g, dtype=torch.float64) if rope else None
    seeds = [torch.randn(b, s, n, d, generator=g, dtype=torch.float64)
             for n in (groups * per_group, groups, groups)]

    def eager(x):  # SelfAttention.forward's eager path
        query, key, value = torch.split(x.transpose(0, 1), [per_group, 1, 1], dim=3)
        query = query.reshape(b, s, groups * per_group, d)
        key, value = key.squeeze(3), value.squeeze(3)
        if rope:
            query, key = apply_rotary(query, cos, sin), apply_rotary(key, cos, sin)
        return query, key, value

    results = []
    for fn in (eager, lambda x: _heads_for_sdpa(x, cos, sin, per_group)):
        x = qkv.clone().requires_grad_()
        outs = fn(x)
        sum((o * w).sum() for o, w in zip(outs, seeds)).backward()
        results.append((outs, x.grad))
    (want, want_grad), (got, got_grad) = results
    for o, w in zip(got, want):
        assert torch.equal(o, w)
        assert o.transpose(0, 1).is_contiguous()  # [s, b, heads|groups, d] in memory
    assert torch.equal(got_grad, want_grad)
