"""Settings every tensor-parallel layer needs; TransformerConfig extends it."""
from dataclasses import dataclass
from typing import Callable, Optional

import torch

PIPELINE_SCHEDULES = ("1f1b", "interleaved", "zb-h1", "zbv")


@dataclass
class ModelParallelConfig:
    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    virtual_pipeline_model_parallel_size: Optional[int] = None
    # "1f1b", "interleaved", "zb-h1" or "zbv" (2 chunks per rank placed in a V, see
    # pipeline_placement); None = Megatron's choice: interleaved iff virtual stages are set.
    pipeline_schedule: Optional[str] = None
    # Shard LayerNorm/dropout activations along the sequence across TP ranks (Korthikanti et al.).
    sequence_parallel: bool = False
    # Split each sequence over this many ranks (load-balanced chunks, ring attention), and
    # how attention sees the other ranks' keys/values: "p2p" (a ring) or "all_gather".
    context_parallel_size: int = 1
    cp_comm_type: str = "p2p"
    # Mixture of experts: the routed experts split over this many ranks (EP), and each
    # expert's weights over expert_tensor_parallel_size ranks (None = the TP size).
    expert_model_parallel_size: int = 1
    expert_tensor_parallel_size: Optional[int] = None
    params_dtype: torch.dtype = torch.float32
    # False when weights will be loaded anyway (skips the master-weight init).
    perform_initialization: bool = True
    # Linear layers add their weight gradient straight into DDP's ``main_grad`` in backward
    # (no weight-sized gradient tensor per microbatch). Only acts on weights that have a
    # main_grad, i.e. inside DDP; --no-gradient-accumulation-fusion turns it off.
    gradient_accumulation_fusion: bool = True

    # --- pipeline schedules ---
    # dtype of the activations and gradients sent between stages (None = params_dtype).
    pipeline_dtype: Optional[torch.dtype] = None
    # Microbatches may differ in sequence length: each send is preceded by its shape.
    variable_seq_lengths: bool = False
    # Free the data of activations once sent to the next stage (only autograd needs them).
    deallocate_pipeline_outputs: bool = True
    # Context manager factory that holds DDP gradient sync (a list: one per model chunk).
    # None uses the chunk's own ``no_sync`` if it has one.
    no_sync_func: Optional[Callable] = None
    # Called with the list of model chunks after the last backward (DP / tied-embedding sync).
    finalize_model_grads_func: Optional[Callable] = None
    # Scales the last stage's loss before backward (mixed-precision loss scaling).
    grad_scale_func: Optional[Callable] = None

    def __post_init__(self):
        if self.cp_comm_type not in ("p2p", "all_gather"):
            raise ValueError(f"cp_comm_type must be 'p2p' or 'all_gather', got "
                             f"{self.cp_comm_type!r}.")
        if self.expert_tensor_parallel_size is None:
            self.expert_tensor_parallel_size = self.tensor_model_parallel_size
        for name in ("tensor_model_parallel_size", "pipeline_model_parallel_size",
                     "context_parallel_size", "expert_model_parallel_size",
                     "expert_tensor_parallel_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}.")
        vpp = self.virtual_pipeline_model_parallel_size
        if vpp is not None and vpp < 1:
            raise ValueError(f"virtual_pipeline_model_parallel_size must be >= 1 (or None), "
                             f"got {vpp}.")
        self._check_pipeline_schedule()

    def _check_pipeline_schedule(self):
        schedule, vpp = self.pipeline_schedule, self.virtual_pipeline_model_parallel_size
        if schedule is None:
            return
        if schedule not in PIPELINE_SCHEDULES:
            raise ValueError(f"pipeline_schedule {schedule!r} is not one of "
                             f"{PIPELINE_SCHEDULES} (or None).")
        wanted = {"1f1b": None, "zb-h1": None, "zbv": 2}
        if schedule == "interleaved":
            if vpp is None:
                raise ValueError("pipeline_schedule 'interleaved' needs "
                                 "virtual_pipeline_model_parallel_size.")
        elif vpp != wanted[schedule]:
            raise ValueError(f"pipeline_schedule {schedule!r} needs "
                             f"virtual_pipeline_model_parallel_size {wanted[schedule]}, "
                             f"got {vpp}.")

    def resolved_pipeline_schedule(self) -> str:
        """The schedule a pipelined run uses: pipeline_schedule, or Megatron's choice."""
        if self.pipeline_schedule is not None:
            return self.pipeline_schedule
        return "1f1b" if self.virtual_pipeline_model_parallel_size is None else "interleaved"
