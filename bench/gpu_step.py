"""One-GPU training step of a ~1.1B LLaMA: ours (pretrain_llama.py's path) vs transformers.

    python3 bench/gpu_step.py [--micro-batch-size 4] [--num-microbatches 1] [--steps 10]
        [--warmup 3] [--recompute-granularity selective|full] [--torch-compile]
        [--peak-tflops 989] [--profile]
    MEGATRON_DEVICE=cpu python3 bench/gpu_step.py --tiny      # end to end on CPU, fp32, seconds

The model (default): 22 layers, hidden 2048, FFN 5632, 32 heads, 4 query groups, vocabulary
32000, sequence 2048 (TinyLlama-1.1B's shape), bf16.

Ours goes through what ``pretrain_llama.py`` runs: Megatron flags -> ``parse_args`` /
``build_configs`` -> ``initialize_megatron`` (nccl on CUDA) -> ``build_model`` with
``model_provider_for(LlamaModel)`` (DDP gradient buffer) -> ``get_megatron_optimizer``
(``--bf16``: bf16 parameters, fp32 main parameters, gradients accumulated in fp32, fused
AdamW, clipping at 1.0) -> ``train_step`` with ``gpt_step.forward_step``.
HF is ``transformers.LlamaForCausalLM`` with fp32 parameters under bf16 autocast,
``torch.optim.AdamW(fused=True)`` and ``clip_grad_norm_(1.0)`` (what its Trainer does).
Our weights are HF's initial weights converted with ``hf_conversion.hf_to_megatron``, so both
start from the same model (``initial loss`` shows it); weight decay is 0 on both (the two
decay different parameter sets by default). Same batch, same process; the two step
alternately (warm-up steps first, untimed) so drift in the machine hits both.
``--recompute-granularity full`` also turns on HF's gradient checkpointing (HF has nothing
like ``selective``); ``--torch-compile`` passes Megatron's flag to ours (the compiled
element-wise path, CUDA's default in pretrain_llama.py) and wraps HF in ``torch.compile``;
without it both run eagerly (ours with ``--no-torch-compile``).

``--num-microbatches N`` makes one step N micro batches (gradient accumulation: ours through
the schedule with the DDP buffer, HF by N backward passes of loss / N) before one optimizer
step, so the optimizer's share of a step is what a real run pays.

Printed per model: median step time, tokens/s, achieved TFLOP/s, MFU (Megatron's FLOPs and
the causal count) and peak memory; then the ratio ours/HF of tokens/s. ``--profile`` then
profiles one more step of each model and prints where its device time goes (bench/profile.py).

MFU = F / (t * P): F = megatron.training.logging.flops.num_floating_point_operations for one micro
batch, Megatron's model FLOPs: 6 * B * s * (L * (h*(a*d + 2*g*d) + 2*s*a*d + a*d*h + 3*h*f)
+ h*V) (QKV with GQA, attention scores and values over the full s x s, output projection,
SwiGLU MLP, logits layer; forward plus twice that backward; no recomputation counted);
t = median step seconds; P = --peak-tflops * 1e12 (989: H100 SXM dense bf16; H200 is the
same chip's 989). Both models get the same F, so the MFU ratio equals the tokens/s ratio.
"causal MFU" counts only the s (s + 1) / 2 query-key pairs a causal kernel computes
(logging/flops.py, causal=True): the work actually done.

Peak memory = the device's peak allocated bytes during the model's own timed steps, less the
other model's resident state (parameters, gradients, optimizer state), which stays allocated
while it waits.
"""
import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir))

from megatron.core import device  # noqa: E402

TINY = dict(layers=2, hidden=64, ffn=176, heads=4, groups=2, vocab=256, seq=32,
            micro_batch_size=2)
FULL = dict(layers=22, hidden=2048, ffn=5632, heads=32, groups=4, vocab=32000, seq=2048,
            micro_batch_size=4)
