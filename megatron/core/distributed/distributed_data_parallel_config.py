"""How gradients are kept and reduced over data-parallel ranks."""
from dataclasses import dataclass
from typing import Optional


@dataclass
class DistributedDataParallelConfig:
    # Accumulate and all-reduce gradients in fp32 (--accumulate-allreduce-grads-in-fp32).
    grad_reduce_in_fp32: bool = False
    # Launch each bucket's all-reduce from the backward pass as soon as the bucket is complete
    # on the last microbatch (--overlap-grad-reduce).
    overlap_grad_reduce: bool = False
    # Elements per bucket (--ddp-bucket-size); None: Megatron's default when overlapping
    # (max(40M, 1M x DP)), one bucket per buffer otherwise.
    bucket_size: Optional[int] = None
    # Reduce-scatter instead of all-reduce; each rank's optimizer owns a shard (ZeRO-1).
    use_distributed_optimizer: bool = False

    def __post_init__(self):
        if self.bucket_size is not None and self.bucket_size < 1:
            raise ValueError(f"--ddp-bucket-size must be >= 1 element, got {self.bucket_size}.")
