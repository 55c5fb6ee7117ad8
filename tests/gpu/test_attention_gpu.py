"""Attention on CUDA: the default path runs flash attention in bf16; each kernel
``sdpa_kernel_for`` predicts is the one torch can run for our call; packed documents run
torch's variable-length flash kernel, equal to one SDPA per document, at a sequence length where
an s x s tensor would dwarf the measured peak."""
import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from tests.gpu.harness import run_on_gpu

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

_BACKENDS = {"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
             "math": SDPBackend.MATH}


def _attention(dtype, heads=8, groups=4, head_dim=128):
    from megatron.core.models import llama_config
    from megatron.core.transformer.attention import SelfAttention

    config = llama_config(num_layers=1, hidden_size=heads * head_dim, num_attention_heads=heads,
                          num_query_groups=groups, ffn_hidden_size=64, attention_dropout=0.0,
                          hidden_dropout=0.0, params_dtype=dtype)
    return SelfAttention(config, 1).to(dtype)


def _relative(got, want) -> float:
    """The largest difference over the reference's largest magnitude."""
    return ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()


def _default_path_is_flash():
    """Flash in bf16 against the same weights and input in fp32 through the math kernel:
    (relative output difference, relative input-gradient difference)."""
    import copy

    from megatron.core import device

    attention = _attention(torch.bfloat16)
    hidden = torch.randn(512, 2, 1024, device=device.current_device(), dtype=torch.bfloat16,
                         requires_grad=True)
    reference = copy.deepcopy(attention).float()
    # Flash only: raises "No available kernel" if our call cannot run it.
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
        out, _ = attention(hidden)
        out.float().sum().backward()
    hidden32 = hidden.detach().float().requires_grad_()
    with sdpa_kernel([SDPBackend.MATH]):
        want, _ = reference(hidden32)
        want.sum().backward()
    return _relative(out, want), _relative(hidden.grad, hidden32.grad)


# bf16 against fp32: inputs, weights, QKV, scores and products each rounded to 8 bits
# (3.9e-3 relative per rounding), a few roundings deep: 2e-2 of the largest value.
BF16_RELATIVE_TOL = 2e-2


def test_default_attention_runs_flash_in_bf16(gpu_env):
    ((out_diff, grad_diff),) = run_on_gpu(_default_path_is_flash, world_size=1,
                                          backend="nccl", tp=1)
    assert out_diff <= BF16_RELATIVE_TOL and grad_diff <= BF16_RELATIVE_TOL, (out_diff,
                                                                              grad_diff)


CASES = [  # dtype, head dim, query groups (of 8 heads), explicit mask
    (torch.bfloat16, 128, 4, False), (torch.bfloat16, 128, 8, True),
    (torch.bfloat16, 128, 4, True), (torch.float32, 64, 4, False),
    (torch.float32, 64, 8, False), (torch.bfloat16, 320, 4, False),
    (torch.float32, 30, 8, False),
]


def _predicted_kernel_runs():
    from megatron.core import device
    from megatron.core.transformer.attention import sdpa_kernel_for

    results = []
    for dtype, d, groups, with_mask in CASES:
        attention = _attention(dtype, 8, groups, d)
        kernel, _ = sdpa_kernel_for("cuda", dtype, d, groups != 8, with_mask, False)
        dev, s = device.current_device(), 256
        q = torch.randn(2, 8, s, d, device=dev, dtype=dtype)
        k, v = (torch.randn(2, groups, s, d, device=dev, dtype=dtype) for _ in range(2))
        mask = torch.ones(s, s, device=dev, dtype=torch.bool).triu(1) if with_mask else None

        def runs(backend):
            try:
                with sdpa_kernel([backend]):
                    attention._sdpa(q, k, v, mask, 0.0)
                return True
            except RuntimeError:
                return False
        fused = {name: runs(_BACKENDS[name]) for name in ("flash", "efficient")}
        if kernel == "math":  # predicted math: really no fused kernel takes our call
            results.append((dtype, d, groups, with_mask, kernel, not any(fused.values())))
        else:
            results.append((dtype, d, groups, with_mask, kernel, fused[kernel]))
    return results


def test_predicted_kernel_is_one_torch_runs(gpu_env):
    (results,) = run_on_gpu(_predicted_kernel_runs, world_size=1, backend="nccl", tp=1)
    for *case, ok in results:
        assert ok, case


