"""``pretrain()``: Megatron's entry point. Flags -> configs (every check before any work) ->
distributed start -> model, optimizer, LR schedule -> data -> the training loop with logging,
evaluation and the exit conditions."""
import inspect
import os
import signal
import sys
import time
from functools import partial
from typing import Callable, List, Optional, Sequence

import torch.distributed as dist

from megatron.core import device, parallel_state
from megatron.core.datasets.indexed_dataset import IndexedDatasetError
from megatron.core.enums import ModelType
from megatron.core.optimizer import OptimizerParamScheduler, get_megatron_optimizer
from megatron.core.optimizer.qk_clip import QKClip
from megatron.core.transformer.gated_linear_unit import GATED_ACTIVATIONS
from megatron.core.transformer.sliding_window import layer_windows
from megatron.training.arguments import ConfigError, build_configs, parse_args
from megatron.training.arguments.configs import check_training_microbatches
from megatron.training.checkpointing import (
    CheckpointError,
    CheckpointWriter,
    LoadedCheckpoint,
    load_checkpoint,
    save_checkpoint,
)
from megatron.training.checkpointing.checkpoint_args import use_checkpoint_args
from megatron.training.checkpointing.preflight import (
    check_checkpoint_start,
    record_tokenizer_fingerprint,
)
from megatron.training.data.batch import stage_needs_data
from megatron.training.data.corpus_tokenizer import check_corpus_tokenizers
from megatron.training.data.samplers import (
    DataLoaderStalled,
    build_pretraining_data_loader,
    cyclic_iter,
)
from megatron.training.guards import fault_injection
from megatron.training.guards.errors import exit_with_error, is_reporting_rank, report_error
from megatron.training.guards.exit_signal import (
    SIGINT_EXIT_CODE,
    ExitSignal,
    install_sigint_handler,
    interrupted,
)
from megatron.training.guards.nan_guard import NanGuard
from megatron.training.guards.token_guard import (
    TokenGuard,
    TokenIdError,
    check_datasets_at_start,
    set_token_guard,
)
from megatron.training.initialize import expert_sizes, initialize_megatron
from megatron.training.logging.deferred import resolve_reports
from megatron.training.logging.flops import latent_attention_of, num_floating_point_operations
from megatron.training.logging.moe_metrics import gather_moe_metrics
from megatron.training.logging.mtp_metrics import gather_mtp_metrics
from megatron.training.logging.pipeline_tracing import finish_trace, start_trace
from megatron.training.logging.timers import Timers, set_timers
from megatron.training.logging.run_summary import closing_line, parameter_counts, start_block
from megatron.training.logging.training_log import TrainingLogger, is_last_rank
from megatron.training.logging.wandb_log import resolve_save_dir
from megatron.training.memory.estimate import optimizer_setup_from, report_theoretical_memory
from megatron.training.memory.modes import mode_name
from megatron.training.planner.moe_cost import effective_ffn_hidden_size
from megatron.training.tokenizer.build import build_tokenizer_from_args
from megatron.training.tokenizer.fingerprint import fingerprint_from_args
from megatron.training.training import build_model, evaluate, train_step
from megatron.training.training_config import H100_BF16_PEAK_TFLOPS

_SILENT_RANK_GRACE_S = 1.0


def _configs_or_exit(argv: Optional[Sequence[str]]):
    """Parse and validate everything; on a problem print one message and exit non-zero."""
    try:
        args = parse_args(argv, before_checks=use_checkpoint_args)  # before configs exist
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
        build_configs(args, world_size)  # flags and files, before the tokenizer is loaded
        check_training_microbatches(args)
        tokenizer = build_tokenizer_from_args(args)
        return args, build_configs(args, world_size, tokenizer), tokenizer
    except (ConfigError, CheckpointError, ValueError, FileNotFoundError, PermissionError,
            NotADirectoryError, IsADirectoryError) as exc:
        report_error(exc)  # rank 0 says it; every rank exits alike
        if not is_reporting_rank():
            # The first worker to exit makes torchrun SIGTERM the others: leave rank 0 the
            # moment it needs to print the line everyone is here to read.
            time.sleep(_SILENT_RANK_GRACE_S)
        sys.exit(2)