LR = 1e-4


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tiny", action="store_true",
                   help="a tiny LLaMA in fp32 (runs on CPU in seconds); sizes still override")
    for name in ("layers", "hidden", "ffn", "heads", "groups", "vocab", "seq"):
        p.add_argument(f"--{name}", type=int, default=None, help=f"default {FULL[name]}")
    p.add_argument("--micro-batch-size", type=int, default=None,
                   help=f"sequences per micro batch (default {FULL['micro_batch_size']})")
    p.add_argument("--num-microbatches", type=int, default=1,
                   help="micro batches per optimizer step (gradient accumulation)")
    p.add_argument("--profile", action="store_true",
                   help="then profile one step of each model: top kernels and time by kind")
    p.add_argument("--dtype", choices=["bf16", "fp32"], default=None,
                   help="default bf16 (fp32 with --tiny)")
    p.add_argument("--recompute-granularity", choices=["selective", "full"], default=None)
    p.add_argument("--torch-compile", action="store_true")
    p.add_argument("--steps", type=int, default=10, help="timed steps per model")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps per model first")
    p.add_argument("--peak-tflops", type=float, default=989.0,
                   help="the device's dense peak for --dtype (989: H100 SXM bf16)")
    p.add_argument("--threads", type=int, default=None, help="CPU threads (CPU runs)")
    p.add_argument("--print-flags", action="store_true",
                   help="print pretrain_llama.py's flags for this model and exit")
    args = p.parse_args(argv)
    base = TINY if args.tiny else FULL
    for name, value in base.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.dtype is None:
        args.dtype = "fp32" if args.tiny else "bf16"
    if args.warmup < 1 or args.steps < 1 or args.num_microbatches < 1:
        p.error("--warmup, --steps and --num-microbatches must be >= 1 (the first step "
                "compiles and allocates)")
    if args.vocab % 128:
        p.error(f"--vocab {args.vocab}: use a multiple of 128, so our padded vocabulary is "
                f"HF's and the two models are the same")
    return args


def megatron_flags(args):
    """pretrain_llama.py's flags for this model: --num-microbatches per step, mock data."""
    flags = [
        "--num-layers", args.layers, "--hidden-size", args.hidden,
        "--ffn-hidden-size", args.ffn, "--num-attention-heads", args.heads,
        "--group-query-attention", "--num-query-groups", args.groups,
        "--seq-length", args.seq, "--max-position-embeddings", args.seq,
        "--normalization", "RMSNorm", "--norm-epsilon", "1e-5", "--swiglu",
        "--position-embedding-type", "rope", "--rotary-base", "10000",
        "--disable-bias-linear", "--untie-embeddings-and-output-weights",
        "--attention-dropout", "0", "--hidden-dropout", "0",
        "--micro-batch-size", args.micro_batch_size,
        "--global-batch-size", args.micro_batch_size * args.num_microbatches,
        "--train-iters", args.warmup + args.steps, "--lr", LR, "--lr-decay-style", "constant",
        "--weight-decay", "0", "--clip-grad", "1.0",
        "--mock-data", "--tokenizer-type", "NullTokenizer",
        # NullTokenizer adds the end-of-document id: N - 1 ids + 1 = N, a multiple of 128.
        "--vocab-size", args.vocab - 1, "--make-vocab-size-divisible-by", "128",
    ]
    if args.dtype == "bf16":
        flags.append("--bf16")  # fp32 main params, gradients accumulated in fp32
    if args.recompute_granularity:
        flags += ["--recompute-granularity", args.recompute_granularity]
        if args.recompute_granularity == "full":
            flags += ["--recompute-method", "uniform", "--recompute-num-layers", "1"]
    # Both explicit: the default follows the device (compiled on CUDA, eager on CPU).
    flags.append("--torch-compile" if args.torch_compile else "--no-torch-compile")
    return [str(f) for f in flags]


def build_configs(args):
    """The configs pretrain() builds from these flags (one process); exits on a bad flag."""
    from megatron.training.arguments import ConfigError, build_configs, parse_args
    from megatron.training.tokenizer.build import build_tokenizer_from_args

    try:
        margs = parse_args(megatron_flags(args))
        return margs, build_configs(margs, 1, build_tokenizer_from_args(margs))
    except (ConfigError, ValueError) as exc:
        sys.exit(f"error: {exc}")