def _packed(seq_length, docs):
    from megatron.core import device
    from megatron.core.packed_seq_params import packed_seq_params_from_eod
    import megatron.core.transformer.attention as attention_module

    dev = device.current_device()
    attention = _attention(torch.bfloat16)
    tokens = torch.ones(1, seq_length, dtype=torch.long, device=dev)
    tokens[0, torch.linspace(0, seq_length - 1, docs).long()] = 0  # EODs
    packed = packed_seq_params_from_eod(tokens, 0)
    g = torch.Generator(device=dev).manual_seed(0)
    hidden = torch.randn(seq_length, 1, 1024, device=dev, dtype=torch.bfloat16, generator=g,
                         requires_grad=True)
    device.synchronize()
    device.reset_max_memory_allocated()
    out, _ = attention(hidden, packed_seq_params=packed)
    out.float().sum().backward()
    device.synchronize()
    peak = device.max_memory_allocated()  # everything alive, the weights and input included
    varlen_out, varlen_grad = out.detach().float(), hidden.grad.float()
    # The same through one SDPA (flash) per document.
    hidden.grad = None
    saved, attention_module._varlen_attn = attention_module._varlen_attn, None
    try:
        out, _ = attention(hidden, packed_seq_params=packed)
        out.float().sum().backward()
    finally:
        attention_module._varlen_attn = saved
    return (saved is not None, peak, _relative(varlen_out, out.detach()),
            _relative(varlen_grad, hidden.grad))


def test_packed_documents_run_varlen_flash_without_s_by_s(gpu_env):
    s = 65536
    (has_varlen, peak, out_diff, grad_diff), = run_on_gpu(_packed, world_size=1,
                                                           backend="nccl", tp=1, seq_length=s,
                                                           docs=24)
    # One bf16 s x s matrix is 8 GiB here (the math kernel keeps one per head, 64 GiB); the
    # packed step's activations are O(s): about 1.5-2 GiB, under half of one s x s matrix.
    assert peak < s * s * 2 / 2, peak
    assert has_varlen, "torch.nn.attention.varlen is missing (torch >= 2.11 has it)"
    # bf16: two flash kernels with other tilings round their sums differently (a few
    # 3.9e-3 roundings): within BF16_RELATIVE_TOL of the largest value, both ways.
    assert out_diff <= BF16_RELATIVE_TOL and grad_diff <= BF16_RELATIVE_TOL, (out_diff,
                                                                              grad_diff)


def _compiled_layout_on_each_kernel():
    """The compiled head layout ([s, b] memory Q, K, V) against the eager layout, same weights,
    input and output gradient, through each fused kernel torch has on this GPU: (kernel, ran,
    output and input-gradient differences, whether the output projection's input was
    contiguous, the strided copies in the eager and compiled attention's forward and backward,
    the shapes of the compiled one's copies)."""
    import copy

    from torch.profiler import ProfilerActivity, profile

    from megatron.core import device
    from megatron.core.compiled import compiled as compile_fn
    from megatron.core.transformer.attention import _heads_for_sdpa

    dev = device.current_device()
    eager = _attention(torch.bfloat16)
    compiled = copy.deepcopy(eager)
    compiled.heads_for_sdpa = compile_fn(_heads_for_sdpa)
    contiguous = []
    compiled.linear_proj.register_forward_pre_hook(
        lambda _, args: contiguous.append(args[0].is_contiguous()))
    g = torch.Generator(device=dev).manual_seed(0)
    hidden = torch.randn(1024, 2, 1024, device=dev, dtype=torch.bfloat16, generator=g)
    # A real gradient: a sum's is a stride-0 expansion, which the GEMMs copy first.
    seed = torch.randn(1024, 2, 1024, device=dev, dtype=torch.bfloat16, generator=g)
    backends = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
                "efficient": SDPBackend.EFFICIENT_ATTENTION}
    results = []
    for name, backend in backends.items():
        outs = []
        for module in (eager, compiled):
            x = hidden.detach().clone().requires_grad_()
            try:
                with sdpa_kernel([backend]):
                    out, _ = module(x)  # warm-up (compilation) outside the profile
                    out.backward(seed)
                    x.grad = None
                    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA],
                                 record_shapes=True) as prof:
                        out, _ = module(x)
                        out.backward(seed)
                        device.synchronize()
            except RuntimeError as e:  # this kernel cannot take the call on this GPU
                outs = str(e).splitlines()[0]
                break
            copies = sum(e.count for e in prof.key_averages()
                         if "direct_copy_kernel" in e.key)
            shapes = [e.input_shapes[:2] for e in prof.events() if e.name == "aten::copy_"]
            outs.append((out.detach(), x.grad, copies, shapes))
        if isinstance(outs, str):
            results.append((name, False, outs))
            continue
        (want, want_grad, eager_copies, _), (got, got_grad, copies, shapes) = outs
        results.append((name, True, _relative(got, want), _relative(got_grad, want_grad),
                        contiguous[-1], eager_copies, copies, shapes))
    return results


