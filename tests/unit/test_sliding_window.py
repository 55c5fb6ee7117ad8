"""Sliding-window attention (--window-size W,0): our attention layer equals a plain-torch
reference that builds the whole [s, s] window mask (outputs and input gradients, fp32, GQA),
for windows shorter and longer than the query blocks, zero (each token sees itself), and past
the sequence (plain causal attention); with packed documents each document gets its own
window; every window_attn_skip_freq-th layer keeps full attention; bad windows are refused."""
import pytest
import torch

from megatron.core.transformer.sliding_window import blocked_window_attention, layer_window
from tests.distributed import run_distributed


def _reference(query, key, value, window, documents=None):
    """[b, h|g, s, d]: the whole mask at once (s x s), GQA by repeating K/V."""
    s = query.shape[2]
    # Written out from the definition (query i sees keys i - window .. i), not window_mask.
    mask = torch.tensor([[i - window <= j <= i for j in range(s)] for i in range(s)])
    if documents is not None:
        doc = torch.repeat_interleave(torch.arange(len(documents)), torch.tensor(documents))
        mask &= doc[:, None] == doc[None, :]
    groups = query.shape[1] // key.shape[1]
    key, value = (t.repeat_interleave(groups, dim=1) for t in (key, value))
    scores = query @ key.transpose(-1, -2) / query.shape[-1] ** 0.5
    return torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1) @ value


def _inputs(s, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(2, n, s, 16, generator=g, dtype=torch.float64).requires_grad_()
            for n in (4, 2, 2)]


@pytest.mark.parametrize("s,window,block", [(50, 7, 16), (50, 20, 16), (50, 0, 16),
                                            (50, 60, 16), (33, 16, 256)])
def test_blocked_window_equals_the_whole_mask(s, window, block):
    ours_in, ref_in = _inputs(s), _inputs(s)
    got = blocked_window_attention(*ours_in, window, block=block, enable_gqa=True)
    want = _reference(*ref_in, window)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    seed = torch.randn_like(got)
    got.backward(seed)
    want.backward(seed)
    for a, b in zip(ours_in, ref_in):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-10, atol=1e-12)


def test_skip_freq_picks_full_layers():
    class C:
        window_size, window_attn_skip_freq = (7, 0), 3
    assert [layer_window(C, n) for n in range(1, 7)] == [7, 7, None, 7, 7, None]
    C.window_attn_skip_freq = None
    assert [layer_window(C, n) for n in range(1, 4)] == [7, 7, 7]
    C.window_size = None
    assert layer_window(C, 1) is None


def _attention_layer_vs_whole_mask(window, packed):
    """The layer's attention core through the windowed path against the reference on the
    layer's own Q, K, V (RoPE applied), for the windowed layer; the full layer (skip freq 2)
    against plain causal attention."""
    from megatron.core.models import llama_config
    from megatron.core.packed_seq_params import packed_seq_params_from_eod
    from megatron.core.transformer.attention import SelfAttention

    s, h = 48, 64
    b = 1 if packed else 2
    config = llama_config(num_layers=2, hidden_size=h, num_attention_heads=4,
                          num_query_groups=2, ffn_hidden_size=96, attention_dropout=0.0,
                          window_size=(window, 0), window_attn_skip_freq=2)
    torch.manual_seed(0)
    layer = SelfAttention(config, 1)
    params, documents = None, None
    if packed:
        tokens = torch.ones(1, s, dtype=torch.long)
        tokens[0, [10, 30]] = 0  # EODs: documents of 11, 20 and 17 tokens
        params = packed_seq_params_from_eod(tokens, 0)
        documents = [11, 20, 17]
    g = torch.Generator().manual_seed(1)
    q = torch.randn(b, s, 4, 16, generator=g, requires_grad=True)
    k = torch.randn(b, s, 2, 16, generator=g, requires_grad=True)
    v = torch.randn(b, s, 2, 16, generator=g, requires_grad=True)
    out = layer._core_attention(q, k, v, None, params)  # [s, b, heads * d]
    seed = torch.randn_like(out)
    out.backward(seed)
    ref_in = [t.detach().transpose(1, 2).clone().requires_grad_() for t in (q, k, v)]
    ref = _reference(*ref_in, window, documents).permute(2, 0, 1, 3).reshape(s, b, -1)
    ref.backward(seed)
    errors = [(out - ref).abs().max().item()]
    errors += [(a.grad - b.grad.transpose(1, 2)).abs().max().item()
               for a, b in zip((q, k, v), ref_in)]
    return layer.window, errors


@pytest.mark.parametrize("packed", [False, True], ids=["batch", "packed"])
@pytest.mark.parametrize("window", [5, 13])
def test_attention_layer_windows_equal_the_whole_mask(window, packed):
    (got_window, errors), = run_distributed(_attention_layer_vs_whole_mask, world_size=1,
                                            tp=1, window=window, packed=packed)
    assert got_window == window
    # fp32 against fp32, other summation orders (blocked SDPA vs one softmax): 1e-5
    assert max(errors) <= 1e-5, errors


@pytest.mark.parametrize("window_size,message", [
    ((4, 2), "only causal windows are supported"),
    ((-1, 0), "the left size must be >= 0")])
def test_bad_windows_are_refused(window_size, message):
    from megatron.core.models import llama_config

    with pytest.raises(ValueError, match=message):
        llama_config(num_layers=2, hidden_size=64, num_attention_heads=4,
                     window_size=window_size)


def test_the_training_logs_flops_count_each_layers_window():
    """pretrain's FLOP count (the MFU numerator) takes every layer's window: layers 1 and 3
    windowed (skip freq 2), 2 and 4 full, against the count with that list."""
    from megatron.training.arguments import build_configs, parse_args
    from megatron.training.logging.flops import num_floating_point_operations
    from megatron.training.pretrain import _flops
    from megatron.training.tokenizer.build import build_tokenizer_from_args
    from tests.e2e.runner import LLAMA, TINY

    args = parse_args(TINY + LLAMA + ["--window-size", "3,0", "--window-attn-skip-freq", "2"])
    configs = build_configs(args, 1, build_tokenizer_from_args(args))
    tc = configs.transformer
    common = (tc.num_layers, tc.hidden_size, tc.ffn_hidden_size, tc.num_attention_heads,
              tc.num_query_groups, args.seq_length, configs.model_kwargs["padded_vocab_size"],
              configs.training.global_batch_size, True, tc.kv_channels)
    want = num_floating_point_operations(*common, windows=[3, None, 3, None])
    assert _flops(configs, args) == want < num_floating_point_operations(*common)