def build_hf(args):
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.ffn,
        num_hidden_layers=args.layers, num_attention_heads=args.heads,
        num_key_value_heads=args.groups, max_position_embeddings=args.seq,
        rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False)
    torch.manual_seed(0)
    with torch.device(device.current_device()):  # initialised in place, not copied over
        model = transformers.LlamaForCausalLM(config)
    if args.recompute_granularity == "full":
        model.gradient_checkpointing_enable()
    return model.train(), config


def build_ours(args, margs, configs, hf, hf_config):
    """Model, optimizer and scheduler exactly as pretrain() makes them, with HF's weights."""
    from megatron.core.models import LlamaModel
    from megatron.core.models.hf_conversion import hf_to_megatron
    from megatron.core.optimizer import OptimizerParamScheduler, get_megatron_optimizer
    from megatron.core.pipeline_parallel.model_chunks import unwrap_model
    from megatron.training.gpt_step import model_provider_for
    from megatron.training.pretrain import _with_configs
    from megatron.training.training import build_model

    provider = _with_configs(model_provider_for(LlamaModel), configs)
    model = build_model(provider, configs.transformer, configs.ddp, configs.training.seed)
    state = hf_to_megatron(hf.state_dict(), hf_config, configs.model_kwargs["padded_vocab_size"])
    with torch.no_grad():  # before the optimizer copies the weights into its main params
        unwrap_model(model[0]).load_state_dict(state, strict=True)
    del state
    optimizer = get_megatron_optimizer(configs.optimizer, model)
    configs.transformer.grad_scale_func = optimizer.scale_loss
    scheduler = OptimizerParamScheduler(optimizer, **configs.scheduler_kwargs)
    return model, optimizer, scheduler


def step_functions(args, margs, configs, model, optimizer, scheduler, hf):
    from megatron.training.gpt_step import forward_step
    from megatron.training.pretrain import _with_configs
    from megatron.training.training import train_step

    g = torch.Generator().manual_seed(1)
    text = torch.randint(0, args.vocab - 1, (args.micro_batch_size, args.seq + 1), generator=g)
    forward = _with_configs(forward_step, configs)

    def batches():  # the data loader's format: the same micro batch every step
        while True:
            yield {"text": text}

    data = batches()

    def ours():
        losses, skipped, _, _ = train_step(forward, data, model, optimizer, scheduler,
                                           args.num_microbatches, args.seq,
                                           args.micro_batch_size)
        assert not skipped, "our optimizer skipped a step"
        return losses["lm loss"]

    if args.torch_compile:
        hf_forward = torch.compile(hf)
    else:
        hf_forward = hf
    hf_opt = torch.optim.AdamW(hf.parameters(), lr=LR, weight_decay=0.0, fused=True)
    on_device = text.to(device.current_device())
    inputs, labels = on_device[:, :-1].contiguous(), on_device[:, 1:].contiguous()
    dtype = torch.bfloat16 if args.dtype == "bf16" else None

    def theirs():
        total = 0.0
        for _ in range(args.num_microbatches):  # gradient accumulation, as HF's Trainer
            with torch.autocast(device.device_type(), dtype=dtype, enabled=dtype is not None):
                logits = hf_forward(input_ids=inputs).logits
            loss = torch.nn.functional.cross_entropy(
                logits.float().view(-1, logits.shape[-1]), labels.view(-1))
            (loss / args.num_microbatches).backward()
            total = total + loss.detach()
        torch.nn.utils.clip_grad_norm_(hf.parameters(), 1.0)
        hf_opt.step()
        hf_opt.zero_grad(set_to_none=True)
        return (total / args.num_microbatches).item()

    return ours, theirs, hf_opt


def _tensor_bytes(tensors):
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


def _hf_resident_bytes(hf, hf_opt):
    """HF's parameters, optimizer state and any gradients (None between its steps)."""
    state = [v for s in hf_opt.state.values() for v in s.values()]
    return _tensor_bytes(list(hf.parameters()) + state +
                         [p.grad for p in hf.parameters() if p.grad is not None])