def _with_configs(fn: Callable, configs) -> Callable:
    """Pass ``configs`` to script functions that ask for it (Megatron's use get_args())."""
    return partial(fn, configs=configs) if "configs" in inspect.signature(fn).parameters else fn


def _iterators(dataset, configs, consumed_samples: int, cyclic: bool, chunks: int):
    """One data iterator per model chunk, each yielding the same micro batches; None for a
    chunk that reads no data (TP ranks > 0 receive the batch; middle pipeline stages need
    none), so no loader or worker process is started for it. Skipping those changes no
    order: every chunk's loader has its own sampler from ``consumed_samples``."""
    if dataset is None:
        return None
    iterators = [None] * chunks
    for chunk in range(chunks):
        if _chunk_reads_data(configs, chunk):
            loader = _data_loader(dataset, configs, consumed_samples)
            iterators[chunk] = cyclic_iter(loader) if cyclic else iter(loader)
    return iterators if chunks > 1 else iterators[0]


def _chunk_reads_data(configs, chunk: int) -> bool:
    if parallel_state.get_tensor_model_parallel_rank() != 0:
        return False
    with parallel_state.in_model_chunk(chunk):
        return stage_needs_data(configs.dataset.reset_position_ids,
                                configs.dataset.reset_attention_mask)


def _data_loader(dataset, configs, consumed_samples: int):
    """This DP rank's DataLoader: --num-workers worker processes (kept across epochs and
    evaluations), pinned host batches on CUDA (the loader's default there)."""
    t = configs.training
    return build_pretraining_data_loader(
        dataset, consumed_samples, t.dataloader_type, t.micro_batch_size,
        num_workers=t.num_workers, data_parallel_rank=parallel_state.get_data_parallel_rank(),
        data_parallel_size=parallel_state.get_data_parallel_world_size(), seed=t.seed)


def _log_moe(logger, model, configs, iteration: int) -> None:
    """Every rank (a collective): the MoE layers' losses and expert load since the last log."""
    transformer = configs.transformer
    if transformer.moe is not None:
        logger.log_moe(iteration, gather_moe_metrics(
            model, transformer.num_layers + (transformer.mtp_num_layers or 0),
            transformer.moe.num_moe_experts,
            transformer.tensor_model_parallel_size * transformer.context_parallel_size,
            transformer.moe.moe_expert_capacity_factor))


def _flops(configs, args) -> int:
    tc = configs.transformer
    return num_floating_point_operations(
        tc.num_layers, tc.hidden_size, effective_ffn_hidden_size(tc), tc.num_attention_heads,
        tc.num_query_groups, args.seq_length, configs.model_kwargs["padded_vocab_size"],
        configs.training.global_batch_size, tc.activation in GATED_ACTIVATIONS, tc.kv_channels,
        windows=layer_windows(tc, with_mtp=True), latent_attention=latent_attention_of(tc),
        mtp_num_layers=tc.mtp_num_layers or 0)


# A user's mistake that can escape before or during training: one error line, no traceback.
USER_ERRORS = (ConfigError, IndexedDatasetError, TokenIdError, device.DeviceSetupError,
               CheckpointError, FileNotFoundError, PermissionError, IsADirectoryError,
               NotADirectoryError)


class _Progress:
    """Where the run is, for the message of an error or an interrupt."""

    def __init__(self):
        self.training = False  # the loop started: a failure now is a run failure (exit 1)
        self.iteration = 0
        self.saved = None  # the last iteration saved (or loaded), None if none
        self.save_dir = None


