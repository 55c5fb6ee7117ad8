"""Convert checkpoints between Hugging Face and Megatron, and reshard Megatron checkpoints.

    python3 tools/checkpoint/convert.py hf-to-megatron --load HF_DIR --save CKPT_DIR \\
        --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2
    python3 tools/checkpoint/convert.py megatron-to-hf --load CKPT_DIR --save HF_OUT
    python3 tools/checkpoint/convert.py megatron-to-megatron --load CKPT_DIR --save NEW_DIR \\
        --tensor-model-parallel-size 1 --pipeline-model-parallel-size 4
    python3 tools/checkpoint/convert.py megatron-to-megatron --load CKPT_DIR --save NEW_DIR \\
        --ckpt-format torch        # the sharded format -> mp_rank_* files, all state kept

Supported Hugging Face models: LlamaForCausalLM (LLaMA 1/2/3: GQA, rope theta, LLaMA-3 rope
scaling, tied or untied embeddings), MistralForCausalLM (LLaMA's layout with its sliding
window: --window-size S-1,0), Qwen2ForCausalLM (LLaMA's layout with q/k/v biases), Qwen3ForCausalLM (per-head q/k
RMSNorms, a head dim of its own; without sliding window), GPT2LMHeadModel, and the
mixtures of experts MixtralForCausalLM, Qwen2MoeForCausalLM (shared expert with its gate),
Qwen3MoeForCausalLM (q/k norms), GptOssForCausalLM and DeepseekV3ForCausalLM (multi-latent
attention; bf16 weights, its multi-token prediction layers dropped) at any EP x expert TP
(``--expert-model-parallel-size``, ``--expert-tensor-parallel-size``). Megatron checkpoints
are read in either format (``torch_dist``, the sharded default of training, or ``torch``:
mp_rank_* files, experts in mp_rank_{etp}_{pp}_{ep}/experts.pt) and written in the one
``--ckpt-format`` names (default torch_dist). HF -> Megatron writes a ``release`` checkpoint
(tracker file included), the vocabulary padded as training pads it (a model with more
embedding rows than its tokenizer has tokens, as Qwen's, keeps its rows: the flags say
``--padded-vocab-size``), the tokenizer files under
``CKPT_DIR/tokenizer`` and the launch flags in ``CKPT_DIR/megatron_flags.txt``. Megatron -> HF
rebuilds config.json from the checkpoint's args and writes sharded safetensors that
``AutoModelForCausalLM.from_pretrained`` loads. Megatron -> Megatron at the checkpoint's own
layout (no layout flags) converts between the formats and keeps everything (optimizer state,
LR schedule, RNG states, counters): training resumes from the copy as from the original; to
another layout it reshards the weights only. Every output directory is written under
``NAME.partial`` and renamed when complete: a failed run leaves nothing behind.
"""
import argparse
import json
import os
import re
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, _HERE)
sys.path.insert(1, os.path.join(_HERE, os.pardir, os.pardir))

import torch  # noqa: E402

import hf_io  # noqa: E402
import tokenizer_files  # noqa: E402
from tokenizer_files import TOKENIZER_DIR  # noqa: E402
import hf_moe_io  # noqa: E402
import megatron_args  # noqa: E402
import megatron_moe_args  # noqa: E402
import shape_checks  # noqa: E402
from conversion_utils import (  # noqa: E402
    ConversionError,
    Progress,
    check_output_dir,
    say,
    staged_output_dir,
)
from megatron.core.models.hf_conversion import (  # noqa: E402
    GPT2,
    LLAMA,
    hf_to_megatron,
    megatron_to_hf,
)
from megatron.core.models.hf_moe_conversion import STACKED  # noqa: E402
from megatron.training.checkpointing.offline import (  # noqa: E402
    CKPT_FORMATS,
    TargetLayout,
    find_iteration_dir,
    read_checkpoint,
    read_model,
    write_checkpoint,
    write_model,
)
from megatron.training.checkpointing.disk_space import tree_nbytes  # noqa: E402
from megatron.training.checkpointing.paths import CheckpointError  # noqa: E402
from megatron.training.tokenizer.fingerprint import (  # noqa: E402
    FINGERPRINT_ARG,
    FINGERPRINT_FILE,
    fingerprint_of_hf_directory,
)

FLAGS_FILE = "megatron_flags.txt"
_EMBEDDING = shape_checks.EMBEDDING


