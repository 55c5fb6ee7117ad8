"""Megatron flags (as parsed by ``arguments.parse_args``) -> the config dataclasses, with the
checks that need the world size or the file system: batch vs data-parallel size, heads vs TP,
data and tokenizer files. Every problem raises ``ConfigError`` naming the flag and the fix."""
import argparse
import dataclasses
import importlib.util
import os
import types

import torch

from megatron.core import device
from megatron.core.datasets.config import GPTDatasetConfig, parse_data_path
from megatron.core.distributed.distributed_data_parallel_config import (
    ddp_config_for_optimizer,
)
from megatron.core.distributed.fsdp import TorchFSDP2Config
from megatron.core.fp8.checks import fp8_unsupported_reason
from megatron.core.fp8.param_gather import GATHERED_RECIPES
from megatron.core.optimizer.optimizer_config import OptimizerConfig
from megatron.core.optimizer.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.pipeline_parallel.schedule_order import check_schedule_settings
from megatron.core.transformer.attention import math_attention_reason
from megatron.core.transformer.context_parallel import reference_kernel_reason
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.training.arguments.fp8 import fp8_config_from_args
from megatron.training.arguments.moe import moe_config_from_args
from megatron.training.logging.wandb_log import wandb_missing_reason
from megatron.training.tokenizer.vocab_padding import (
    check_splits_over_tensor_parallel,
    padded_vocab_size,
    rows_kept_in_checkpoints,
)
from megatron.training.training_config import (
    ConfigError,
    MegatronConfigs,
    TrainingConfig,
)


def _need(ok: bool, message: str):
    if not ok:
        raise ConfigError(message)


def _check_world(args, world_size: int) -> int:
    """The data-parallel size; checks the batch and head counts against it and TP."""
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    cp = args.context_parallel_size
    _need(tp >= 1 and pp >= 1, "--tensor- and --pipeline-model-parallel-size must be >= 1.")
    _need(world_size >= 1 and world_size % (tp * cp * pp) == 0,
          f"world size {world_size} is not divisible by --tensor-model-parallel-size {tp} x "
          + (f"--context-parallel-size {cp} x " if cp > 1 else "")
          + f"--pipeline-model-parallel-size {pp}; launch a multiple of {tp * cp * pp} "
          f"processes.")
    dp = world_size // (tp * cp * pp)
    mbs = args.micro_batch_size
    if args.global_batch_size is None:
        args.global_batch_size = mbs * dp
    _need(mbs >= 1 and args.global_batch_size % (mbs * dp) == 0,
          f"--global-batch-size {args.global_batch_size} is not divisible by --micro-batch-size "
          f"{mbs} x data-parallel size {dp} (world {world_size} / (TP {tp} x "
          + (f"CP {cp} x " if cp > 1 else "") + f"PP {pp})); make it "
          f"a multiple of {mbs * dp}.")
    _need(args.train_samples is None or args.train_samples >= args.global_batch_size,
          f"--train-samples {args.train_samples} is less than one global batch "
          f"({args.global_batch_size}): Megatron trains train_samples // global_batch_size "
          f"iterations, here none.")
    _need(args.num_attention_heads % tp == 0,
          f"--num-attention-heads {args.num_attention_heads} is not divisible by "
          f"--tensor-model-parallel-size {tp}.")
    if args.group_query_attention:
        _need(args.num_query_groups % tp == 0,
              f"--num-query-groups {args.num_query_groups} is not divisible by "
              f"--tensor-model-parallel-size {tp}.")
    args.data_parallel_size = dp
    _check_instances(args, dp * cp)
    _check_expert_world(args, world_size)
    return dp


def instances_of(args) -> int:
    return getattr(args, "num_distributed_optimizer_instances", 1)  # saved args may lack it


