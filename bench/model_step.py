"""One training step (forward, backward, AdamW) of our LLaMA vs transformers.LlamaForCausalLM.

    python3 bench/model_step.py [--steps 6] [--threads 2] [--torch-compile] [--hf-compile]

Same config, same weights, fused AdamW for both (copied through hf_conversion), same batch, same process; the two
models run alternately so drift in machine load hits both. Prints tokens/s of each and the
ratio (ours / HF). ``--torch-compile`` runs ours as ``--torch-compile`` trains (the layers'
element-wise regions compiled); the peer stays HF eager, which is how transformers trains
unless asked; ``--hf-compile`` compiles the whole HF model too (torch.compile(model)), for a
compiled-vs-compiled figure. Default config: the CPU reference (4 layers, hidden 512, 8 heads,
4 query groups, ffn 1376, vocab 32000, seq 256, micro batch 4, fp32).
"""
import argparse
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir))

from megatron.core import device, parallel_state  # noqa: E402
from megatron.core.models import GPTModel  # noqa: E402
from megatron.core.models.hf_conversion import config_from_hf, hf_to_megatron  # noqa: E402


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--groups", type=int, default=4)
    p.add_argument("--ffn", type=int, default=1376)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--steps", type=int, default=6, help="timed steps per model")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    p.add_argument("--torch-compile", action="store_true",
                   help="ours with --torch-compile (compiled element-wise regions)")
    p.add_argument("--hf-compile", action="store_true",
                   help="torch.compile the whole HF model as well")
    return p.parse_args()


def build_models(args):
    import transformers

    hf_config = transformers.LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.ffn,
        num_hidden_layers=args.layers, num_attention_heads=args.heads,
        num_key_value_heads=args.groups, max_position_embeddings=args.seq,
        tie_word_embeddings=False)
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(hf_config).to(device.current_device())
    config, kwargs = config_from_hf(hf_config, torch_compile=args.torch_compile)
    ours = GPTModel(config, **kwargs)
    ours.load_state_dict(hf_to_megatron(hf.state_dict(), hf_config), strict=True)
    hf.train()
    return ours.train(), (torch.compile(hf) if args.hf_compile else hf)


def step_fns(args, ours, hf):
    dtype = torch.bfloat16 if args.dtype == "bf16" else None
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, args.vocab, (args.micro_batch, args.seq + 1), generator=g)
    tokens = tokens.to(device.current_device())
    inputs, labels = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    # Fused AdamW on both sides: what our optimizer builds where the device supports it, and
    # the default of transformers' Trainer on torch >= 2.8.
    opt_ours = torch.optim.AdamW(ours.parameters(), lr=1e-4, fused=True)
    opt_hf = torch.optim.AdamW(hf.parameters(), lr=1e-4, fused=True)

    def autocast():
        return torch.autocast(device.device_type(), dtype=dtype, enabled=dtype is not None)

    def ours_step():
        with autocast():
            loss = ours(inputs, labels=labels).mean()
        loss.backward()
        opt_ours.step()
        opt_ours.zero_grad(set_to_none=True)
        return loss.item()

    def hf_train_step():
        with autocast():
            logits = hf(input_ids=inputs).logits
            loss = torch.nn.functional.cross_entropy(
                logits.float().view(-1, logits.shape[-1]), labels.view(-1))
        loss.backward()
        opt_hf.step()
        opt_hf.zero_grad(set_to_none=True)
        return loss.item()

    return ours_step, hf_train_step


def main():
    args = parse_args()
    torch.set_num_threads(args.threads)
    store = dist.FileStore(tempfile.mktemp(), 1)
    dist.init_process_group(device.dist_backend(), store=store, rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1, 1)
    ours, hf = build_models(args)
    ours_step, hf_step = step_fns(args, ours, hf)
    first = (ours_step(), hf_step())
    print(f"first-step loss: ours {first[0]:.5f}  HF {first[1]:.5f}")
    for _ in range(args.warmup - 1):
        ours_step(), hf_step()
    times = {"ours": [], "hf": []}
    for _ in range(args.steps):
        for name, fn in (("ours", ours_step), ("hf", hf_step)):
            device.synchronize()
            start = time.perf_counter()
            fn()
            device.synchronize()
            times[name].append(time.perf_counter() - start)
    tokens = args.micro_batch * args.seq
    rate = {k: tokens / statistics.median(v) for k, v in times.items()}
    print(f"config: layers={args.layers} hidden={args.hidden} heads={args.heads} "
          f"groups={args.groups} ffn={args.ffn} vocab={args.vocab} seq={args.seq} "
          f"mbs={args.micro_batch} {args.dtype} threads={args.threads} "
          f"device={device.device_type()} ours {'--torch-compile' if args.torch_compile else 'eager'}, "
          f"HF {'torch.compile' if args.hf_compile else 'eager'}")
    for k in ("ours", "hf"):
        print(f"{k:>4}: median step {statistics.median(times[k]) * 1e3:8.1f} ms  "
              f"{rate[k]:9.1f} tokens/s")
    print(f"ratio ours/HF tokens/s: {rate['ours'] / rate['hf']:.3f}")
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
