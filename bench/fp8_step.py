"""One-GPU training step of the ~1.1B LLaMA of bench/gpu_step.py in each FP8 recipe against
the same model in bf16 (CUDA's default path: compiled element-wise regions), ours only.

    python3 bench/fp8_step.py [--recipes tensorwise,rowwise,blockwise] [--fp8-format e4m3]
        [--num-microbatches 4] [--steps 10] [--warmup 3] [--peak-tflops 989]
        [--fp8-peak-tflops 1979] [--profile]
    MEGATRON_DEVICE=cpu python3 bench/fp8_step.py --tiny     # end to end on CPU, seconds

Each variant is built as pretrain_llama.py builds it (gpu_step.build_ours, from HF's initial
weights: the same model for every variant), warmed up, timed over ``--steps`` steps (median),
then freed before the next: a 1.1B model with its Adam state takes ~20 GB, so the variants
run one after another, bf16 first and again last (its two medians bound the machine's drift
over the run). Printed per variant: median step, tokens/s, MFU against the bf16 peak and
against the FP8 peak (1979 TFLOP/s dense on an H100 SXM: Megatron's FLOP count is the same
work; FP8 only runs the linears' GEMMs faster), peak memory, the ratio to bf16's tokens/s, and
the first step's loss (FP8 against bf16: the same model, the same batch). ``--profile``: one
more step of each FP8 variant profiled (top kernels, time by kind: bench/kernel_profile.py).
"""
import argparse
import gc
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir))

import gpu_step  # noqa: E402  (bench/ is on sys.path when run as a script)

from megatron.core import device  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--recipes", default="tensorwise,rowwise,blockwise")
    p.add_argument("--fp8-format", choices=["e4m3", "hybrid"], default="e4m3",
                   help="hybrid applies to tensorwise and rowwise (blockwise is e4m3 only)")
    p.add_argument("--fp8-peak-tflops", type=float, default=1979.0,
                   help="the device's dense FP8 peak (1979: H100 SXM)")
    own, rest = p.parse_known_args(argv)
    args = gpu_step.parse_args(rest)
    for name, value in vars(own).items():
        setattr(args, name, value)
    if not args.tiny:
        args.torch_compile = True  # CUDA's default path: the baseline FP8 must beat
    return args


def _variant_flags(args, recipe):
    if recipe is None:
        return []
    fmt = "e4m3" if recipe == "blockwise" else args.fp8_format
    return ["--fp8-format", fmt, "--fp8-recipe", recipe]


def _time_variant(args, hf, hf_config, recipe):
    from megatron.training.arguments import build_configs, parse_args
    from megatron.training.tokenizer.build import build_tokenizer_from_args

    margs = parse_args(gpu_step.megatron_flags(args) + _variant_flags(args, recipe))
    configs = build_configs(margs, 1, build_tokenizer_from_args(margs))
    model, optimizer, scheduler = gpu_step.build_ours(args, margs, configs, hf, hf_config)
    ours, _, _ = gpu_step.step_functions(args, margs, configs, model, optimizer, scheduler, hf)
    times, first = [], None
    device.synchronize()
    device.reset_max_memory_allocated()
    before = device.memory_allocated()
    for i in range(args.warmup + args.steps):
        device.synchronize()
        start = time.perf_counter()
        loss = ours()
        device.synchronize()
        first = loss if first is None else first
        if i >= args.warmup:
            times.append(time.perf_counter() - start)
    peak = None if before is None else device.max_memory_allocated() - before
    if args.profile and recipe is not None:  # where an FP8 step's time goes (bf16's: gpu_step)
        from bench.kernel_profile import profile_step

        try:  # a profiler failure must not cost the variants still to come
            print(profile_step(ours, f"{recipe} ({args.num_microbatches} micro batches)"))
        except Exception as exc:
            print(f"profile of {recipe} failed: {type(exc).__name__}: {exc}")
    del model, optimizer, scheduler, ours
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return statistics.median(times), min(times), max(times), first, peak


def run(args):
    from megatron.training.initialize import initialize_megatron
    from megatron.training.logging.flops import mfu, num_floating_point_operations

    margs, configs = gpu_step.build_configs(args)
    t = configs.training
    initialize_megatron(1, 1, None, t.seed, t.device)
    hf, hf_config = gpu_step.build_hf(args)
    hf.to("cpu")  # only its initial weights are needed: keep the device for ours
    variants = [None] + [r for r in args.recipes.split(",") if r] + [None]
    results = []
    for recipe in variants:
        results.append((recipe, *_time_variant(args, hf, hf_config, recipe)))
        # As it goes: a later variant that fails (or a run cut short) keeps this one's figure.
        median, peak = results[-1][1], results[-1][5]
        print(f"measured {recipe or args.dtype}: median step {median * 1e3:.2f} ms, peak "
              f"memory {'n/a' if peak is None else f'{peak / 2**30:.2f} GiB'}", flush=True)
    sequences = args.micro_batch_size * args.num_microbatches
    shape = (args.layers, args.hidden, args.ffn, args.heads, args.groups, args.seq,
             configs.model_kwargs["padded_vocab_size"], sequences)
    flops = num_floating_point_operations(*shape, swiglu=True)
    tokens = sequences * args.seq
    print(f"config: layers={args.layers} hidden={args.hidden} ffn={args.ffn} "
          f"heads={args.heads} groups={args.groups} vocab={args.vocab} seq={args.seq} "
          f"micro_batch={args.micro_batch_size} microbatches={args.num_microbatches} "
          f"dtype={args.dtype} torch_compile={args.torch_compile} "
          f"device={device.device_type()} steps={args.steps} warmup={args.warmup} "
          f"fp8_format={args.fp8_format}")
    base = [median for recipe, median, *_ in results if recipe is None]
    print(f"{args.dtype} baseline medians, first and last: {base[0] * 1e3:.2f} / {base[1] * 1e3:.2f} ms "
          f"(drift over the run {abs(base[1] - base[0]) / base[0] * 100:.2f} %)")
    reference = statistics.mean(base)
    first_bf16 = results[0][4]
    for i, (recipe, median, low, high, first, peak) in enumerate(results):
        name = recipe or f"{args.dtype} {'first' if i == 0 else 'last'}"
        memory = "n/a" if peak is None else f"{peak / 2**30:.2f} GiB"
        print(f"{name:>11}: median step {median * 1e3:9.2f} ms (min {low * 1e3:.2f}, max "
              f"{high * 1e3:.2f}) | tokens/s {tokens / median:10.1f} | MFU "
              f"{100 * mfu(flops, median, 1, args.peak_tflops):6.2f} % of bf16 peak, "
              f"{100 * mfu(flops, median, 1, args.fp8_peak_tflops):6.2f} % of FP8 peak | "
              f"peak memory {memory} | vs {args.dtype} {reference / median:.4f}x | first loss "
              f"{first:.6f} ({args.dtype} {first_bf16:.6f})")


def main(argv=None):
    gpu_step.run_once(run, parse_args(argv))


if __name__ == "__main__":
    main()