def _check_instances(args, data_and_context: int) -> None:
    """HSDP: the instances cut the DP x CP ranks evenly, and something shards inside them."""
    instances = instances_of(args)
    if instances == 1:
        return
    flag = f"--num-distributed-optimizer-instances {instances}"
    _need(args.use_distributed_optimizer or args.overlapped_distributed_optimizer
          or getattr(args, "use_torch_fsdp2", False),
          f"{flag} replicates a sharded optimizer: add --use-distributed-optimizer or "
          "--use-torch-fsdp2 (each instance shards over its ranks).")
    _need(data_and_context % instances == 0,
          f"{flag} does not divide the {data_and_context} data-parallel x context-parallel "
          "ranks; choose a divisor of it.")


def _check_expert_world(args, world_size: int) -> None:
    """EP x expert-TP must cut a pipeline stage's ranks (TP x CP x DP) evenly."""
    if getattr(args, "num_experts", None) is None:
        return
    ep = args.expert_model_parallel_size
    etp = args.expert_tensor_parallel_size or args.tensor_model_parallel_size
    stage = world_size // args.pipeline_model_parallel_size
    _need(ep >= 1 and etp >= 1 and stage % (ep * etp) == 0,
          f"--expert-model-parallel-size {ep} x expert tensor parallel size {etp} = "
          f"{ep * etp} does not divide the {stage} ranks of a pipeline stage (world size "
          f"{world_size} / --pipeline-model-parallel-size {args.pipeline_model_parallel_size});"
          f" choose expert sizes whose product divides it.")
    edp, instances = stage // (ep * etp), instances_of(args)
    _need(edp % instances == 0,
          f"--num-distributed-optimizer-instances {instances} does not divide the {edp} "
          f"expert-data-parallel ranks (pipeline stage {stage} / (EP {ep} x expert TP "
          f"{etp})); choose a divisor of both it and DP x CP.")
    _need(args.num_experts % ep == 0,
          f"--num-experts {args.num_experts} is not divisible by --expert-model-parallel-size "
          f"{ep}; every EP rank holds the same number of experts.")
    _need(args.moe_router_topk <= args.num_experts,
          f"--moe-router-topk {args.moe_router_topk} is more than --num-experts "
          f"{args.num_experts}.")


def check_training_microbatches(args) -> None:
    """The pipeline schedule's rules on the microbatch count of a training run (zbv: at least
    2 PP; interleaved: a multiple of PP), at start (after build_configs: it needs the DP size).
    Not in build_configs: conversion and inference build configs with other batches."""
    pp, mbs, dp = args.pipeline_model_parallel_size, args.micro_batch_size, \
        args.data_parallel_size
    if pp == 1:
        return
    try:
        check_schedule_settings(pp, args.global_batch_size // (mbs * dp),
                                args.virtual_pipeline_model_parallel_size,
                                args.pipeline_schedule)
    except ValueError as error:
        _need(False, f"{error} (--global-batch-size {args.global_batch_size} / "
                     f"(--micro-batch-size {mbs} x data-parallel size {dp}) microbatches)")


def _muon_settings(args) -> dict:
    """OptimizerConfig's muon_* fields from the --muon-* flags (saved args may lack them)."""
    if args.optimizer != "muon":
        return {}
    return dict(muon_momentum=args.muon_momentum, muon_use_nesterov=args.muon_use_nesterov,
                muon_num_ns_steps=args.muon_num_ns_steps, muon_scale_mode=args.muon_scale_mode,
                muon_extra_scale_factor=args.muon_extra_scale_factor,
                muon_split_qkv=args.muon_split_qkv, muon_tp_mode=args.muon_tp_mode,
                muon_scalar_optimizer=args.muon_scalar_optimizer,
                muon_ns_dtype=torch.bfloat16 if args.muon_ns_dtype == "bf16"
                else torch.float32)