def pretrain(train_valid_test_datasets_provider: Callable, model_provider: Callable,
             model_type: ModelType, forward_step_func: Callable,
             argv: Optional[Sequence[str]] = None) -> List[dict]:
    """Train as the flags say (Megatron's signature). Returns the per-iteration reported
    losses (last stage). A user's mistake exits with one error line (2 when found before
    training, 1 during it); Ctrl-C with one line and 130 (see guards/exit_signal.py)."""
    if model_type is not ModelType.encoder_or_decoder:
        raise ValueError(f"model_type {model_type} is not supported: only "
                         f"ModelType.encoder_or_decoder (GPT/LLaMA) models are.")
    progress = _Progress()
    previous_sigint = install_sigint_handler()
    try:
        return _pretrain(train_valid_test_datasets_provider, model_provider,
                         forward_step_func, argv, progress)
    except KeyboardInterrupt:
        _exit_interrupted(progress)
    except DataLoaderStalled as exc:  # this rank alone: its peers wait in a collective
        exit_with_error(exc, 1, shutdown=False)
    except USER_ERRORS as exc:
        if interrupted():  # what the Ctrl-C broke on its way out
            _exit_interrupted(progress)
        exit_with_error(exc, 1 if progress.training else 2)
    except Exception:
        if interrupted():  # e.g. a peer that stopped closed the connection of a collective
            _exit_interrupted(progress)
        raise
    finally:
        set_token_guard(None)
        signal.signal(signal.SIGINT, previous_sigint)


def _exit_interrupted(progress: _Progress) -> None:
    """One line from rank 0, exit 130; no teardown (peers may be inside a collective)."""
    where = f"at iteration {progress.iteration}" if progress.training else "before training"
    if progress.saved is not None:
        kept = f"the last checkpoint is iteration {progress.saved} in {progress.save_dir}"
    else:
        kept = "no checkpoint was saved"
    report_error(f"interrupted (SIGINT) {where}: {kept}; run with --exit-signal-handler to "
                 f"save before stopping on SIGINT/SIGTERM, and --load to resume.")
    sys.exit(SIGINT_EXIT_CODE)


