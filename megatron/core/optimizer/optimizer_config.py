"""Optimizer settings (Megatron's flag names in the comments)."""
from dataclasses import dataclass
from typing import Optional

import torch


@dataclass
class OptimizerConfig:
    """``sharded`` is True for either distributed optimizer."""
    # --optimizer adam|sgd|muon (adam has AdamW's decoupled weight decay; muon: muon.py)
    optimizer: str = "adam"
    lr: float = 1e-4  # --lr (the scheduler overwrites it every step)
    min_lr: float = 0.0  # --min-lr
    weight_decay: float = 0.01  # --weight-decay
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    sgd_momentum: float = 0.9
    # Muon (--optimizer muon; see muon.py): --muon-* flags. The rest of the parameters use
    # --muon-scalar-optimizer (adam: AdamW with the --adam-* settings).
    muon_momentum: float = 0.95
    muon_use_nesterov: bool = False
    muon_num_ns_steps: int = 5
    muon_scale_mode: str = "spectral"
    muon_extra_scale_factor: float = 1.0
    muon_split_qkv: bool = False
    muon_tp_mode: str = "duplicated"
    muon_scalar_optimizer: str = "adam"
    muon_ns_dtype: torch.dtype = torch.float32  # --muon-ns-dtype fp32|bf16
    # Mixed precision: model params in fp16 or bf16, fp32 main params in the optimizer.
    fp16: bool = False
    bf16: bool = False
    params_dtype: torch.dtype = torch.float32
    # Loss scaling: a constant --loss-scale, or (fp16 without it) dynamic scaling.
    loss_scale: Optional[float] = None
    initial_loss_scale: float = 2.0 ** 32
    min_loss_scale: float = 1.0
    loss_scale_window: float = 1000
    hysteresis: int = 2
    clip_grad: float = 1.0  # --clip-grad (global L2 norm; 0 disables)
    log_num_zeros_in_grad: bool = False
    # Skip the update when the global gradient norm is not finite (NaN/inf in any gradient).
    check_for_nan_in_grad: bool = True
    use_distributed_optimizer: bool = False  # --use-distributed-optimizer (ZeRO-1)
    # --overlapped-distributed-optimizer: ZeRO-1 with overlapped reduce-scatter / all-gather.
    overlapped_distributed_optimizer: bool = False
    # --optimizer-cpu-offload: fp32 main params and optimizer state in host memory, the step
    # on the host (see cpu_offload.py).
    optimizer_cpu_offload: bool = False

    def __post_init__(self):
        if self.optimizer not in ("adam", "sgd", "muon"):
            raise ValueError(f"--optimizer {self.optimizer!r}: use 'adam', 'sgd' or 'muon'.")
        if self.optimizer == "muon":
            self._check_muon()
        if self.use_distributed_optimizer and self.overlapped_distributed_optimizer:
            raise ValueError("--use-distributed-optimizer and --overlapped-distributed-optimizer"
                             " are mutually exclusive; pick one (the overlapped one is the "
                             "distributed optimizer with its communication overlapped).")
        if self.fp16 and self.bf16:
            raise ValueError("--fp16 and --bf16 are exclusive; pick one.")
        for flag, value in (("--lr", self.lr), ("--min-lr", self.min_lr),
                            ("--weight-decay", self.weight_decay)):
            if value < 0:
                raise ValueError(f"{flag} must be >= 0, got {value}.")
        for flag, value in (("--adam-beta1", self.adam_beta1), ("--adam-beta2", self.adam_beta2)):
            if not 0 <= value < 1:
                raise ValueError(f"{flag} must be in [0, 1), got {value}.")
        if self.adam_eps <= 0:
            raise ValueError(f"--adam-eps must be > 0, got {self.adam_eps}.")
        if self.loss_scale is not None and self.loss_scale <= 0:
            raise ValueError(f"--loss-scale must be > 0, got {self.loss_scale}.")
        if self.clip_grad < 0:
            raise ValueError(f"--clip-grad must be >= 0, got {self.clip_grad}.")
        if self.loss_scale_window < 1:
            raise ValueError(f"--loss-scale-window must be >= 1, got {self.loss_scale_window}.")
        if self.hysteresis < 1:
            raise ValueError(f"--hysteresis must be >= 1, got {self.hysteresis}.")
        if self.min_loss_scale <= 0 or self.initial_loss_scale < self.min_loss_scale:
            raise ValueError("need 0 < --min-loss-scale <= --initial-loss-scale.")

    def _check_muon(self) -> None:
        from megatron.core.optimizer.muon import SCALE_MODES  # muon imports parallel_state
        if not 0 <= self.muon_momentum < 1:
            raise ValueError(f"--muon-momentum must be in [0, 1), got {self.muon_momentum}.")
        if self.muon_num_ns_steps < 1:
            raise ValueError(f"--muon-num-ns-steps must be >= 1, got "
                             f"{self.muon_num_ns_steps}.")
        if self.muon_scale_mode not in SCALE_MODES:
            raise ValueError(f"--muon-scale-mode {self.muon_scale_mode!r}: use one of "
                             f"{', '.join(SCALE_MODES)}.")
        if not self.muon_extra_scale_factor > 0:
            raise ValueError(f"--muon-extra-scale-factor must be > 0, got "
                             f"{self.muon_extra_scale_factor}.")
        if self.muon_tp_mode == "blockwise":
            raise ValueError("--muon-tp-mode blockwise orthogonalizes each TP shard alone: "
                             "another update than one process's, which changes with the TP "
                             "size; use --muon-tp-mode duplicated (the whole matrix).")
        if self.muon_tp_mode != "duplicated":
            raise ValueError(f"--muon-tp-mode {self.muon_tp_mode!r} is not built: a "
                             "distributed Newton-Schulz moves about 10x the bytes of the "
                             "one all-gather of duplicated; use --muon-tp-mode duplicated.")
        if self.muon_scalar_optimizer != "adam":
            raise ValueError(f"--muon-scalar-optimizer {self.muon_scalar_optimizer!r}: only "
                             "'adam' (AdamW) is built for the non-matrix parameters.")
        if self.muon_ns_dtype not in (torch.float32, torch.bfloat16):
            raise ValueError("--muon-ns-dtype: use fp32 or bf16.")
        if self.overlapped_distributed_optimizer:
            raise ValueError("--optimizer muon with --overlapped-distributed-optimizer is not "
                             "built yet; use --use-distributed-optimizer.")
        if self.optimizer_cpu_offload:
            raise ValueError("--optimizer muon with --optimizer-cpu-offload is not built yet; "
                             "drop --optimizer-cpu-offload.")

    @property
    def sharded(self) -> bool:
        return self.use_distributed_optimizer or self.overlapped_distributed_optimizer