def _fsdp2_config(args, ddp):
    """--use-torch-fsdp2: refuse what does not compose with it yet, one message each."""
    flag = "--use-torch-fsdp2"
    _need(not (args.use_distributed_optimizer or args.overlapped_distributed_optimizer
               or getattr(args, "shard_gradients", False)),
          f"{flag} shards the optimizer state and gradients itself; drop "
          "--use-distributed-optimizer / --overlapped-distributed-optimizer / "
          "--shard-gradients.")
    _need(args.optimizer != "muon", f"{flag} with --optimizer muon is not built yet (Muon "
          "orthogonalizes whole matrices, FSDP2 holds each one's DP shards); drop one.")
    _need(not (args.overlap_grad_reduce or args.overlap_param_gather
               or args.ddp_bucket_size is not None),
          f"{flag} overlaps its own collectives per layer; drop --overlap-grad-reduce, "
          "--overlap-param-gather and --ddp-bucket-size.")
    _need(not getattr(args, "fp8_param_gather", False),
          f"--fp8-param-gather with {flag} is not built yet (FSDP2 gathers its shards "
          "itself): drop one, or use --use-distributed-optimizer.")
    _need(args.ckpt_format != "torch" or (args.save is None and args.load is None),
          f"{flag} saves and loads the sharded checkpoint format only: use --ckpt-format "
          "torch_dist (the default), not --ckpt-format torch.")
    return _built("data-parallel flags", lambda: TorchFSDP2Config(
        grad_reduce_in_fp32=ddp.grad_reduce_in_fp32,
        reshard_after_forward=args.reshard_after_forward,
        cpu_offload=getattr(args, "optimizer_cpu_offload", False),  # saved args may lack it
        reduce_gradients_once=getattr(args, "fsdp2_reduce_gradients_once", False),
        num_distributed_optimizer_instances=instances_of(args)))


_TOKENIZER_FILES = {
    "GPT2BPETokenizer": (("--vocab-file", "vocab_file"), ("--merge-file", "merge_file")),
    "SentencePieceTokenizer": (("--tokenizer-model", "tokenizer_model"),),
    "Llama2Tokenizer": (("--tokenizer-model", "tokenizer_model"),),
    "TikTokenizer": (("--tokenizer-model", "tokenizer_model"),),
}


def _check_files(args):
    """Data prefixes have their .bin/.idx; tokenizer files/directories exist."""
    for name in ("data_path", "train_data_path", "valid_data_path", "test_data_path"):
        words, flag = getattr(args, name), "--" + name.replace("_", "-")
        if words is None or args.mock_data:
            continue
        try:
            prefixes, _ = parse_data_path(words)
        except ValueError as exc:
            raise ConfigError(f"{flag}: {exc}") from None
        missing = [p + ext for p in prefixes for ext in (".bin", ".idx")
                   if not os.path.isfile(p + ext)]
        _need(not missing, f"{flag}: missing data file(s) {', '.join(missing)}; give prefixes "
              "without .bin/.idx, written by tools/preprocess_data.py (or use --mock-data).")
    kind = args.tokenizer_type
    _need(kind is not None, "--tokenizer-type is required (NullTokenizer with --vocab-size for "
          "mock data).")
    if kind == "NullTokenizer":
        _need(args.vocab_size is not None, "--tokenizer-type NullTokenizer needs --vocab-size.")
        return
    needed = _TOKENIZER_FILES.get(kind)
    if needed is None:  # HuggingFace: a save_pretrained() directory (Megatron: --tokenizer-model)
        needed = ((("--tokenizer-name-or-path", "tokenizer_name_or_path"),)
                  if args.tokenizer_name_or_path or not args.tokenizer_model
                  else (("--tokenizer-model", "tokenizer_model"),))
    for flag, dest in needed:
        path = getattr(args, dest)
        _need(path is not None, f"--tokenizer-type {kind} needs {flag}.")
        _need(os.path.exists(path), f"{flag} {path}: no such file or directory.")