def _dtype_note(dtype) -> str:
    if dtype == torch.bfloat16:
        return "The weights are bfloat16: train with --bf16 (fp32 main parameters)."
    if dtype == torch.float16:
        return "The weights are float16: train with --fp16 or --bf16."
    return None


def _write_flags(stage: str, args, final_dir: str, arch: str, source: str, release: bool,
                 dtype, resumable: bool = False) -> None:
    with open(os.path.join(stage, FLAGS_FILE), "w") as f:
        f.write(megatron_args.flags_text(args, final_dir, arch, source, release,
                                         _dtype_note(dtype), resumable))


def _layout_text(ckpt_format: str, tp: int, pp: int, vpp, args=None) -> str:
    text = f"TP={tp} x PP={pp}" + (f" x VPP={vpp}" if vpp else "")
    if args and args.get("num_experts") is not None:
        text += (f" x EP={args['expert_model_parallel_size']} x expert TP="
                 f"{args['expert_tensor_parallel_size'] or tp}")
    if ckpt_format == "torch_dist":
        return f"sharded format, loads at any layout; flags for {text}"
    return text


def _heads_and_groups(args):
    heads = args["num_attention_heads"]
    return heads, args["num_query_groups"] if args["group_query_attention"] else heads


# --------------------------------------------------------------------------------------------
def _check_tokenizer_dir(path) -> None:
    if path and not os.path.isdir(path):
        raise ConversionError(f"--tokenizer-dir {path} does not exist.")


def hf_to_megatron_cmd(a) -> str:
    config = hf_io.read_config(a.load)
    _check_tokenizer_dir(a.tokenizer_dir)
    warning = hf_io.check_sliding_window(config, a.ignore_sliding_window)
    if warning:
        say(f"warning: {warning}")
    args = megatron_args.args_from_hf(config, None, a.seq_length)
    tp, pp, per_stage = (a.tensor_model_parallel_size, a.pipeline_model_parallel_size,
                         a.num_layers_per_virtual_pipeline_stage)
    vpp = megatron_args.check_target(args["num_layers"], *_heads_and_groups(args),
                                     args["ffn_hidden_size"], tp, pp, per_stage)
    ep, etp = a.expert_model_parallel_size or 1, a.expert_tensor_parallel_size
    megatron_moe_args.check_expert_target(args, tp, ep, etp)
    save = check_output_dir(a.save)
    num_layers, vocab = args["num_layers"], args["vocab_size"]
    tied = not args["untie_embeddings_and_output_weights"]
    hf_state = hf_io.normalized_weights(hf_io.read_weights(a.load), config, num_layers, tied,
                                        a.load)
    rows = hf_state[hf_io.embedding_name(config.model_type)].shape[0]
    if rows != vocab:
        raise ConversionError(f"the embedding of {a.load} has {rows} rows but config.json's "
                              f"vocab_size is {vocab}; fix config.json.")
    shape_checks.check_hf(hf_state, config, a.load)
    try:
        full = hf_to_megatron(hf_state, config)
    except (ValueError, RuntimeError) as exc:
        raise ConversionError(f"the weights of {a.load} do not fit its config.json: {exc}") \
            from None
    del hf_state

    tokenizer_src = a.tokenizer_dir or a.load
    has_tokenizer = any(os.path.isfile(os.path.join(tokenizer_src, n))
                        for n in hf_io.TOKENIZER_FILES if n != "generation_config.json")
    if has_tokenizer:
        args.update(tokenizer_type="PretrainedFromHF",
                    tokenizer_name_or_path=os.path.join(save, TOKENIZER_DIR))
        fingerprint = tokenizer_files.fingerprint_as_copied(tokenizer_src)
        if fingerprint is not None:  # what training checks its tokenizer against
            args[FINGERPRINT_ARG] = {**fingerprint, "source": os.path.join(save, TOKENIZER_DIR)}
        size = hf_io.tokenizer_size(tokenizer_src)
        if size is not None and size > vocab:
            say(f"warning: the tokenizer has {size} tokens but the model's vocabulary "
                f"{vocab}; training with this tokenizer builds a {size}-token embedding, "
                f"which does not load this checkpoint.")
    else:
        size = None
        say(f"note: no tokenizer files in {tokenizer_src}; add your own tokenizer flags when "
            f"training.")
    explicit = megatron_args.explicit_padding(vocab, size, tp)
    if explicit is not None:
        say(f"note: the model has {vocab} embedding rows for the tokenizer's {size} tokens; "
            f"the checkpoint keeps all of them and its flags say --padded-vocab-size {vocab} "
            f"(rows {size}.. stay out of the softmax).")
    args = megatron_moe_args.expert_layout_args(megatron_args.layout_args(
        args, tp, pp, per_stage, vpp, a.make_vocab_size_divisible_by, explicit), ep, etp)
    dtype = full[_EMBEDDING].dtype
    with staged_output_dir(save, tree_nbytes(full)) as stage:
        hf_io.copy_tokenizer_files(tokenizer_src, os.path.join(stage, TOKENIZER_DIR))
        write_model(stage, full, num_layers, vocab, gated_mlp=args["swiglu"], tied_output=tied,
                    target=_target(args, tp, pp, vpp, _divisor(a.make_vocab_size_divisible_by,
                                                               explicit)),
                    args=args, iteration=None, ckpt_format=a.ckpt_format,
                    progress=Progress("writing Megatron checkpoint files", _files(a, tp, pp)))
        _write_flags(stage, args, save, LLAMA if args["swiglu"] else GPT2,
                     os.path.abspath(a.load), True, dtype)
    layout = _layout_text(a.ckpt_format, tp, pp, vpp, args)
    return (f"wrote a release checkpoint ({layout}) of {config.model_type} to {save}; "
            f"training flags in {os.path.join(save, FLAGS_FILE)}")


