"""What the memory estimate's modules share: a parameter's shape, the DDP/optimizer setup and
a rank's state by kind. A leaf (it imports no other memory module): params.py, moe.py and
modes.py all build on it, so none of them has to import another that imports it back."""
from dataclasses import dataclass
from typing import Optional

FP32 = 4


@dataclass(frozen=True)
class ParamShape:
    name: str
    numel: int
    rows: int = 0  # size of dim 0 (FSDP2 shards it); 0: a 1-D tensor, rows == numel

    @property
    def dim0(self) -> int:
        return self.rows or self.numel


@dataclass(frozen=True)
class OptimizerSetup:
    """What decides the state's size besides the model: the DDP/optimizer flags."""
    data_parallel_size: int = 1
    use_distributed_optimizer: bool = False
    grad_reduce_in_fp32: bool = False
    bucket_size: Optional[int] = None  # elements; None: one bucket per buffer
    optimizer: str = "adam"  # or "sgd"
    sgd_momentum: float = 0.9
    # Memory modes (modes.py): ZeRO-2 for the distributed optimizer (--shard-gradients),
    # torch FSDP2 (--use-torch-fsdp2; reshard_after_forward False: --no-reshard-after-forward,
    # ZeRO-2), main params and optimizer state on the host (--optimizer-cpu-offload).
    shard_gradients: bool = False
    fsdp2: bool = False
    reshard_after_forward: bool = True
    cpu_offload: bool = False
    fsdp2_reduce_once: bool = False  # TorchFSDP2Config.reduce_gradients_once

    def states_per_element(self) -> int:
        if self.optimizer in ("adam", "muon"):  # Muon's: at most Adam's (see states_of)
            return 2  # exp_avg, exp_avg_sq
        return 1 if self.sgd_momentum else 0

    def has_step_counters(self) -> bool:
        return self.optimizer in ("adam", "muon")

    def _muon_matrix(self, shape: ParamShape) -> bool:
        from megatron.core.optimizer.muon import is_muon_matrix
        return self.optimizer == "muon" and is_muon_matrix(shape.name, 2 if shape.rows else 1)

    def states_of(self, shape: ParamShape) -> int:
        """fp32 state tensors of ``shape``'s size: Muon's matrices keep one momentum, the
        rest of a Muon run (AdamW) two."""
        return 1 if self._muon_matrix(shape) else self.states_per_element()

    def steps_of(self, shape: ParamShape) -> int:
        """Step counters of ``shape`` (Adam's per tensor; none for Muon's matrices)."""
        return int(self.has_step_counters() and not self._muon_matrix(shape))


@dataclass
class ModelStateBytes:
    """One rank's persistent training state, by kind (bytes)."""
    params: int = 0
    grads: int = 0  # DDP gradient buffers (main_grad)
    main_params: int = 0  # fp32 copies of bf16/fp16 params
    main_grads: int = 0  # fp32 copies of bf16/fp16 gradients for the update
    optimizer_states: int = 0  # Adam m, v (SGD momentum)
    step_counters: int = 0  # Adam's per-tensor step
    fp8_weights: int = 0  # FP8 layers' cached quantized weights (fp8/linear.py)

    @property
    def total(self) -> int:
        return (self.params + self.grads + self.main_params + self.main_grads +
                self.optimizer_states + self.step_counters + self.fp8_weights)