def _scheduler_kwargs(args) -> dict:
    """OptimizerParamScheduler's arguments, in samples, exactly as Megatron derives them."""
    gbs = args.global_batch_size
    if args.train_iters is not None:
        decay_iters = args.lr_decay_iters if args.lr_decay_iters is not None else args.train_iters
        decay, wd_steps = decay_iters * gbs, args.train_iters * gbs
        wsd = None if args.lr_wsd_decay_iters is None else args.lr_wsd_decay_iters * gbs
        warmup = args.lr_warmup_iters * gbs
        # Say it in iterations here: the scheduler's own message would count samples.
        _need(args.lr_warmup_fraction is not None or args.lr_warmup_iters < decay_iters,
              f"--lr-warmup-iters {args.lr_warmup_iters} must be < --lr-decay-iters "
              f"{decay_iters} (default --train-iters).")
    else:
        decay = args.lr_decay_samples if args.lr_decay_samples is not None else args.train_samples
        wd_steps, wsd, warmup = args.train_samples, args.lr_wsd_decay_samples, args.lr_warmup_samples
    if args.lr_warmup_fraction is not None:
        warmup = args.lr_warmup_fraction * decay
    return dict(init_lr=args.lr_warmup_init, max_lr=args.lr, min_lr=args.min_lr,
                lr_warmup_steps=warmup, lr_decay_steps=decay, lr_decay_style=args.lr_decay_style,
                start_wd=args.start_weight_decay, end_wd=args.end_weight_decay,
                wd_incr_steps=wd_steps, wd_incr_style=args.weight_decay_incr_style,
                use_checkpoint_opt_param_scheduler=args.use_checkpoint_opt_param_scheduler,
                override_opt_param_scheduler=args.override_opt_param_scheduler,
                wsd_decay_steps=wsd, lr_wsd_decay_style=args.lr_wsd_decay_style)


def _built(what: str, make):
    """Run a config constructor; its ValueError becomes a ConfigError saying which flags."""
    try:
        return make()
    except ConfigError:
        raise
    except ValueError as exc:
        raise ConfigError(f"{what}: {exc}") from exc


def _vocab_checked(make):
    """vocab_padding's ValueErrors name their flag already."""
    try:
        return make()
    except ValueError as exc:
        raise ConfigError(str(exc)) from exc


def params_dtype_of(args) -> torch.dtype:
    return torch.bfloat16 if args.bf16 else torch.float16 if args.fp16 else torch.float32


def torch_compile_of(args) -> bool:
    """--torch-compile / --no-torch-compile, else the default: the compiled element-wise path
    where the run's device is CUDA and Triton (inductor's GPU code generator) imports, the
    eager one on CPU (bitwise as before; compiling there costs more than it saves)."""
    chosen = getattr(args, "torch_compile", None)  # saved args may predate the flag
    if chosen is not None:
        return chosen
    target = device.device_type() if getattr(args, "device", "auto") == "auto" else args.device
    return target == "cuda" and importlib.util.find_spec("triton") is not None


def _window_of(args):
    """--window-size as a tuple (saved args hold a list after a JSON round trip, or lack it)."""
    window = getattr(args, "window_size", None)
    return None if window is None else tuple(window)


def _yarn_of(args) -> dict:
    """The YaRN fields of TransformerConfig (saved args may predate the flags: plain RoPE)."""
    if getattr(args, "rope_type", "rope") != "yarn":
        return {}
    return dict(rope_type="yarn", rotary_scaling_factor=args.rotary_scaling_factor,
                original_max_position_embeddings=args.original_max_position_embeddings,
                beta_fast=args.beta_fast, beta_slow=args.beta_slow, mscale=args.mscale,
                mscale_all_dim=args.mscale_all_dim,
                yarn_truncate=args.yarn_correction_range_round_to_int,
                yarn_attention_factor=args.yarn_attention_factor)


def _latent_attention_of(args) -> dict:
    """The multi-latent attention fields of TransformerConfig (saved args may predate the
    flags: none)."""
    if not getattr(args, "multi_latent_attention", False):
        return {}
    return dict(multi_latent_attention=True, q_lora_rank=args.q_lora_rank,
                kv_lora_rank=args.kv_lora_rank, qk_head_dim=args.qk_head_dim,
                qk_pos_emb_head_dim=args.qk_pos_emb_head_dim, v_head_dim=args.v_head_dim,
                rotary_interleaved=args.rotary_interleaved)