def _files(a, tp: int, pp: int) -> int:
    return 1 if a.ckpt_format == "torch_dist" else tp * pp


def _divisor(divisible: int, explicit) -> int:
    """Explicit rows are padded no further (TP divides them: checked)."""
    return divisible if explicit is None else 1


def _target(args, tp: int, pp: int, vpp, divisible: int) -> TargetLayout:
    return TargetLayout(tp, pp, vpp, divisible,
                        expert_model_parallel_size=args.get("expert_model_parallel_size") or 1,
                        expert_tensor_parallel_size=args.get("expert_tensor_parallel_size"))


# --------------------------------------------------------------------------------------------
def _read_checkpoint(load: str, step):
    if not os.path.isdir(load):
        raise ConversionError(f"checkpoint directory {load} does not exist.")
    try:
        iteration_dir = find_iteration_dir(load, step)
        say(f"reading {iteration_dir}")
        full, layout, saved = read_model(iteration_dir)
    except CheckpointError as exc:
        raise ConversionError(str(exc)) from None
    if not saved:
        raise ConversionError(f"{iteration_dir} records no args; the model's architecture is "
                              f"unknown.")
    return iteration_dir, full, layout, {**megatron_args.parser_defaults(), **saved}


def _check_against_transformers(state, hf_config) -> None:
    """Every tensor has the name and shape transformers' own model gives it."""
    import transformers

    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(hf_config)
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    params = dict(model.named_parameters())
    missing = [n for n in params if n not in state]
    wrong = [f"{n} {tuple(t.shape)} (expected {shapes.get(n)})" for n, t in state.items()
             if shapes.get(n) != tuple(t.shape)]
    if missing or wrong:
        raise ConversionError("the checkpoint's tensors do not match the model its args "
                              "describe: " + (f"missing {missing[0]}" if missing else wrong[0]))


