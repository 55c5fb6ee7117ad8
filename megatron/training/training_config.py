"""The training loop's own settings, and the bundle of configs one launch line produces.

``megatron/training/arguments/`` fills these from Megatron's flags; nothing here knows argparse.
"""
from dataclasses import dataclass, field
from typing import Any, Dict, Optional

from megatron.core.datasets.config import GPTDatasetConfig
from megatron.core.distributed.distributed_data_parallel_config import (
    DistributedDataParallelConfig,
)
from megatron.core.optimizer.optimizer_config import OptimizerConfig
from megatron.core.transformer.transformer_config import TransformerConfig

# Dense BF16 peak of one H100 SXM (NVIDIA's datasheet: 989.4 TFLOPS without sparsity); the
# denominator of MFU unless --peak-tflops says otherwise.
H100_BF16_PEAK_TFLOPS = 989.0


class ConfigError(ValueError):
    """A bad flag or flag combination; the message names the flag(s) and the fix."""


@dataclass
class TrainingConfig:
    """Training-loop knobs: batch, length, eval, checkpoints, logging, device."""
    micro_batch_size: int = 1
    global_batch_size: int = 1
    data_parallel_size: int = 1
    # Exactly one of train_iters / train_samples is set (Megatron's rule).
    train_iters: Optional[int] = None
    train_samples: Optional[int] = None
    eval_interval: int = 1000
    eval_iters: int = 100
    seed: int = 1234
    exit_interval: Optional[int] = None
    exit_duration_in_mins: Optional[float] = None
    exit_signal_handler: bool = False
    check_for_nan_in_loss_and_grad: bool = True
    max_consecutive_nan_iterations: int = 3
    dataloader_type: str = "single"  # single | cyclic
    num_workers: int = 2
    device: Optional[str] = None  # None: auto (megatron.core.device decides)
    distributed_timeout_minutes: int = 10  # every process group's collective timeout
    job_name: Optional[str] = None
    # MFU denominator per device, in TFLOPS; None: an H100's on CUDA, unknown (no MFU) on CPU.
    peak_tflops: Optional[float] = None

    # --- checkpoints ---
    save: Optional[str] = None
    load: Optional[str] = None
    save_interval: Optional[int] = None
    no_save_optim: bool = False
    no_save_rng: bool = False
    no_load_optim: bool = False
    no_load_rng: bool = False
    # Load weights only, start at iteration 0 with fresh optimizer / scheduler / RNG state.
    finetune: bool = False
    ckpt_step: Optional[int] = None  # load this iteration instead of the tracker's
    async_save: bool = False
    ckpt_format: str = "torch_dist"  # torch_dist (sharded, every rank writes) | torch
    skip_disk_space_check: bool = False  # a warning, not an error, when a save cannot fit

    # --- logging ---
    log_interval: int = 100
    tensorboard_dir: Optional[str] = None
    tensorboard_queue_size: int = 1000
    log_timers_to_tensorboard: bool = False
    timing_log_level: int = 0  # 0, 1 or 2: which timers are printed
    timing_log_option: str = "minmax"  # max | minmax | all, across ranks
    log_batch_size_to_tensorboard: bool = False
    log_validation_ppl_to_tensorboard: bool = False
    log_learning_rate_to_tensorboard: bool = True
    log_loss_scale_to_tensorboard: bool = True
    log_params_norm: bool = False
    log_throughput: bool = False
    # W&B (Megatron's flags): a run on the last rank when wandb_project is set; the files go
    # under wandb_save_dir, by default <save>/wandb, else ./wandb.
    wandb_project: Optional[str] = None
    wandb_exp_name: Optional[str] = None
    wandb_save_dir: Optional[str] = None
    # Write each rank's pipeline schedule trace of one iteration here (None: no tracing).
    pipeline_trace_dir: Optional[str] = None
    pipeline_trace_iteration: int = 2

    @property
    def num_microbatches(self) -> int:
        return self.global_batch_size // (self.micro_batch_size * self.data_parallel_size)


@dataclass
class MegatronConfigs:
    """Everything ``pretrain()`` needs, built from one parsed command line."""
    transformer: TransformerConfig
    optimizer: OptimizerConfig
    ddp: DistributedDataParallelConfig
    # Keyword arguments of OptimizerParamScheduler, less ``optimizer`` (steps are samples:
    # the loop steps it by the global batch size, as Megatron does).
    scheduler_kwargs: Dict[str, Any]
    dataset: GPTDatasetConfig
    training: TrainingConfig
    # GPTModel keyword arguments that are not part of TransformerConfig.
    model_kwargs: Dict[str, Any] = field(default_factory=dict)
    # The vocabulary rows a checkpoint keeps: --padded-vocab-size when given (the model's own
    # rows), else the tokenizer's tokens (TP padding depends on the layout); None: the model's.
    checkpoint_vocab_size: Optional[int] = None