def run(args):
    from megatron.training.logging.flops import mfu, num_floating_point_operations
    from megatron.training.initialize import initialize_megatron

    margs, configs = build_configs(args)
    t = configs.training
    initialize_megatron(1, 1, None, t.seed, t.device)
    hf, hf_config = build_hf(args)
    model, optimizer, scheduler = build_ours(args, margs, configs, hf, hf_config)
    ours, theirs, hf_opt = step_functions(args, margs, configs, model, optimizer, scheduler, hf)
    steps = {"ours": ours, "HF": theirs}

    times = {k: [] for k in steps}
    peaks = {k: 0 for k in steps}
    first = {}
    for i in range(args.warmup + args.steps):
        for name, fn in steps.items():
            device.synchronize()
            device.reset_max_memory_allocated()
            before = device.memory_allocated()  # None on CPU: no allocator statistics
            start = time.perf_counter()
            loss = fn()
            device.synchronize()
            elapsed = time.perf_counter() - start
            first.setdefault(name, loss)
            if i < args.warmup:
                continue
            times[name].append(elapsed)
            if before is not None:
                hf_resident = _hf_resident_bytes(hf, hf_opt)
                # The other model's resident state was allocated throughout; take it off.
                other = hf_resident if name == "ours" else before - hf_resident
                peaks[name] = max(peaks[name], device.max_memory_allocated() - other)

    sequences = args.micro_batch_size * args.num_microbatches
    shape = (args.layers, args.hidden, args.ffn, args.heads, args.groups, args.seq,
             configs.model_kwargs["padded_vocab_size"], sequences)
    flops = num_floating_point_operations(*shape, swiglu=True)
    causal_flops = num_floating_point_operations(*shape, swiglu=True, causal=True)
    tokens = sequences * args.seq
    print(f"config: layers={args.layers} hidden={args.hidden} ffn={args.ffn} heads={args.heads}"
          f" groups={args.groups} vocab={args.vocab} seq={args.seq} "
          f"micro_batch={args.micro_batch_size} microbatches={args.num_microbatches} "
          f"dtype={args.dtype} "
          f"recompute={args.recompute_granularity or 'none'} "
          f"torch_compile={args.torch_compile} device={device.device_type()} "
          f"steps={args.steps} warmup={args.warmup}")
    print(f"initial loss: ours {first['ours']:.8f} HF {first['HF']:.8f} "
          f"diff {abs(first['ours'] - first['HF']):.3e}")
    print(f"model FLOPs per step: {flops:.6e} (megatron.training.logging.flops, peak "
          f"{args.peak_tflops:g} TFLOP/s); causal: {causal_flops:.6e}")
    rate = {}
    for name in steps:
        median = statistics.median(times[name])
        rate[name] = tokens / median
        memory = "n/a" if device.memory_allocated() is None else \
            f"{peaks[name] / 2**30:.2f} GiB"
        print(f"{name:>4}: median step {median * 1e3:10.2f} ms | tokens/s {rate[name]:12.1f} | "
              f"TFLOP/s {flops / median / 1e12:9.4f} | "
              f"MFU {100 * mfu(flops, median, 1, args.peak_tflops):8.4f} % | "
              f"causal MFU {100 * mfu(causal_flops, median, 1, args.peak_tflops):8.4f} % | "
              f"peak memory {memory}")
    print(f"ratio ours/HF tokens/s: {rate['ours'] / rate['HF']:.4f}")
    if args.profile:
        from bench.kernel_profile import profile_step

        for name, fn in steps.items():
            try:  # the figures above are printed: a profiler failure must not hide them
                print(profile_step(fn, f"{name} ({args.num_microbatches} micro batches)"))
            except Exception as exc:
                print(f"profile of {name} failed: {type(exc).__name__}: {exc}")
    return first, rate


def main(argv=None):
    args = parse_args(argv)
    if args.print_flags:  # shtools/gpu_run.sh runs pretrain_llama.py with the same model
        print(" ".join(megatron_flags(args)))
        return
    run_once(run, args)


def run_once(fn, args):
    """``fn(args)`` in this process's one Megatron world, torn down after it."""
    if args.threads:
        torch.set_num_threads(args.threads)
    fn(args)
    import torch.distributed as dist
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