def _qk_clip_of(args) -> dict:
    """The QK-clip fields of TransformerConfig (saved args may predate the flags: off)."""
    if not (getattr(args, "qk_clip", False) or getattr(args, "log_max_attention_logit", False)):
        return {}
    return dict(qk_clip=args.qk_clip, qk_clip_threshold=args.qk_clip_threshold,
                qk_clip_alpha=args.qk_clip_alpha,
                log_max_attention_logit=args.log_max_attention_logit)


def activation_of(args) -> str:
    """TransformerConfig.activation of the flags (saved args may predate --quick-geglu)."""
    if args.swiglu:
        return "swiglu"
    if getattr(args, "quick_geglu", False):
        return "quick_geglu"
    return "gelu_tanh" if args.openai_gelu else "gelu"


def transformer_config_from_args(args: argparse.Namespace) -> TransformerConfig:
    """The model and its parallel layout (TP/PP/VPP/SP, recomputation, dtype) of parsed flags;
    no world-size or file checks (``build_configs`` does those). Shared with
    tools/plan_parallelism.py, so a planned layout is the layout these flags build."""
    return _built("model flags", lambda: TransformerConfig(
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=args.virtual_pipeline_model_parallel_size,
        pipeline_schedule=getattr(args, "pipeline_schedule", None),
        sequence_parallel=args.sequence_parallel, params_dtype=params_dtype_of(args),
        context_parallel_size=args.context_parallel_size, cp_comm_type=args.cp_comm_type,
        expert_model_parallel_size=getattr(args, "expert_model_parallel_size", 1),
        expert_tensor_parallel_size=getattr(args, "expert_tensor_parallel_size", None),
        moe=moe_config_from_args(args),
        fp8=fp8_config_from_args(args),
        gradient_accumulation_fusion=args.gradient_accumulation_fusion,
        torch_compile=torch_compile_of(args),
        num_layers=args.num_layers, hidden_size=args.hidden_size,
        num_attention_heads=args.num_attention_heads, ffn_hidden_size=args.ffn_hidden_size,
        num_query_groups=args.num_query_groups if args.group_query_attention else None,
        kv_channels=args.kv_channels, normalization=args.normalization,
        layernorm_epsilon=args.norm_epsilon,
        activation=activation_of(args),
        # saved args may predate these two
        glu_linear_offset=getattr(args, "glu_linear_offset", 0.0),
        activation_func_clamp_value=getattr(args, "activation_func_clamp_value", None),
        add_bias_linear=not args.disable_bias_linear,
        add_qkv_bias=True if args.add_qkv_bias else None,
        qk_layernorm=getattr(args, "qk_layernorm", False),  # saved args may predate it
        window_size=_window_of(args),
        window_attn_skip_freq=getattr(args, "window_attn_skip_freq", None),
        softmax_type=getattr(args, "softmax_type", "vanilla"),  # saved args may predate it
        **_latent_attention_of(args),
        **_qk_clip_of(args),
        mtp_num_layers=getattr(args, "mtp_num_layers", None),
        mtp_loss_scaling_factor=getattr(args, "mtp_loss_scaling_factor", 0.1),
        attention_dropout=args.attention_dropout, hidden_dropout=args.hidden_dropout,
        position_embedding_type=args.position_embedding_type,
        max_position_embeddings=args.max_position_embeddings, rotary_base=args.rotary_base,
        rotary_percent=args.rotary_percent,
        rope_scaling_factor=args.rope_scaling_factor if args.use_rope_scaling else None,
        rope_low_freq_factor=args.rope_low_freq_factor,
        rope_high_freq_factor=args.rope_high_freq_factor,
        rope_original_max_position_embeddings=args.rope_original_max_position_embeddings,
        **_yarn_of(args),
        init_method_std=args.init_method_std,
        recompute_granularity=args.recompute_granularity, recompute_method=args.recompute_method,
        recompute_num_layers=args.recompute_num_layers,
        distribute_saved_activations=args.distribute_saved_activations,
        num_layers_in_first_pipeline_stage=args.decoder_first_pipeline_num_layers,
        num_layers_in_last_pipeline_stage=args.decoder_last_pipeline_num_layers,
        account_for_embedding_in_pipeline_split=args.account_for_embedding_in_pipeline_split,
        account_for_loss_in_pipeline_split=args.account_for_loss_in_pipeline_split))