def megatron_to_hf_cmd(a) -> str:
    max_shard = a.max_shard_size
    _check_tokenizer_dir(a.tokenizer_dir)
    save = check_output_dir(a.save)
    iteration_dir, full, layout, args = _read_checkpoint(a.load, a.ckpt_step)
    tokenizer_dir = tokenizer_files.checkpoint_tokenizer_dir(a.load, args, a.tokenizer_dir)
    dtype = full[_EMBEDDING].dtype
    hf_config = megatron_args.hf_config_from_args(args, layout["vocab_size"], dtype,
                                                  hf_io.special_token_ids(tokenizer_dir))
    shape_checks.check_megatron(full, hf_config, iteration_dir)
    try:
        state = megatron_to_hf(full, hf_config)
        # transformers >= 5 holds MoE experts stacked: check the names it would have
        in_memory = state if not hf_moe_io.is_moe(hf_config.model_type) else megatron_to_hf(
            hf_moe_io.meta_state(full), hf_config, expert_layout=STACKED)
    except (KeyError, ValueError, RuntimeError) as exc:
        raise ConversionError(f"the checkpoint's tensors do not match the model its args "
                              f"describe ({type(exc).__name__}: {exc}).") from None
    del full
    if hf_config.tie_word_embeddings:
        state.pop("lm_head.weight")  # as save_pretrained: the embedding serves both
        in_memory.pop("lm_head.weight", None)
    _check_against_transformers(in_memory, hf_config)
    fingerprint = args.get(FINGERPRINT_ARG) or fingerprint_of_hf_directory(tokenizer_dir)
    with staged_output_dir(save, tree_nbytes(state)) as stage:
        shards = hf_io.write_weights(stage, state, max_shard)
        if fingerprint:  # the tokenizer the weights were trained with, for a later import
            with open(os.path.join(stage, FINGERPRINT_FILE), "w") as f:
                json.dump(fingerprint, f, indent=1)
        hf_config.save_pretrained(stage)
        copied = hf_io.copy_tokenizer_files(tokenizer_dir, stage)
        tokenizer_files.copy_megatron_tokenizer_files(args, stage, copied)
        if "generation_config.json" not in copied:
            from transformers import GenerationConfig

            GenerationConfig.from_model_config(hf_config).save_pretrained(stage)
    what = hf_config.architectures[0]
    return (f"wrote {what} ({len(shards)} safetensors file(s)) from {iteration_dir} to {save}"
            + ("" if tokenizer_dir else "; no tokenizer found (pass --tokenizer-dir)"))


# --------------------------------------------------------------------------------------------
def _no_layout_flags(a) -> bool:
    return (a.tensor_model_parallel_size, a.pipeline_model_parallel_size,
            a.num_layers_per_virtual_pipeline_stage, a.make_vocab_size_divisible_by,
            a.expert_model_parallel_size, a.expert_tensor_parallel_size) == (None,) * 6


def megatron_to_megatron_cmd(a) -> str:
    if os.path.abspath(a.load) == os.path.abspath(a.save):
        raise ConversionError("--save must differ from --load.")
    save = check_output_dir(a.save)
    iteration_dir, full, layout, args = _read_checkpoint(a.load, a.ckpt_step)
    shape_checks.check_resharded(full, layout, args, iteration_dir)
    tokenizer_src = os.path.join(a.load, TOKENIZER_DIR)
    if os.path.isdir(tokenizer_src) and args.get("tokenizer_name_or_path") and \
            os.path.abspath(args["tokenizer_name_or_path"]) == os.path.abspath(tokenizer_src):
        args["tokenizer_name_or_path"] = os.path.join(save, TOKENIZER_DIR)
    if _no_layout_flags(a):
        return _convert_format(a, save, iteration_dir, args, tokenizer_src)
    name = os.path.basename(iteration_dir.rstrip(os.sep))
    match = re.fullmatch(r"iter_(\d+)", name)
    iteration = int(match.group(1)) if match else None  # None: release
    tp = a.tensor_model_parallel_size or layout["tensor_model_parallel_size"]
    pp = a.pipeline_model_parallel_size or layout["pipeline_model_parallel_size"]
    per_stage = a.num_layers_per_virtual_pipeline_stage
    num_layers, vocab = layout["num_layers"], layout["vocab_size"]
    vpp = megatron_args.check_target(num_layers, *_heads_and_groups(args),
                                     args["ffn_hidden_size"], tp, pp, per_stage)
    ep = a.expert_model_parallel_size or layout.get("expert_model_parallel_size", 1)
    etp = a.expert_tensor_parallel_size
    megatron_moe_args.check_expert_target(args, tp, ep, etp)
    divisible = a.make_vocab_size_divisible_by or args["make_vocab_size_divisible_by"]
    explicit = megatron_args.saved_explicit_padding(args, vocab)
    if explicit is not None:
        megatron_args.explicit_padding(vocab, 0, tp)  # TP must split the model's rows
    args = megatron_moe_args.expert_layout_args(megatron_args.layout_args(
        args, tp, pp, per_stage, vpp, divisible, explicit), ep, etp)
    with staged_output_dir(save, tree_nbytes(full)) as stage:
        if os.path.isdir(tokenizer_src):
            hf_io.copy_tokenizer_files(tokenizer_src, os.path.join(stage, TOKENIZER_DIR))
        write_model(stage, full, num_layers, vocab, layout["gated_mlp"], layout["tied_output"],
                    _target(args, tp, pp, vpp, _divisor(divisible, explicit)), args,
                    iteration=iteration,
                    ckpt_format=a.ckpt_format,
                    progress=Progress("writing Megatron checkpoint files", _files(a, tp, pp)))
        _write_flags(stage, args, save, LLAMA if args["swiglu"] else GPT2,
                     os.path.abspath(iteration_dir), iteration is None, full[_EMBEDDING].dtype)
    return (f"wrote {'release' if iteration is None else f'iteration {iteration}'} "
            f"({_layout_text(a.ckpt_format, tp, pp, vpp, args)}, model weights only) to {save}")


