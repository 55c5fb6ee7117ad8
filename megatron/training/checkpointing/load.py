"""``load_checkpoint``: resume (or start a fine-tune) from a checkpoint of any layout.

Reading and checking happen first, with no collective calls, and every rank learns whether
any rank failed before anything is applied; so a bad checkpoint stops every rank with the
same message instead of leaving some of them waiting in a collective.
"""
import os
from dataclasses import dataclass, field
from typing import Dict, List, Optional

import torch
import torch.distributed as dist

from megatron.core import parallel_state
from megatron.core.distributed.fsdp import is_fsdp2
from megatron.core.fp8.delayed import CHECKPOINT_KEY, restore_histories
from megatron.core.pipeline_parallel.model_chunks import unwrap_model
from megatron.training.checkpointing.architecture import architecture_mismatch
from megatron.training.checkpointing.expert_files import has_experts, load_experts
from megatron.training.checkpointing.layout import current_layout, model_key, same_model_cut
from megatron.training.checkpointing.paths import (
    MODEL_FILE,
    OPTIMIZER_FILE,
    TRACKER_FILE,
    CheckpointError,
    complete_iterations,
    iteration_dir_name,
    parse_rank_dir_name,
    rank_dir_name,
    read_tracker,
)
from megatron.training.checkpointing.resharder import Resharder
from megatron.training.checkpointing.rng_state import restore_rng_state
from megatron.training.checkpointing.safe_io import safe_load
from megatron.training.checkpointing.sharded_index import (
    is_sharded_checkpoint,
    read_metadata,
    shard_file_name,
)
from megatron.training.checkpointing.sharded_load import (
    ModelReads,
    ShardedReader,
    read_optimizer,
    read_rng_state,
    saved_histories,
)
from megatron.training.checkpointing.vocab_check import check_vocabulary
from megatron.training.tokenizer.fingerprint import FINGERPRINT_ARG


@dataclass
class LoadedCheckpoint:
    """Where training continues; ``iteration`` 0 and nothing loaded for a fresh start."""
    iteration: int = 0
    consumed_train_samples: int = 0
    consumed_valid_samples: int = 0
    path: Optional[str] = None
    notes: List[str] = field(default_factory=list)
    rng_state: Optional[Dict] = None
    tokenizer: Optional[Dict] = None  # the fingerprint its args record (None: older ones)
    fp8_histories: Optional[List] = None  # --fp8-recipe delayed's (same layout only)

    def restore_rng(self, seed: int) -> None:
        """Call right before the first iteration: anything drawn after it (building data
        loaders draws a seed) would shift the random streams away from the saved run's.
        ``seed`` (the run's --seed) reseeds device streams saved on another device type."""
        if self.rng_state is not None:
            restore_rng_state(self.rng_state, seed, self.iteration)


@dataclass
class _Read:
    result: LoadedCheckpoint
    models: List[Dict[str, torch.Tensor]]
    optimizer: Optional[Dict] = None
    scheduler: Optional[Dict] = None


def choose_iteration(t):
    """(iteration, release) to load, or None for a fresh start (``t``: anything with the
    ``load``, ``ckpt_step`` and ``save`` settings: a TrainingConfig, parsed args)."""
    if t.ckpt_step is not None:
        if not os.path.isdir(os.path.join(t.load, iteration_dir_name(t.ckpt_step))):
            raise CheckpointError(
                f"--ckpt-step {t.ckpt_step}: {t.load} has no complete checkpoint of that "
                f"iteration (it has: {complete_iterations(t.load) or 'none'}).")
        return t.ckpt_step, False
    tracker = read_tracker(t.load)
    if tracker is not None:
        return tracker
    iterations = complete_iterations(t.load)
    if iterations:  # a crash between the rename and the tracker update: that dir is complete
        return iterations[-1], False
    same_as_save = t.save is not None and os.path.realpath(t.save) == os.path.realpath(t.load)
    if same_as_save:
        return None  # auto-resume: the first start of a job finds nothing and starts fresh
    raise CheckpointError(
        f"--load {t.load}: there is no checkpoint there (no {TRACKER_FILE} and no iter_* "
        f"directory). Check the path; to start from scratch drop --load.")