def test_compiled_head_layout_copies_less_on_every_kernel(gpu_env):
    (results,) = run_on_gpu(_compiled_layout_on_each_kernel, world_size=1, backend="nccl",
                            tp=1)
    for result in results:
        print(*result)  # the copies' shapes: shown with pytest -rA
    ran = [r for r in results if r[1]]
    assert any(r[0] in ("cudnn", "flash") for r in ran), results
    for name, _, out_diff, grad_diff, contiguous, eager_copies, copies, _ in ran:
        # Same arithmetic, other layout: kernels may tile differently by stride (bf16).
        assert out_diff <= BF16_RELATIVE_TOL and grad_diff <= BF16_RELATIVE_TOL, results
        assert contiguous, f"{name}: the output projection's input is a strided copy"
        # The eager layout copies Q, the RoPE casts, the output and the gradients; the
        # compiled one's RoPE and split are one Triton pass each way (first H100 run: 5
        # copies against 10 under cuDNN, with a sum's stride-0 gradient).
        assert copies < eager_copies, results


def _windowed_on_cuda(window, packed):
    """A windowed layer on CUDA in bf16 (torch's varlen flash kernel with its window_size)
    against the blocked path of sliding_window.py on the same Q, K, V (what CPU runs)."""
    from megatron.core import device
    from megatron.core.models import llama_config
    from megatron.core.packed_seq_params import packed_seq_params_from_eod
    from megatron.core.transformer.attention import SelfAttention
    from megatron.core.transformer.sliding_window import blocked_window_attention

    dev = device.current_device()
    s = 1024
    config = llama_config(num_layers=1, hidden_size=1024, num_attention_heads=8,
                          num_query_groups=4, ffn_hidden_size=64, attention_dropout=0.0,
                          params_dtype=torch.bfloat16, window_size=(window, 0))
    layer = SelfAttention(config, 1).to(torch.bfloat16)
    b = 1 if packed else 2
    params, docs = None, [s]
    if packed:
        tokens = torch.ones(1, s, dtype=torch.long, device=dev)
        tokens[0, [300, 700]] = 0
        params = packed_seq_params_from_eod(tokens, 0)
        docs = [301, 400, 323]
    g = torch.Generator(device=dev).manual_seed(0)
    q, k, v = (torch.randn(b, s, n, 128, device=dev, dtype=torch.bfloat16, generator=g)
               for n in (8, 4, 4))
    got = layer._core_attention(q, k, v, None, params).float()  # [s, b, 8 * 128]
    parts, start = [], 0
    for n in docs:  # the reference: blocked, in fp32, per document
        piece = [t[:, start:start + n].transpose(1, 2).float() for t in (q, k, v)]
        parts.append(blocked_window_attention(*piece, window, enable_gqa=True))
        start += n
    want = torch.cat(parts, dim=2).permute(2, 0, 1, 3).reshape(s, b, -1)
    return _relative(got, want), layer._varlen_applies(q, 0.0)


@pytest.mark.parametrize("packed", [False, True], ids=["batch", "packed"])
def test_sliding_window_runs_flash_on_cuda(gpu_env, packed):
    (err, flash), = run_on_gpu(_windowed_on_cuda, world_size=1, backend="nccl", tp=1,
                               window=127, packed=packed)
    assert flash, "the windowed path did not take torch's varlen flash kernel"
    # bf16 against the fp32 blocked reference: BF16_RELATIVE_TOL, as the other kernels.
    assert err <= BF16_RELATIVE_TOL, err