def _pretrain(train_valid_test_datasets_provider: Callable, model_provider: Callable,
              forward_step_func: Callable, argv: Optional[Sequence[str]],
              progress: _Progress) -> List[dict]:
    args, configs, tokenizer = _configs_or_exit(argv)
    t = configs.training
    start_time = time.time()
    # --device cuda on a machine without one: a launch mistake, found before any work.
    device.check_requested_device(t.device, source=f"--device {t.device}")
    initialize_megatron(args.tensor_model_parallel_size, args.pipeline_model_parallel_size,
                        args.virtual_pipeline_model_parallel_size, t.seed, t.device,
                        t.distributed_timeout_minutes, args.context_parallel_size,
                        *expert_sizes(configs.transformer),
                        configs.ddp.num_distributed_optimizer_instances)
    vocab_size = configs.model_kwargs["vocab_size"]
    # Each corpus's tokenizer sidecar against this run's tokenizer, before any model is built.
    sidecar_checked = check_corpus_tokenizers(
        args, fingerprint_from_args(args, tokenizer), vocab_size)
    model = build_model(_with_configs(model_provider, configs), configs.transformer,
                        configs.ddp, t.seed)
    optimizer = get_megatron_optimizer(configs.optimizer, model)
    if dist.get_rank() == 0:
        print(report_theoretical_memory(configs, args.seq_length, device.device_type()),
              flush=True)
    configs.transformer.grad_scale_func = optimizer.scale_loss
    scheduler = OptimizerParamScheduler(optimizer, **configs.scheduler_kwargs)
    record_tokenizer_fingerprint(args, tokenizer)  # the load compares its vocabulary size
    resumed = _load_or_exit(model, optimizer, scheduler, configs, vars(args))
    check_checkpoint_start(args, configs, model, resumed, tokenizer)  # --save, tokenizer
    progress.iteration = resumed.iteration
    if resumed.path:
        progress.saved, progress.save_dir = resumed.iteration, t.load

    gbs = t.global_batch_size
    # Megatron's rule: whole global batches (a remainder of samples is not trained on).
    train_iters = t.train_iters or t.train_samples // gbs
    if resumed.iteration >= train_iters:
        if dist.get_rank() == 0:
            print(f"nothing to do: the checkpoint is at iteration {resumed.iteration} and "
                  f"training stops at {train_iters}.", flush=True)
        return []
    evals = train_iters // t.eval_interval + 1 if t.eval_interval else 0
    samples_needed = [train_iters * gbs, evals * t.eval_iters * gbs, t.eval_iters * gbs]
    datasets = _with_configs(train_valid_test_datasets_provider, configs)(samples_needed)
    # A bounded read of each .bin that no sidecar vouched for.
    check_datasets_at_start(datasets, vocab_size, checked=sidecar_checked)
    counts = parameter_counts(model)  # collective
    if dist.get_rank() == 0:
        memory_mode = mode_name(optimizer_setup_from(
            configs.ddp, configs.optimizer, t.data_parallel_size,
            configs.transformer.context_parallel_size))
        print("\n".join(start_block(args, configs, counts, datasets, samples_needed,
                                    train_iters, memory_mode, dist.get_world_size())),
              flush=True)
    token_guard = TokenGuard(vocab_size, datasets)
    set_token_guard(token_guard)
    # Before the loaders fork their workers: a Ctrl-C reaches them too (the terminal signals
    # the whole process group), and with the handler inherited they keep serving batches to
    # the iteration that finishes before the save.
    exit_signal = ExitSignal(t.exit_signal_handler)
    chunks = len(model)
    train_iter = _iterators(datasets[0], configs, resumed.consumed_train_samples,
                            t.dataloader_type == "cyclic", chunks)
    valid_iter = _iterators(datasets[1], configs, resumed.consumed_valid_samples, True, chunks)
    forward_step = _with_configs(forward_step_func, configs)

    num_micro = gbs // (t.micro_batch_size * t.data_parallel_size)
    # Read (and the device synchronised) only at --log-interval, by the logger.
    timers = Timers(t.timing_log_level, t.timing_log_option)
    set_timers(timers)  # for the script's forward step (batch-generator)
    logger = TrainingLogger(train_iters, gbs, args.seq_length, dist.get_world_size(),
                            flops_per_iteration=_flops(configs, args),
                            peak_tflops=_known_peak_tflops(t.peak_tflops),
                            log_interval=t.log_interval, tensorboard_dir=t.tensorboard_dir,
                            tensorboard_queue_size=t.tensorboard_queue_size,
                            log_timers_to_tensorboard=t.log_timers_to_tensorboard,
                            log_batch_size_to_tensorboard=t.log_batch_size_to_tensorboard,
                            log_validation_ppl_to_tensorboard=t.log_validation_ppl_to_tensorboard,
                            log_learning_rate_to_tensorboard=t.log_learning_rate_to_tensorboard,
                            log_loss_scale_to_tensorboard=t.log_loss_scale_to_tensorboard,
                            log_throughput=t.log_throughput, timers=timers,
                            wandb_project=t.wandb_project, wandb_exp_name=t.wandb_exp_name,
                            wandb_save_dir=resolve_save_dir(t.wandb_save_dir, t.save),
                            wandb_config=vars(args),
                            fp8_peak_tflops=_fp8_peak_tflops(configs, t.peak_tflops))
    logger.start(first_iteration=resumed.iteration + 1)
    loop_start = time.time()
    checkpoints = _Checkpoints(model, optimizer, scheduler, configs, vars(args), token_guard,
                               progress)
    consumed_train, consumed_valid = resumed.consumed_train_samples, \
        resumed.consumed_valid_samples
    history, iteration, validation = [], resumed.iteration, None
    token_guard.checked_at = iteration
    nan_guard = NanGuard(t.check_for_nan_in_loss_and_grad, t.max_consecutive_nan_iterations)
    qk_clip = QKClip.for_model(model)  # --qk-clip, --log-max-attention-logit: else None
    resumed.restore_rng(t.seed)
    progress.training = True
    try:
        while iteration < train_iters:
            iteration += 1
            progress.iteration = iteration
            fault_injection.maybe_kill_at(iteration)  # tests only
            trace = start_trace(iteration, t, num_micro)  # None unless --pipeline-trace-dir
            losses, skipped, grad_norm, num_zeros = train_step(
                forward_step, train_iter, model, optimizer, scheduler, num_micro,
                args.seq_length, t.micro_batch_size,
                partial(fault_injection.maybe_poison_gradients, iteration=iteration), trace=trace,
                timers=timers, qk_clip=qk_clip)
            finish_trace(trace, t)
            consumed_train += gbs
            history.append(losses)  # on the device: the logger reads them at --log-interval
            # --log-params-norm: the main params' norm where it is logged (a collective)
            params_norm = optimizer.params_norm() \
                if t.log_params_norm and logger.reports(iteration) else None
            logger.training_log(iteration, losses, optimizer.param_groups[0]["lr"],
                                optimizer.get_loss_scale(), skipped_iter=skipped,
                                grad_norm=grad_norm, num_zeros=num_zeros,
                                params_norm=params_norm,
                                consumed_samples=consumed_train,
                                max_attention_logit=None if qk_clip is None
                                else qk_clip.max_logit)
            if iteration % t.log_interval == 0:  # the logger just synchronized anyway
                token_guard.check(iteration)
                _log_moe(logger, model, configs, iteration)
                if configs.transformer.mtp_num_layers:
                    logger.log_mtp(iteration, gather_mtp_metrics(
                        model, configs.transformer.mtp_num_layers))
            checkpoints.poll()
            if nan_guard.check(iteration, grad_norm, losses):
                checkpoints.save(iteration, consumed_train, consumed_valid)  # the last good state
                checkpoints.wait()
                _exit_with(nan_guard.stop_message(iteration, t.save), code=1)
            # Every rank evaluates (TP ranks > 0 and middle stages hold no iterator but
            # join the schedule's collectives), so ask about the dataset, not the iterator.
            if t.eval_interval and datasets[1] is not None and \
                    iteration % t.eval_interval == 0:
                validation = _validate(logger, iteration, forward_step, valid_iter, model, t,
                                       num_micro, args.seq_length)
                consumed_valid += t.eval_iters * gbs
            if t.save_interval and iteration % t.save_interval == 0:
                checkpoints.save(iteration, consumed_train, consumed_valid)
            if (t.exit_interval and iteration % t.exit_interval == 0) or (
                    t.exit_duration_in_mins and
                    _minutes_elapsed(start_time) > t.exit_duration_in_mins):
                break
            received = exit_signal.received_on_any_rank()
            if received:
                if dist.get_rank() == 0:
                    print(f"received {received}: saving at iteration {iteration} and exiting",
                          flush=True)
                break
        token_guard.check(iteration)  # a run never ends "successfully" on bad data
        checkpoints.save(iteration, consumed_train, consumed_valid)  # unless just saved
        checkpoints.wait()
        if t.eval_iters and datasets[1] is not None and iteration == train_iters and \
                iteration > resumed.iteration and \
                (validation is None or validation[0] != iteration):
            # Megatron's validation after training, after the last save (so a resumed run's
            # validation data is the uninterrupted run's), and not on an early exit: a short
            # run (fewer iterations than --eval-interval) still reports one.
            validation = _validate(logger, iteration, forward_step, valid_iter, model, t,
                                   num_micro, args.seq_length)
    except TokenIdError as exc:  # every rank agreed (TokenGuard.check's all-reduce)
        checkpoints.wait()  # a save in flight holds a state checked clean
        _exit_with(exc, code=1)
    except CheckpointError as exc:  # seen by every rank at the same point
        _exit_with(exc, code=1)
    finally:  # an error exit too: TensorBoard's queue written, the W&B run finished
        logger.close()
    set_timers(None)
    resolve_reports(history)  # those the logger has not read, at once
    values = [report.value() for report in history]
    if is_last_rank():  # it holds the losses
        print(closing_line(resumed.iteration, iteration, gbs * args.seq_length,
                           time.time() - loop_start, values[-1] if values else None,
                           validation,
                           progress.saved, progress.save_dir), flush=True)
    return values