def saved_rank_dirs(iteration_dir: str) -> Dict:
    found = {}
    for name in sorted(os.listdir(iteration_dir)):
        coords = parse_rank_dir_name(name)
        if coords is not None:
            found[coords] = os.path.join(iteration_dir, name)
    if not found:
        if any(name.startswith("shard_") for name in os.listdir(iteration_dir)):
            raise CheckpointError(f"{iteration_dir} holds shard files but no metadata.json "
                                  f"(the sharded format's index): the checkpoint is incomplete. "
                                  f"Load another with --ckpt-step.")
        raise CheckpointError(f"{iteration_dir} holds no mp_rank_* directories; the checkpoint "
                              f"is empty or damaged. Load another with --ckpt-step.")
    return found


def read_iteration_record(iteration_dir: str) -> Dict:
    """A saved iteration's own record (counters, args, layout): the sharded format's JSON
    index, or the torch format's first rank file through ``safe_load``."""
    if is_sharded_checkpoint(iteration_dir):
        return read_metadata(iteration_dir)
    rank_dirs = saved_rank_dirs(iteration_dir)
    return safe_load(os.path.join(rank_dirs[min(rank_dirs)], MODEL_FILE))


def check_rank_dirs_complete(iteration_dir: str, rank_dirs: Dict, saved_layout: Dict) -> None:
    """Every (TP, PP) directory the saved layout says it wrote is there."""
    tp, pp = (saved_layout["tensor_model_parallel_size"],
              saved_layout["pipeline_model_parallel_size"])
    for coords in ((t, p) for p in range(pp) for t in range(tp)):
        if coords not in rank_dirs:
            missing = os.path.join(iteration_dir, rank_dir_name(*coords, pp))
            raise CheckpointError(
                f"{missing} is missing: the checkpoint was saved with TP={tp} x PP={pp} "
                f"({tp * pp} mp_rank_* directories) and holds only {len(rank_dirs)}; copy the "
                f"whole iteration directory, or load another with --ckpt-step.")


def _check_architecture(chunks, states: List[Dict[str, torch.Tensor]]) -> None:
    for chunk, state in zip(chunks, states):
        want = unwrap_model(chunk).state_dict()
        for name, tensor in want.items():
            if name not in state:
                raise CheckpointError(f"the checkpoint is for another architecture: it has no "
                                      f"{name} (shape {tuple(tensor.shape)} here).")
            if tuple(state[name].shape) != tuple(tensor.shape):
                raise CheckpointError(
                    f"the checkpoint is for another architecture: {name} has shape "
                    f"{tuple(state[name].shape)} there and {tuple(tensor.shape)} here.")
        extra = sorted(set(state) - set(want))
        if extra:
            raise CheckpointError(f"the checkpoint is for another architecture: it has "
                                  f"{extra[0]}, which this model does not.")


def _check_flags_match(record, run_args: Optional[Dict], iteration_dir: str) -> None:
    """The architecture the checkpoint's saved args record is this run's (``run_args``:
    its flags as a dict; None skips the check, e.g. for a model built from those args)."""
    saved = record.get("args") if isinstance(record, dict) else None
    if run_args is None or not isinstance(saved, dict):
        return
    problem = architecture_mismatch(saved, run_args, iteration_dir)
    if problem is not None:
        raise CheckpointError(problem)