def _convert_format(a, save: str, iteration_dir: str, args, tokenizer_src: str) -> str:
    """The whole checkpoint at its own layout, in ``--ckpt-format``: a run of that layout
    resumes from the copy exactly as from the original."""
    try:
        checkpoint = read_checkpoint(iteration_dir)
    except CheckpointError as exc:
        raise ConversionError(str(exc)) from None
    checkpoint.args = {**checkpoint.args, **{k: args[k] for k in ("tokenizer_name_or_path",)
                                             if k in args}}
    sizes = tree_nbytes([checkpoint.model, checkpoint.optimizer])
    with staged_output_dir(save, sizes) as stage:
        if os.path.isdir(tokenizer_src):
            hf_io.copy_tokenizer_files(tokenizer_src, os.path.join(stage, TOKENIZER_DIR))
        try:
            write_checkpoint(stage, checkpoint, a.ckpt_format)
        except CheckpointError as exc:
            raise ConversionError(str(exc)) from None
        resumable = checkpoint.optimizer is not None
        flag_args = {**checkpoint.args, "padded_vocab_size": megatron_args.saved_explicit_padding(
            checkpoint.args, checkpoint.layout["vocab_size"])}
        _write_flags(stage, flag_args, save, LLAMA if args["swiglu"] else GPT2,
                     os.path.abspath(iteration_dir), checkpoint.iteration is None,
                     checkpoint.model[_EMBEDDING].dtype, resumable)
    kept = "model, optimizer, LR schedule" if resumable else "model weights"
    kept += ", RNG states" if checkpoint.rng else ""
    what = "release" if checkpoint.iteration is None else f"iteration {checkpoint.iteration}"
    return (f"wrote {what} in the {a.ckpt_format} format ({kept}; the saved layout) to "
            f"{save}")


# --------------------------------------------------------------------------------------------
def _positive_int(text):
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text} is not >= 1")
    return value


def _size(text):
    try:
        return hf_io.parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _add_layout_flags(p, default, default_text: str):
    g = p.add_argument_group("target parallel layout")
    g.add_argument("--tensor-model-parallel-size", type=_positive_int, metavar="N",
                   default=default,
                   help=f"Must divide the attention heads and query groups. {default_text}")
    g.add_argument("--pipeline-model-parallel-size", type=_positive_int, metavar="N",
                   default=default, help=f"Must divide the layers. {default_text}")
    g.add_argument("--num-layers-per-virtual-pipeline-stage", type=int, default=None,
                   metavar="N",
                   help="Interleaved (virtual) pipeline stages of this many layers.")
    g.add_argument("--expert-model-parallel-size", type=_positive_int, metavar="N",
                   default=None, help="MoE models: experts split over N ranks (must divide "
                   "the experts). Default: 1 (hf-to-megatron), the checkpoint's (reshard).")
    g.add_argument("--expert-tensor-parallel-size", type=_positive_int, metavar="N",
                   default=None, help="MoE models: each expert split over N ranks. Default: "
                   "the tensor-parallel size.")


def _add_format_flag(p, what: str):
    p.add_argument("--ckpt-format", choices=CKPT_FORMATS, default="torch_dist",
                   help=f"{what}: torch_dist (the sharded format training saves by default; "
                        f"loads at any layout) or torch (mp_rank_* files of the "
                        f"layout). Default torch_dist.")