def _validate(logger, iteration: int, forward_step, valid_iter, model, t, num_micro: int,
              seq_length: int):
    """Evaluate, print Megatron's validation block; (iteration, {name: loss}) for the end."""
    losses = evaluate(forward_step, valid_iter, model, t.eval_iters, num_micro, seq_length,
                      t.micro_batch_size)
    logger.log_validation(iteration, losses)
    return iteration, {name: float(value) for name, value in losses.items()}


def _known_peak_tflops(peak_tflops: Optional[float]) -> Optional[float]:
    """The per-device peak MFU is computed against, or None where it is unknown: --peak-tflops,
    else an H100's on CUDA; on CPU no default (an H100's would print a meaningless 0.00)."""
    if peak_tflops is not None:
        return peak_tflops
    return H100_BF16_PEAK_TFLOPS if device.device_type() == "cuda" else None


def _fp8_peak_tflops(configs, peak_tflops: Optional[float]) -> Optional[float]:
    """An FP8 run's per-device FP8 peak: twice the bf16 peak (dense, Ada / Hopper /
    Blackwell: 1979 TFLOP/s on an H100 SXM); None without FP8 or a known peak."""
    peak = _known_peak_tflops(peak_tflops)
    if configs.transformer.fp8 is None or peak is None:
        return None
    return 2 * peak


