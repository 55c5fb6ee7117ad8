"""A model from a checkpoint alone: its saved args become the flags, its weights are loaded at
the current run's TP/PP/VPP (resharded as needed). For tools that run a trained or converted
model (tools/checkpoint/verify.py) without a training launch line.

    args = args_from_checkpoint(load_dir)                   # a Namespace, as parse_args gives
    chunks, configs = build_model_from_checkpoint(load_dir)  # under torchrun or one process
    logits = forward_logits(chunks, tokens)                  # [b, s, vocab] on every rank
"""
import argparse
import os
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from megatron.core import device, parallel_state
from megatron.core.models import GPTModel
from megatron.core.pipeline_parallel import build_model_chunks, get_forward_backward_func
from megatron.core.pipeline_parallel.model_chunks import unwrap_model
from megatron.core.tensor_parallel.mappings import gather_from_tensor_model_parallel_region
from megatron.training.arguments import build_configs, get_parser, validate_args
from megatron.training.checkpointing import CheckpointError, load_checkpoint
from megatron.training.checkpointing.load import read_iteration_record
from megatron.training.checkpointing.paths import (
    TRACKER_FILE,
    complete_iterations,
    iteration_dir_name,
    read_tracker,
)
from megatron.training.gpt_step import model_provider_for
from megatron.training.initialize import (
    expert_sizes,
    initialize_megatron,
    seed_for_model_init,
)
from megatron.training.tokenizer.null import NullTokenizer

# The flags that shape the model (and its vocabulary padding): what a model takes from its
# checkpoint when nothing else of the training run matters.
MODEL_GROUPS = ("network size and architecture", "tokenizer")
LAYOUT_DESTS = ("tensor_model_parallel_size", "pipeline_model_parallel_size",
                "num_layers_per_virtual_pipeline_stage", "num_virtual_stages_per_pipeline_rank",
                "decoder_first_pipeline_num_layers", "decoder_last_pipeline_num_layers",
                "account_for_embedding_in_pipeline_split", "account_for_loss_in_pipeline_split")
# Values parse_args derives; recomputed from the others (a saved run holds them already).
_DERIVED = ("virtual_pipeline_model_parallel_size", "data_parallel_size", "padded_vocab_size")

# A forward-only run: no data, no schedule, no optimizer state; fp32; weights only.
INFERENCE_OVERRIDES = dict(
    micro_batch_size=1, global_batch_size=None, train_iters=1, train_samples=None, lr=0.0,
    mock_data=True, data_path=None, train_data_path=None, valid_data_path=None,
    test_data_path=None, save=None, finetune=True, no_load_optim=True, no_load_rng=True,
    fp16=False, bf16=False, sequence_parallel=False, recompute_activations=False,
    recompute_granularity=None, recompute_method=None, recompute_num_layers=None,
    distribute_saved_activations=False, use_distributed_optimizer=False,
    overlapped_distributed_optimizer=False, async_save=False, tensorboard_dir=None)


def _parser_defaults() -> Dict:
    return vars(get_parser().parse_known_args([])[0])


def _model_dests(parser) -> set:
    return {a.dest for g in parser._action_groups if g.title in MODEL_GROUPS
            for a in g._group_actions}


def checkpoint_iteration_dir(load_dir: str, ckpt_step: Optional[int] = None) -> str:
    """The directory ``load_checkpoint`` would read: ``ckpt_step``'s, else the tracker's
    (``release`` or the latest iteration), else the newest complete iteration."""
    if not os.path.isdir(load_dir):
        raise CheckpointError(f"--load {load_dir}: no such directory.")
    if ckpt_step is not None:
        path = os.path.join(load_dir, iteration_dir_name(ckpt_step))
        if not os.path.isdir(path):
            raise CheckpointError(
                f"--ckpt-step {ckpt_step}: {load_dir} has no complete checkpoint of that "
                f"iteration (it has: {complete_iterations(load_dir) or 'none'}).")
        return path
    tracker = read_tracker(load_dir)
    if tracker is None:
        iterations = complete_iterations(load_dir)
        if not iterations:
            raise CheckpointError(f"--load {load_dir}: there is no checkpoint there (no "
                                  f"{TRACKER_FILE} and no iter_* directory).")
        tracker = iterations[-1], False
    path = os.path.join(load_dir, iteration_dir_name(*tracker))
    if not os.path.isdir(path):
        raise CheckpointError(f"{os.path.join(load_dir, TRACKER_FILE)} names {path}, which "
                              f"does not exist; pick an iteration with --ckpt-step.")
    return path


def read_checkpoint_record(load_dir: str, ckpt_step: Optional[int] = None
                           ) -> Tuple[Dict, Dict]:
    """(saved args dict, layout record) of a checkpoint, from its first rank file (the
    index of a sharded one)."""
    iteration_dir = checkpoint_iteration_dir(load_dir, ckpt_step)
    state = read_iteration_record(iteration_dir)
    layout = state.get("layout") if isinstance(state, dict) else None
    if layout is None:
        raise CheckpointError(f"{iteration_dir} is not a checkpoint written by this project "
                              f"(no layout record); convert it with tools/checkpoint.")
    args = state.get("args")
    if not isinstance(args, dict) or not args.get("num_layers"):
        raise CheckpointError(f"{iteration_dir} does not record its model's flags (no 'args' "
                              f"dict with num_layers); give them on the command line instead.")
    return args, layout