def _read(model_chunks, configs, run_args: Optional[Dict] = None) -> Optional[_Read]:
    t = configs.training
    chosen = choose_iteration(t)
    if chosen is None:
        return None
    iteration, release = chosen
    iteration_dir = os.path.join(t.load, iteration_dir_name(iteration, release))
    if not os.path.isdir(iteration_dir):
        raise CheckpointError(f"{os.path.join(t.load, TRACKER_FILE)} names "
                              f"{iteration_dir}, which does not exist; load another iteration "
                              f"with --ckpt-step.")
    if is_sharded_checkpoint(iteration_dir):
        return _read_sharded(model_chunks, configs, iteration_dir, iteration, release,
                             run_args)
    if is_fsdp2(model_chunks):
        raise CheckpointError(f"{iteration_dir} is in the torch format; --use-torch-fsdp2 loads "
                              f"the sharded format only: resume it once without "
                              f"--use-torch-fsdp2 and save with --ckpt-format torch_dist.")
    rank_dirs = saved_rank_dirs(iteration_dir)
    layout = current_layout(model_chunks, configs)
    own_coords = (parallel_state.get_tensor_model_parallel_rank(),
                  parallel_state.get_pipeline_model_parallel_rank())
    own_dir = os.path.join(iteration_dir, rank_dir_name(
        *own_coords, layout["pipeline_model_parallel_size"]))
    probe = safe_load(os.path.join(own_dir if own_dir in rank_dirs.values()
                                   else next(iter(rank_dirs.values())), MODEL_FILE))
    saved_layout = probe.get("layout") if isinstance(probe, dict) else None
    if saved_layout is None:
        raise CheckpointError(f"{iteration_dir} is not a checkpoint written by this project "
                              f"(no layout record); convert it with tools/checkpoint.")
    _check_flags_match(probe, run_args, iteration_dir)
    check_rank_dirs_complete(iteration_dir, rank_dirs, saved_layout)
    check_vocabulary(saved_layout, layout, configs.model_kwargs.get("vocab_size", 0),
                     iteration_dir)
    load_optim = not (t.finetune or t.no_load_optim or release)
    notes = []

    def optimizer_of(rank_state, rank_dir):
        if "optimizer" in rank_state:
            return rank_state["optimizer"]
        path = os.path.join(rank_dir, OPTIMIZER_FILE)
        return safe_load(path) if os.path.isfile(path) else None

    if same_model_cut(saved_layout, layout) and own_dir in rank_dirs.values():
        models = [probe[model_key(c, layout["virtual_pipeline_model_parallel_size"])]
                  for c in range(len(model_chunks))]
        optimizer = optimizer_of(probe, own_dir) if load_optim else None
    else:
        files = {coords: safe_load(os.path.join(path, MODEL_FILE))
                 for coords, path in rank_dirs.items()}
        resharder = Resharder(files, saved_layout, layout, model_chunks,
                               lambda rank: optimizer_of(files[rank], rank_dirs[rank]))
        models = resharder.models()
        optimizer = resharder.optimizer() if load_optim else None
        notes.append(f"resharded from TP={saved_layout['tensor_model_parallel_size']} x "
                     f"PP={saved_layout['pipeline_model_parallel_size']}")
    if has_experts(model_chunks):
        load_experts(iteration_dir, model_chunks, layout["layer_ranges"], models,
                     optimizer if load_optim else None)
    _check_architecture(model_chunks, models)
    if load_optim and optimizer is None:
        raise CheckpointError(f"{iteration_dir} holds no optimizer state (saved with "
                              f"--no-save-optim?); resume with --no-load-optim.")

    rng = None
    if not (t.finetune or t.no_load_rng or release):
        states = probe.get("rng_state")
        if states and same_model_cut(saved_layout, layout) and \
                len(states) == layout["data_parallel_size"] and \
                saved_layout.get("context_parallel_size", 1) == layout["context_parallel_size"]:
            rng = states[parallel_state.get_data_parallel_rank(with_context_parallel=True)]
        else:
            notes.append("random-generator state not restored (another layout, or none saved)")
    read = _result(t, release, probe, iteration, iteration_dir, notes, rng, models, optimizer,
                   load_optim)
    if same_model_cut(saved_layout, layout) and own_dir in rank_dirs.values():
        read.result.fp8_histories = probe.get(CHECKPOINT_KEY)
    return read