def _exit_with(exc: Exception, code: int) -> None:
    """Every caller's error is seen by all ranks at the same point (agreed load errors, the
    NaN guard's stop, a save that failed everywhere), so the groups can be torn down."""
    exit_with_error(exc, code)


def _load_or_exit(model, optimizer, scheduler, configs, run_args: dict) -> LoadedCheckpoint:
    try:
        resumed = load_checkpoint(model, optimizer, scheduler, configs, run_args)
    except CheckpointError as exc:
        _exit_with(exc, code=1)
    if dist.get_rank() == 0 and configs.training.load is not None:
        if resumed.path is None:  # nothing loaded: say only that
            print(f"no checkpoint in {configs.training.load} yet: starting from scratch",
                  flush=True)
        else:
            notes = "".join(f"; {n}" for n in resumed.notes)
            print(f"loaded checkpoint from {resumed.path} at iteration {resumed.iteration}"
                  f"{notes}", flush=True)
    return resumed


class _Checkpoints:
    """The loop's saves: at --save-interval, at the end (once per iteration), in the
    background with --async-save. A save first checks the token guard (collective), so no
    state trained on ids outside the vocabulary is saved."""

    def __init__(self, model, optimizer, scheduler, configs, args: dict,
                 token_guard: TokenGuard, progress: _Progress):
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
        self.configs, self.args = configs, args
        self.token_guard, self.progress = token_guard, progress
        self.writer = CheckpointWriter(configs.training.async_save)
        self.last_saved = None

    def save(self, iteration: int, consumed_train: int, consumed_valid: int) -> None:
        root = self.configs.training.save
        if root is None or iteration == self.last_saved or iteration == 0:
            return
        self.token_guard.check(iteration)
        save_checkpoint(root, iteration, self.model, self.optimizer, self.scheduler,
                        self.configs, {**self.args, "iteration": iteration,
                                       "consumed_train_samples": consumed_train,
                                       "consumed_valid_samples": consumed_valid},
                        consumed_train, consumed_valid, self.writer)
        self.last_saved = iteration
        self.progress.saved, self.progress.save_dir = iteration, root
        if dist.get_rank() == 0:
            mode = "started (async)" if self.writer.async_save else "saved"
            print(f"checkpoint of iteration {iteration} {mode} in {root}", flush=True)

    def poll(self) -> None:
        self.writer.poll()

    def wait(self) -> None:
        self.writer.wait()


def _minutes_elapsed(start_time: float) -> float:
    """The slowest rank's view, so every rank stops at the same iteration."""
    elapsed = device.tensor([(time.time() - start_time) / 60.0])  # nccl needs it on GPU
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return elapsed.item()
