"""bench/moe.py's model part: one training step (forward, backward, AdamW) of a small Mixtral,
our GPTModel at EP=1 (grouped GEMM experts) vs transformers' MixtralForCausalLM, same weights
(hf_conversion), same batch, same process (one gloo rank, EP=1). transformers 5.x builds
MixtralForCausalLM with its "grouped_mm" experts (torch._grouped_mm, the kernel ours runs);
a copy set to "eager" (its Python loop over experts) is timed beside it. The first step's
losses and gradients are compared before anything is timed; then the three alternate per
repeat, as in bench/moe.py.
"""
import tempfile

import torch
import torch.distributed as dist
import torch.nn.functional as F

from bench.moe_common import alternate, max_diff, print_summary
from megatron.core import parallel_state
from megatron.core.models import GPTModel
from megatron.core.models import hf_moe_conversion as moe_hf
from megatron.core.models.hf_conversion import config_from_hf, hf_to_megatron, megatron_to_hf


def mixtral_pair(args):
    import transformers

    hf_config = transformers.MixtralConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.ffn,
        num_hidden_layers=args.layers, num_attention_heads=4, num_key_value_heads=2,
        num_local_experts=args.experts, num_experts_per_tok=args.topk,
        max_position_embeddings=args.seq, tie_word_embeddings=False)
    torch.manual_seed(0)
    hf = transformers.MixtralForCausalLM(hf_config)
    config, kwargs = config_from_hf(hf_config)
    config.moe.moe_grouped_gemm = True
    config.moe.moe_aux_loss_coeff = 0.0  # HF's loss has no aux loss unless asked
    ours = GPTModel(config, padded_vocab_size=args.vocab, **kwargs)
    ours.load_state_dict(hf_to_megatron(hf.state_dict(), hf_config), strict=True)
    return ours.train(), hf.train()


def hf_eager_copy(hf):
    """The same HF model with its experts run by the Python loop ("eager"), not grouped_mm."""
    import copy

    eager = copy.deepcopy(hf)
    eager.set_experts_implementation("eager")
    return eager.train()


def batch(args):
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, args.vocab, (args.micro_batch, args.seq + 1), generator=g)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def ours_loss(model, inputs, labels):
    return model(inputs, labels=labels).mean()


def hf_loss(model, inputs, labels):
    logits = model(input_ids=inputs).logits
    return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), labels.view(-1))


def model_check(args, ours, hf):
    """|loss difference| and the largest |gradient difference| over HF's parameters of one
    backward, each relative to the reference's largest magnitude."""
    inputs, labels = batch(args)
    a, b = ours_loss(ours, inputs, labels), hf_loss(hf, inputs, labels)
    a.backward()
    b.backward()
    grads = megatron_to_hf({n: p.grad for n, p in ours.named_parameters()}, hf.config,
                           expert_layout=moe_hf.STACKED)  # HF's [E, ...] parameters
    worst = max(max_diff(grads[n], p.grad) for n, p in hf.named_parameters())
    ours.zero_grad(set_to_none=True)
    hf.zero_grad(set_to_none=True)
    return {"loss": abs(a.item() - b.item()) / abs(b.item()), "largest grad": worst}


def step_fn(model, loss_fn, inputs, labels):
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)

    def step():
        loss_fn(model, inputs, labels).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return step


def bench_model(args):
    store = dist.FileStore(tempfile.mktemp(), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1, 1)
    try:
        ours, hf = mixtral_pair(args)
        print("Mixtral step, ours vs HF, largest relative |difference|:",
              model_check(args, ours, hf))
        inputs, labels = batch(args)
        eager = hf_eager_copy(hf)
        variants = {"ours GPTModel (EP=1)": step_fn(ours, ours_loss, inputs, labels),
                    "HF MixtralForCausalLM": step_fn(hf, hf_loss, inputs, labels),
                    "HF, eager experts (loop)": step_fn(eager, hf_loss, inputs, labels)}
        times = alternate(variants, args.repeats, args.warmup)
        return print_summary(
            f"Mixtral training step ({args.layers} layers, vocab {args.vocab}, seq {args.seq}, "
            f"micro batch {args.micro_batch}), forward + backward + AdamW", times,
            ["HF MixtralForCausalLM", "HF, eager experts (loop)"], "ours GPTModel (EP=1)")
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()