def build_configs(args: argparse.Namespace, world_size: int = 1,
                  tokenizer=None) -> MegatronConfigs:
    """The configs of a parsed command line for ``world_size`` processes.

    ``tokenizer`` (optional, from ``build_tokenizer_from_args``) supplies the vocabulary and
    end-of-document id; without it the dataset's vocab is ``--vocab-size`` (a placeholder 1 when
    a tokenizer file will supply it) and eod 0."""
    dp = _check_world(args, world_size)
    _check_files(args)
    missing = wandb_missing_reason(getattr(args, "wandb_project", None))  # saved args: no flag
    _need(missing is None, missing)
    dtype = params_dtype_of(args)
    transformer = transformer_config_from_args(args)
    if not getattr(args, "allow_math_attention", False):  # saved args may predate the flag
        target = device.device_type() if args.device == "auto" else args.device
        reason = math_attention_reason(transformer, target)
        _need(reason is None, reason)
        reason = reference_kernel_reason(transformer, target, args.seq_length,
                                         packed_documents=args.reset_attention_mask)
        _need(reason is None, reason)
    target = device.device_type() if args.device == "auto" else args.device
    reason = fp8_unsupported_reason(
        transformer, target, device.capability() if target == "cuda" else None,
        args.micro_batch_size * args.seq_length // args.context_parallel_size)
    _need(reason is None, reason)
    _need(not getattr(args, "fp8_param_gather", False)
          or args.fp8_recipe in GATHERED_RECIPES,
          f"--fp8-param-gather gathers weights quantized with their tensor's or 128 x 128 "
          f"blocks' scales: use --fp8-recipe tensorwise, blockwise or delayed, not "
          f"{args.fp8_recipe} (its dgrad needs a second, column-scaled copy of the weight), "
          "or drop --fp8-param-gather.")
    _need(transformer.fp8 is None or transformer.fp8.recipe != "delayed"
          or args.num_experts is None,
          "--fp8-recipe delayed does not cover the MoE experts' GEMMs yet: use "
          "--fp8-recipe tensorwise with --num-experts")
    optimizer = _built("optimizer flags", lambda: OptimizerConfig(
        optimizer=args.optimizer, lr=args.lr, min_lr=args.min_lr,
        weight_decay=args.weight_decay, adam_beta1=args.adam_beta1, adam_beta2=args.adam_beta2,
        adam_eps=args.adam_eps, sgd_momentum=args.sgd_momentum, fp16=args.fp16, bf16=args.bf16,
        params_dtype=dtype, loss_scale=args.loss_scale,
        initial_loss_scale=args.initial_loss_scale, min_loss_scale=args.min_loss_scale,
        loss_scale_window=args.loss_scale_window, hysteresis=args.hysteresis,
        clip_grad=args.clip_grad, log_num_zeros_in_grad=args.log_num_zeros_in_grad,
        check_for_nan_in_grad=args.check_for_nan_in_loss_and_grad,
        use_distributed_optimizer=args.use_distributed_optimizer,
        overlapped_distributed_optimizer=args.overlapped_distributed_optimizer,
        optimizer_cpu_offload=getattr(args, "optimizer_cpu_offload", False),  # saved args
        **_muon_settings(args)))
    ddp = _built("data-parallel flags", lambda: ddp_config_for_optimizer(
        optimizer, grad_reduce_in_fp32=args.accumulate_allreduce_grads_in_fp32,
        overlap_grad_reduce=args.overlap_grad_reduce, bucket_size=args.ddp_bucket_size,
        reduce_bucket_size=args.reduce_bucket_size,
        shard_gradients=getattr(args, "shard_gradients", False),  # saved args may lack it
        # FSDP2 refuses it below, by name (this config is replaced by its own)
        fp8_param_gather=getattr(args, "fp8_param_gather", False)
        and not getattr(args, "use_torch_fsdp2", False),
        # FSDP2 takes the instances below (this config is replaced by its own).
        num_distributed_optimizer_instances=1 if getattr(args, "use_torch_fsdp2", False)
        else instances_of(args)))
    if args.overlap_param_gather and not ddp.overlap_param_gather:
        ddp = _built("data-parallel flags", lambda: dataclasses.replace(
            ddp, overlap_param_gather=True))
    if getattr(args, "use_torch_fsdp2", False):  # saved args may lack it
        ddp = _fsdp2_config(args, ddp)
    scheduler_kwargs = _scheduler_kwargs(args)
    # Check the schedule now, not after the model is built (no param groups: nothing written).
    _built("learning-rate flags", lambda: OptimizerParamScheduler(
        types.SimpleNamespace(param_groups=[]), **scheduler_kwargs))
    vocab_size = tokenizer.vocab_size if tokenizer is not None else args.vocab_size
    if vocab_size is None and tokenizer is None and args.tokenizer_type != "NullTokenizer":
        vocab_size = 1  # checking the flags before the tokenizer (which has the vocab) is loaded
    eod = getattr(tokenizer, "eod", None)
    _need(not args.mock_data or vocab_size is not None,
          "--mock-data needs a vocabulary: pass --vocab-size or a tokenizer.")
    dataset = _built("data flags", lambda: GPTDatasetConfig(
        seq_length=args.seq_length, seed=args.seed, data_path=args.data_path, split=args.split,
        train_data_path=args.train_data_path, valid_data_path=args.valid_data_path,
        test_data_path=args.test_data_path, data_cache_path=args.data_cache_path,
        mock=args.mock_data, vocab_size=vocab_size, eod_token=0 if eod is None else eod,
        reset_position_ids=args.reset_position_ids,
        reset_attention_mask=args.reset_attention_mask, eod_mask_loss=args.eod_mask_loss))
    names = {f.name for f in dataclasses.fields(TrainingConfig)}
    training = TrainingConfig(**{**{k: v for k, v in vars(args).items() if k in names},
                                 "data_parallel_size": dp,
                                 "device": None if args.device == "auto" else args.device})
    model_kwargs = {"share_embeddings_and_output_weights":
                    not args.untie_embeddings_and_output_weights}
    explicit = getattr(args, "padded_vocab_size", None)  # saved args may lack it
    _vocab_checked(lambda: check_splits_over_tensor_parallel(
        explicit, args.tensor_model_parallel_size))
    checkpoint_vocab_size = None
    if tokenizer is not None:
        model_kwargs["vocab_size"] = tokenizer.vocab_size
        # args.padded_vocab_size stays the user's flag (None: derived), so saved args say which.
        model_kwargs["padded_vocab_size"] = _vocab_checked(lambda: padded_vocab_size(
            tokenizer.vocab_size, explicit, args.make_vocab_size_divisible_by,
            args.tensor_model_parallel_size))
        checkpoint_vocab_size = rows_kept_in_checkpoints(tokenizer.vocab_size, explicit)
    return MegatronConfigs(transformer=transformer, optimizer=optimizer, ddp=ddp,
                           scheduler_kwargs=scheduler_kwargs, dataset=dataset,
                           training=training, model_kwargs=model_kwargs,
                           checkpoint_vocab_size=checkpoint_vocab_size)