def get_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="convert.py", description=__doc__.split("\n\n")[0] + "\n\n" + __doc__.split(
            "\n\n", 1)[1], formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("hf-to-megatron", help="Hugging Face directory -> Megatron release "
                       "checkpoint for any TP/PP/VPP.",
                       description="Hugging Face model directory (config.json + safetensors or "
                       "pytorch_model*.bin) -> a Megatron 'release' checkpoint.")
    p.add_argument("--load", "--load-dir", required=True, metavar="HF_DIR",
                   help="The Hugging Face model directory (local; nothing is downloaded).")
    p.add_argument("--save", "--save-dir", required=True, metavar="DIR",
                   help="New or empty output directory.")
    _add_layout_flags(p, 1, "Default 1.")
    _add_format_flag(p, "The format to write")
    p.add_argument("--make-vocab-size-divisible-by", type=_positive_int, metavar="N", default=128,
                   help="Pad the vocabulary to a multiple of this x TP, as training does "
                        "(default 128; use the value you will train with).")
    p.add_argument("--seq-length", type=_positive_int, default=None, metavar="N",
                   help="--seq-length recorded in the args and flags (default: the model's "
                        f"max positions, at most {megatron_args.DEFAULT_MAX_SEQ_LENGTH}).")
    p.add_argument("--tokenizer-dir", default=None, metavar="DIR",
                   help="Take the tokenizer files from here instead of HF_DIR.")
    p.add_argument("--ignore-sliding-window", action="store_true",
                   help="Convert a Qwen2 model with use_sliding_window anyway (equal only for "
                        "sequences within the window).")
    p.set_defaults(run=hf_to_megatron_cmd)

    p = sub.add_parser("megatron-to-hf", help="Megatron checkpoint (any layout) -> Hugging "
                       "Face directory (safetensors).",
                       description="Megatron checkpoint (any TP/PP/VPP) -> a Hugging Face "
                       "directory that AutoModelForCausalLM.from_pretrained loads.")
    p.add_argument("--load", "--load-dir", required=True, metavar="DIR",
                   help="Checkpoint directory (with latest_checkpointed_iteration.txt).")
    p.add_argument("--ckpt-step", type=int, default=None, metavar="N",
                   help="Iteration to convert (default: the tracker's, latest or release).")
    p.add_argument("--save", "--save-dir", required=True, metavar="HF_DIR",
                   help="New or empty output directory.")
    p.add_argument("--max-shard-size", type=_size, default="5GB", metavar="SIZE",
                   help="Largest safetensors file, e.g. 5GB, 500MB (default 5GB).")
    p.add_argument("--tokenizer-dir", default=None, metavar="DIR",
                   help="Tokenizer files to ship (default: DIR/tokenizer, else the "
                        "checkpoint's --tokenizer-name-or-path).")
    p.set_defaults(run=megatron_to_hf_cmd)

    p = sub.add_parser("megatron-to-megatron", help="Convert a Megatron checkpoint to the "
                       "other format (all state kept), or reshard it to another TP/PP/VPP.",
                       description="Without layout flags: the whole checkpoint (model, "
                       "optimizer state, LR schedule, RNG states) in --ckpt-format at its own "
                       "layout; training resumes from it as from the original. With layout "
                       "flags: reshard to another TP/PP/VPP (model weights and args; optimizer "
                       "state is not carried over). Training loads any layout as it is; this "
                       "serves tools and pre-cut copies.")
    p.add_argument("--load", "--load-dir", required=True, metavar="DIR",
                   help="Checkpoint directory (with latest_checkpointed_iteration.txt).")
    p.add_argument("--ckpt-step", type=int, default=None, metavar="N",
                   help="Iteration to reshard (default: the tracker's); it keeps its number.")
    p.add_argument("--save", "--save-dir", required=True, metavar="NEW_DIR",
                   help="New or empty output directory.")
    _add_layout_flags(p, None, "Default: the checkpoint's; with no layout flag at all the "
                      "whole checkpoint is converted to --ckpt-format, optimizer included.")
    _add_format_flag(p, "The format to write (the checkpoint's own is read either way)")
    p.add_argument("--make-vocab-size-divisible-by", type=_positive_int, metavar="N", default=None,
                   help="Default: the checkpoint's.")
    p.set_defaults(run=megatron_to_megatron_cmd)
    return parser


def main(argv=None) -> int:
    args = get_parser().parse_args(argv)
    try:
        print(args.run(args))
    except ConversionError as exc:
        message = " ".join(str(exc).split())
        print(f"convert.py {args.command}: error: {message}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