def _read_sharded(model_chunks, configs, iteration_dir: str, iteration: int,
                  release: bool, run_args: Optional[Dict] = None) -> _Read:
    """The sharded format: this rank's ranges of every tensor, whatever the saved layout."""
    t = configs.training
    meta = read_metadata(iteration_dir)
    _check_flags_match(meta, run_args, iteration_dir)
    reader = ShardedReader(iteration_dir, meta)
    layout = current_layout(model_chunks, configs)
    saved_layout = meta.get("layout") or {}
    if saved_layout.get("num_layers") != layout["num_layers"]:
        raise CheckpointError(
            f"the checkpoint is for another architecture: it has {saved_layout.get('num_layers')} "
            f"layers and this model {layout['num_layers']}.")
    check_vocabulary(saved_layout, layout, configs.model_kwargs.get("vocab_size", 0),
                     iteration_dir)
    models = ModelReads(reader, model_chunks, layout)
    models.check()
    load_optim = not (t.finetune or t.no_load_optim or release)
    optimizer = read_optimizer(reader, model_chunks, layout) if load_optim else None
    if load_optim and optimizer is None:
        raise CheckpointError(f"{iteration_dir} holds no optimizer state (saved with "
                              f"--no-save-optim?); resume with --no-load-optim.")
    notes = []
    cut = ("tensor_model_parallel_size", "pipeline_model_parallel_size",
           "virtual_pipeline_model_parallel_size", "data_parallel_size")
    same_ranks = all(saved_layout.get(k) == layout[k] for k in cut) and all(
        saved_layout.get(k, 1) == layout[k]
        for k in ("expert_model_parallel_size", "expert_tensor_parallel_size"))
    if not same_ranks:
        notes.append(
            f"resharded from TP={saved_layout.get('tensor_model_parallel_size')} x "
            f"PP={saved_layout.get('pipeline_model_parallel_size')} x "
            f"DP={saved_layout.get('data_parallel_size')}")
    rng = None
    if not (t.finetune or t.no_load_rng or release):
        rng = read_rng_state(reader, dist.get_rank()) if same_ranks else None
        if rng is None:
            notes.append("random-generator state not restored (another layout, or none saved)")
    read = _result(t, release, meta, iteration, iteration_dir, notes, rng, models, optimizer,
                   load_optim)
    read.result.fp8_histories = saved_histories(reader, saved_layout, same_ranks)
    return read


def _result(t, release: bool, record: Dict, iteration: int, iteration_dir: str, notes, rng,
            models, optimizer, load_optim: bool) -> _Read:
    """What a read returns; ``record`` is the checkpoint's own state (the torch format's
    rank file, the sharded format's index): counters, args, schedule."""
    fresh = t.finetune or release
    result = LoadedCheckpoint(
        iteration=0 if fresh else iteration,
        consumed_train_samples=0 if fresh else int(record.get("consumed_train_samples", 0)),
        consumed_valid_samples=0 if fresh else int(record.get("consumed_valid_samples", 0)),
        path=iteration_dir, notes=notes, rng_state=rng,
        tokenizer=(record.get("args") or {}).get(FINGERPRINT_ARG))
    return _Read(result, models, optimizer,
                 record.get("opt_param_scheduler") if load_optim else None)


def _agree_on_errors(error: Optional[str]) -> None:
    errors = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error)
    failed = [e for e in errors if e is not None]
    if failed:
        raise CheckpointError(failed[0])


def load_checkpoint(model_chunks, optimizer, scheduler, configs,
                    run_args: Optional[Dict] = None) -> LoadedCheckpoint:
    """Collective: every rank calls it after building its model, optimizer and scheduler.
    ``run_args`` (this run's flags, ``vars(args)``): the checkpoint's recorded architecture
    must match them (architecture.py), --finetune or not."""
    if configs.training.load is None:
        return LoadedCheckpoint()
    read, error = None, None
    try:
        read = _read(model_chunks, configs, run_args)
    except CheckpointError as exc:
        error = str(exc)
    except Exception as exc:  # e.g. shards that do not fit together: still stop every rank
        error = f"cannot load {configs.training.load}: {type(exc).__name__}: {exc}"
    _agree_on_errors(error)
    if read is None:
        return LoadedCheckpoint(notes=["no checkpoint yet: starting from scratch"])
    with torch.no_grad():
        if isinstance(read.models, ModelReads):  # the sharded format: a tensor at a time
            read.models.apply(model_chunks)
        else:
            for chunk, state in zip(model_chunks, read.models):
                unwrap_model(chunk).load_state_dict(state, strict=True)
    if not restore_histories(model_chunks, read.result.fp8_histories):
        read.result.notes.append("FP8 amax histories not restored (another layout, or none "
                                 "saved): they restart with the first-step rule")
    optimizer.reload_model_params()
    if read.optimizer is not None:
        try:  # these checks see the same values on every rank: all raise alike
            optimizer.load_state_dict(read.optimizer)
            if read.scheduler is not None:
                scheduler.load_state_dict(read.scheduler)
        except ValueError as exc:
            raise CheckpointError(f"{read.result.path}: {exc}") from None
    return read.result
