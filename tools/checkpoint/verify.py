"""Check that a Megatron checkpoint computes what a Hugging Face model computes.

    torchrun --nproc-per-node N tools/checkpoint/verify.py --hf-dir HF_DIR --load MEGATRON_DIR \
        [--ckpt-step N] [--tensor-model-parallel-size T --pipeline-model-parallel-size P \
         --num-layers-per-virtual-pipeline-stage V] [--prompt TEXT | --token-ids 1,2,3] \
        [--tokenizer DIR] [--tolerance 1e-4]

Our model is built from the checkpoint's saved args at the checkpoint's own parallel layout
(or the one the flags give; N must be a multiple of T x P) and its weights are loaded; the HF
model is loaded with ``AutoModelForCausalLM.from_pretrained`` on rank 0. Both run in fp32 on
the same token ids. Prints the max |logit difference|, the mean KL(HF || ours) per token and
how often the two agree on the next token; exits 1 if the max difference exceeds
--tolerance, 2 on a usage error. The prompt is tokenized with --tokenizer (default: the HF
directory's tokenizer); a model saved without one needs --token-ids.
"""
import argparse
import os
import sys

# Run from a clone without installing, as Megatron's tools allow.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, os.pardir))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from megatron.training.arguments import ConfigError  # noqa: E402
from megatron.training.checkpointing import CheckpointError  # noqa: E402
from megatron.training.guards import errors  # noqa: E402

DEFAULT_PROMPT = "The quick brown fox jumps over the lazy dog. Megatron checks its logits"
# Fields of our TransformerConfig compared with the one the HF config implies (a difference
# is reported, not fatal: the logits decide).
_CONFIG_FIELDS = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads",
                  "num_query_groups", "kv_channels", "normalization", "layernorm_epsilon",
                  "activation", "add_bias_linear", "position_embedding_type",
                  "max_position_embeddings")
_ROPE_FIELDS = ("rotary_base", "rope_scaling_factor", "rope_low_freq_factor",
                "rope_high_freq_factor", "rope_original_max_position_embeddings")
_YARN_FIELDS = ("rotary_scaling_factor", "original_max_position_embeddings", "beta_fast",
                "beta_slow", "mscale", "mscale_all_dim", "yarn_truncate", "yarn_attention_factor")
_LATENT_ATTENTION_FIELDS = ("multi_latent_attention", "q_lora_rank", "kv_lora_rank",
                            "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim",
                            "rotary_interleaved", "qk_layernorm")


def get_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument("--hf-dir", required=True, help="A save_pretrained() directory.")
    p.add_argument("--load", required=True, help="The Megatron checkpoint directory.")
    p.add_argument("--ckpt-step", type=int, default=None,
                   help="Iteration to load (default: the tracker's, e.g. 'release').")
    p.add_argument("--tensor-model-parallel-size", type=int, default=None)
    p.add_argument("--pipeline-model-parallel-size", type=int, default=None)
    p.add_argument("--num-layers-per-virtual-pipeline-stage", type=int, default=None)
    p.add_argument("--num-virtual-stages-per-pipeline-rank", type=int, default=None)
    p.add_argument("--expert-model-parallel-size", type=int, default=None,
                   help="MoE models: experts over this many ranks (default: the checkpoint's).")
    p.add_argument("--expert-tensor-parallel-size", type=int, default=None,
                   help="MoE models: each expert over this many ranks (default: TP).")
    text = p.add_mutually_exclusive_group()
    text.add_argument("--prompt", default=None, help=f"Default: {DEFAULT_PROMPT!r}.")
    text.add_argument("--token-ids", default=None, help="Comma-separated ids, e.g. 1,2,3.")
    p.add_argument("--tokenizer", default=None,
                   help="A HF tokenizer directory for --prompt (default: --hf-dir).")
    p.add_argument("--tolerance", type=float, default=1e-4,
                   help="Largest |logit difference| accepted (default 1e-4, for fp32).")
    p.add_argument("--hf-device", default="cpu", help="Where the HF model runs (cpu, cuda).")
    p.add_argument("--timeout-minutes", type=float, default=30.0,
                   help="How long ranks wait for each other (rank 0 loads the HF model).")
    return p


def _layout_overrides(args) -> dict:
    names = ("tensor_model_parallel_size", "pipeline_model_parallel_size",
             "num_layers_per_virtual_pipeline_stage", "num_virtual_stages_per_pipeline_rank")
    return {n: getattr(args, n) for n in names if getattr(args, n) is not None}


def _moe_overrides(args, saved: dict, saved_layout: dict) -> dict:
    """An MoE checkpoint's expert flags (the model is otherwise built from its architecture
    flags alone) at the expert layout asked for (default: the checkpoint's; expert TP = TP
    when another layout is given), with sequence parallelism when TP > 1 (MoE needs it)."""
    from megatron.training.arguments import get_parser

    if saved.get("num_experts") is None:
        return {}
    group = next(g for g in get_parser()._action_groups if g.title == "mixture of experts")
    out = {a.dest: saved[a.dest] for a in group._group_actions if a.dest in saved}
    other_layout = bool(_layout_overrides(args))
    if other_layout:
        out["expert_tensor_parallel_size"] = None
    for name in ("expert_model_parallel_size", "expert_tensor_parallel_size"):
        if getattr(args, name) is not None:
            out[name] = getattr(args, name)
    tp = args.tensor_model_parallel_size or (
        1 if other_layout else saved_layout["tensor_model_parallel_size"])
    out["sequence_parallel"] = tp > 1
    return out