def args_from_checkpoint(load_dir: str, ckpt_step: Optional[int] = None,
                         overrides: Optional[Dict] = None,
                         model_only: bool = False) -> argparse.Namespace:
    """The parser's defaults, updated with the checkpoint's saved args (all of them, or with
    ``model_only`` only the model's and tokenizer's flags), then ``overrides`` (argparse
    dests), checked as ``parse_args`` checks a command line; ``--load`` is ``load_dir``.

    The parallel layout is the checkpoint's own unless ``overrides`` names any of
    LAYOUT_DESTS; then, as on a command line, the ones not named take their defaults."""
    saved, layout = read_checkpoint_record(load_dir, ckpt_step)
    parser = get_parser()
    values = _parser_defaults()
    keep = _model_dests(parser) if model_only else set(values)
    values.update({k: v for k, v in saved.items() if k in keep and k not in _DERIVED})
    overrides = dict(overrides or {})
    if any(k in overrides for k in LAYOUT_DESTS):
        values.update({k: _parser_defaults()[k] for k in LAYOUT_DESTS})
    else:
        values.update(tensor_model_parallel_size=layout["tensor_model_parallel_size"],
                      pipeline_model_parallel_size=layout["pipeline_model_parallel_size"],
                      num_layers_per_virtual_pipeline_stage=None,
                      num_virtual_stages_per_pipeline_rank=layout[
                          "virtual_pipeline_model_parallel_size"])
        values.update({k: saved[k] for k in LAYOUT_DESTS[4:] if k in saved})  # uneven stages
    if values.get("weight_decay_incr_style") == "constant":
        values.update(start_weight_decay=None, end_weight_decay=None)  # derived when constant
    values.update(overrides)
    values.update(load=load_dir, ckpt_step=ckpt_step)
    return validate_args(argparse.Namespace(**values))


class _WeightsOnly:
    """The optimizer ``load_checkpoint`` expects, for a model that is not trained."""

    def reload_model_params(self) -> None:
        pass


def build_model_from_checkpoint(load_dir: str, ckpt_step: Optional[int] = None,
                                overrides: Optional[Dict] = None, model_class=GPTModel
                                ) -> Tuple[List[torch.nn.Module], object]:
    """(this rank's model chunks in eval mode, configs): distributed started from torchrun's
    environment (or as one process), the model built for the checkpoint's layout or the one
    ``overrides`` give, its weights loaded (fine-tune style: weights only; fp32).

    The vocabulary is the checkpoint's own (its layout record), so the tokenizer files named
    in its args need not exist here. Raises ConfigError / CheckpointError."""
    _, layout = read_checkpoint_record(load_dir, ckpt_step)
    vocab = int(layout["vocab_size"])
    tokenizer = NullTokenizer(vocab - 1)  # ids 0..vocab-2 plus eod: ``vocab`` ids in all
    args = args_from_checkpoint(
        load_dir, ckpt_step, {**INFERENCE_OVERRIDES, "tokenizer_type": "NullTokenizer",
                              "vocab_size": vocab - 1, **(overrides or {})}, model_only=True)
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    configs = build_configs(args, world_size, tokenizer)
    initialize_megatron(args.tensor_model_parallel_size, args.pipeline_model_parallel_size,
                        args.virtual_pipeline_model_parallel_size, configs.training.seed,
                        configs.training.device,
                        expert_model_parallel_size=expert_sizes(configs.transformer)[0],
                        expert_tensor_parallel_size=expert_sizes(configs.transformer)[1])
    provider = model_provider_for(model_class)
    state = torch.get_rng_state()
    seed_for_model_init(configs.training.seed)
    chunks = build_model_chunks(lambda **kw: provider(configs, **kw), configs.transformer)
    torch.set_rng_state(state)
    load_checkpoint(chunks, _WeightsOnly(), None, configs)
    for chunk in chunks:
        chunk.eval()
    return chunks, configs


@torch.no_grad()
def forward_logits(chunks: Sequence[torch.nn.Module], tokens: torch.Tensor) -> torch.Tensor:
    """Full logits [b, s, vocab] (TP shards gathered, vocabulary padding dropped) of ``tokens``
    [b, s], run through the pipeline schedule; every rank gets them. Collective."""
    tokens = tokens.to(device.current_device())
    batch, seq = tokens.shape
    pipeline = parallel_state.get_pipeline_model_parallel_world_size()
    virtual = parallel_state.get_virtual_pipeline_model_parallel_world_size()
    collected = []

    def collect(output):
        collected.append(output)
        return output.new_zeros(()), {}

    def forward_step(data_iterator, model):
        return model(tokens), collect

    # The interleaved schedule needs a multiple of PP microbatches: the same one, repeated.
    get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=None, model=list(chunks),
        num_microbatches=pipeline if virtual else 1, seq_length=seq, micro_batch_size=batch,
        forward_only=True)
    vocab = unwrap_model(chunks[-1]).vocab_size
    logits = torch.empty(batch, seq, vocab, device=tokens.device)
    if parallel_state.is_pipeline_last_stage(ignore_virtual=True):
        logits.copy_(gather_from_tensor_model_parallel_region(collected[0])[..., :vocab])
    if pipeline > 1:
        dist.broadcast(logits, parallel_state.get_last_stage_rank(),
                       group=parallel_state.get_pipeline_model_parallel_group())
    return logits