def _parse_token_ids(text: str):
    try:
        ids = [int(t) for t in text.replace(" ", "").split(",") if t]
    except ValueError:
        raise ConfigError(f"--token-ids {text!r}: give comma-separated integers, e.g. "
                          f"1,2,3.") from None
    if not ids:
        raise ConfigError("--token-ids is empty.")
    return ids


def _hf_tokens(args):
    """Rank 0: the token ids to run (loads the tokenizer for --prompt)."""
    if args.token_ids is not None:
        return _parse_token_ids(args.token_ids)
    from transformers import AutoTokenizer

    where = args.tokenizer or args.hf_dir
    try:
        tokenizer = AutoTokenizer.from_pretrained(where)
    except Exception as exc:  # no tokenizer files, or unreadable ones
        raise ConfigError(f"cannot load a tokenizer from {where} ({type(exc).__name__}); "
                          f"give --tokenizer DIR, or --token-ids 1,2,3 instead of a "
                          f"prompt.") from None
    ids = tokenizer(args.prompt or DEFAULT_PROMPT)["input_ids"]
    if not ids:
        raise ConfigError("the prompt tokenizes to no tokens; give a longer --prompt.")
    return list(ids)


def _check_tokens(ids, hf_config):
    vocab = hf_config.vocab_size
    bad = [i for i in ids if not 0 <= i < vocab]
    if bad:
        raise ConfigError(f"token id {bad[0]} is outside the vocabulary (0..{vocab - 1}).")
    limit = getattr(hf_config, "n_positions", None)  # learned positions (GPT-2): a hard limit
    if limit is not None and len(ids) > limit:
        raise ConfigError(f"{len(ids)} tokens exceed the model's {limit} positions; give a "
                          f"shorter prompt.")


def config_differences(hf_config, configs, vocab: int):
    """Lines naming each architecture field where the checkpoint's args and HF disagree."""
    from megatron.core.models.hf_conversion import config_from_hf

    try:
        theirs, kwargs = config_from_hf(hf_config)
    except ValueError as exc:
        return [f"the HF config is not one this project converts: {exc}"]
    ours = configs.transformer
    fields = list(_CONFIG_FIELDS)
    if ours.position_embedding_type == "rope":
        fields += [f for f in _ROPE_FIELDS
                   if f == "rotary_base" or theirs.rope_scaling_factor is not None
                   or ours.rope_scaling_factor is not None]
        fields.append("rope_type")
        if "yarn" in (ours.rope_type, theirs.rope_type):
            fields += _YARN_FIELDS
    if ours.multi_latent_attention or theirs.multi_latent_attention:
        fields += _LATENT_ATTENTION_FIELDS
    lines = [f"{f}: checkpoint {getattr(ours, f)!r}, HF {getattr(theirs, f)!r}"
             for f in fields if getattr(ours, f) != getattr(theirs, f)]
    tied = configs.model_kwargs["share_embeddings_and_output_weights"]
    if tied != kwargs["share_embeddings_and_output_weights"]:
        lines.append(f"tied embeddings: checkpoint {tied}, HF "
                     f"{kwargs['share_embeddings_and_output_weights']}")
    if vocab != kwargs["vocab_size"]:
        lines.append(f"vocabulary: checkpoint {vocab}, HF {kwargs['vocab_size']}")
    return lines


def compare(hf_logits: torch.Tensor, our_logits: torch.Tensor) -> dict:
    """Max |difference|, KL(HF || ours) per token, next-token agreement, of [s, vocab]."""
    hf, ours = hf_logits.double(), our_logits.double()
    diff = (hf - ours).abs()
    log_p, log_q = torch.log_softmax(hf, -1), torch.log_softmax(ours, -1)
    kl = (log_p.exp() * (log_p - log_q)).sum(-1)
    worst = int(diff.argmax())
    return {"count": diff.numel(), "max_diff": float(diff.max()),
            "where": divmod(worst, diff.shape[-1]), "mean_kl": float(kl.mean()),
            "max_kl": float(kl.max()),
            "agree": int((hf.argmax(-1) == ours.argmax(-1)).sum()), "tokens": hf.shape[0]}


def hf_reference(args):
    """Rank 0: (token ids, HF config, HF logits [s, vocab]). The HF model is freed before
    ours is built."""
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        hf_config = AutoConfig.from_pretrained(args.hf_dir)
    except Exception as exc:
        raise ConfigError(f"--hf-dir {args.hf_dir}: cannot read its config.json "
                          f"({type(exc).__name__}: {exc}).") from None
    ids = _hf_tokens(args)
    _check_tokens(ids, hf_config)
    model = AutoModelForCausalLM.from_pretrained(args.hf_dir, dtype=torch.float32,
                                                 attn_implementation="eager")
    model.to(args.hf_device).eval()
    with torch.no_grad():
        logits = model(torch.tensor([ids], device=args.hf_device)).logits[0].float().cpu()
    return ids, hf_config, logits


def _share(value, src: int = 0):
    """``value`` from rank ``src`` on every rank."""
    box = [value]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def report(stats: dict, tolerance: float, layout: str, vocab: int) -> bool:
    s = stats
    print(f"verify: {s['tokens']} tokens x {vocab} vocab = {s['count']} logits compared "
          f"(HF fp32 vs ours at {layout}, fp32)")
    print(f"max |logit diff|: {s['max_diff']:.6e} (token {s['where'][0]}, id {s['where'][1]})")
    print(f"mean KL(HF || ours) per token: {s['mean_kl']:.6e} (max {s['max_kl']:.6e})")
    print(f"argmax agreement: {s['agree']}/{s['tokens']}")
    ok = s["max_diff"] <= tolerance and s["count"] > 0
    if ok:
        print(f"PASSED: max |logit diff| {s['max_diff']:.3e} <= tolerance {tolerance:.1e}",
              flush=True)
    else:
        print(f"FAILED: max |logit diff| {s['max_diff']:.3e} > tolerance {tolerance:.1e}: the "
              f"checkpoint does not compute what the HF model does (wrong weights or "
              f"architecture flags?)", file=sys.stderr, flush=True)
    return ok


def main(argv=None) -> int:
    args = get_parser().parse_args(argv)
    rank0 = int(os.environ.get("RANK", "0")) == 0

    def fail(message: str, code: int) -> int:
        if rank0:
            print(f"error: {message}", file=sys.stderr, flush=True)
        return code

    if not os.path.isfile(os.path.join(args.hf_dir, "config.json")):
        return fail(f"--hf-dir {args.hf_dir}: no config.json there (a save_pretrained() "
                    f"directory is needed).", 2)
    if args.token_ids is not None:
        try:
            _parse_token_ids(args.token_ids)
        except ConfigError as exc:
            return fail(str(exc), 2)

    from megatron.core import parallel_state
    from megatron.training.checkpoint_model import (
        build_model_from_checkpoint,
        forward_logits,
        read_checkpoint_record,
    )
    from megatron.training.initialize import initialize_distributed

    try:  # before the (slow) HF model: a wrong --load fails at once
        saved, saved_layout = read_checkpoint_record(args.load, args.ckpt_step)
    except CheckpointError as exc:
        return fail(str(exc), 1)
    reference, error = None, None
    if rank0:  # while the other ranks start up
        try:
            reference = hf_reference(args)
        except ConfigError as exc:
            error = str(exc)
        except Exception as exc:  # tell the other ranks instead of leaving them waiting
            error = f"the HF model in {args.hf_dir} failed: {type(exc).__name__}: {exc}"
    initialize_distributed(timeout_minutes=args.timeout_minutes)
    error = _share(error)
    if error is not None:
        return fail(error, 2)
    ids = _share(reference[0] if rank0 else None)
    layout = _layout_overrides(args)
    try:
        chunks, configs = build_model_from_checkpoint(
            args.load, args.ckpt_step, {**layout, **_moe_overrides(args, saved, saved_layout)})
    except ConfigError as exc:
        hint = "" if layout else (" (the layout is the checkpoint's own unless "
                                  "--tensor-/--pipeline-model-parallel-size say otherwise)")
        return fail(f"{exc}{hint}", 2)
    except CheckpointError as exc:
        return fail(str(exc), 1)
    vocab = configs.model_kwargs["vocab_size"]
    logits = forward_logits(chunks, torch.tensor([ids]))[0].float().cpu()
    ok = True
    if rank0:
        _, hf_config, hf = reference
        for line in config_differences(hf_config, configs, vocab):
            print(f"note: {line}", flush=True)
        if hf.shape != logits.shape:
            print(f"error: the HF model gives logits of shape {tuple(hf.shape)} and the "
                  f"checkpoint {tuple(logits.shape)}: they are not the same model.",
                  file=sys.stderr, flush=True)
            ok = False
        else:
            layout = (f"TP={parallel_state.get_tensor_model_parallel_world_size()} x "
                      f"PP={parallel_state.get_pipeline_model_parallel_world_size()}")
            vpp = parallel_state.get_virtual_pipeline_model_parallel_world_size()
            layout += f" x VPP={vpp}" if vpp else ""
            if configs.transformer.moe is not None:
                layout += (f" x EP={configs.transformer.expert_model_parallel_size} x expert "
                           f"TP={configs.transformer.expert_tensor_parallel_size}")
            world = dist.get_world_size()
            layout += f", {world} process{'es' if world > 1 else ''}"
            ok = report(compare(hf, logits), args.tolerance, layout, vocab)
    ok = _share(ok)
    dist.barrier()
    errors.shutdown_distributed()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
