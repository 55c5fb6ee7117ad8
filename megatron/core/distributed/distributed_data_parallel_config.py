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
    # With the distributed optimizer: all-gather updated parameters in the background after
    # the step; each module's forward waits only for its own bucket.
    overlap_param_gather: bool = False
    # With the distributed optimizer: once the optimizer takes the reduced gradients, keep
    # only this rank's shard of each bucket and free the full bucket until the next
    # iteration's zero_grad_buffer() (ZeRO-2, --shard-gradients; see param_and_grad_buffer).
    shard_gradients: bool = False
    # HSDP (--num-distributed-optimizer-instances): the sharded optimizer (or FSDP2) is cut
    # into this many instances, each sharding over DP x CP / N ranks, all-reduced across
    # them. The groups are parallel_state's (optimizer_instances.py); this must match them.
    num_distributed_optimizer_instances: int = 1
    # With the distributed optimizer: the FP8 linears' and experts' weights (tensorwise,
    # blockwise, delayed) are all-gathered as FP8 bytes after the step, half bf16's
    # (--fp8-param-gather; fp8/param_gather.py).
    fp8_param_gather: bool = False

    def __post_init__(self):
        if self.bucket_size is not None and self.bucket_size < 1:
            raise ValueError(f"--ddp-bucket-size must be >= 1 element, got {self.bucket_size}.")
        if self.overlap_param_gather and not self.use_distributed_optimizer:
            raise ValueError("overlapping the parameter all-gather needs the distributed "
                             "optimizer (--use-distributed-optimizer).")
        if self.num_distributed_optimizer_instances > 1 and not (
                self.use_distributed_optimizer or getattr(self, "use_torch_fsdp2", False)):
            raise ValueError("--num-distributed-optimizer-instances shards within each "
                             "instance: it needs --use-distributed-optimizer or "
                             "--use-torch-fsdp2.")
        if self.fp8_param_gather and not self.use_distributed_optimizer:
            raise ValueError("--fp8-param-gather all-gathers the distributed optimizer's "
                             "updated shards: it needs --use-distributed-optimizer.")
        if self.shard_gradients and not self.use_distributed_optimizer:
            raise ValueError("--shard-gradients needs --use-distributed-optimizer or "
                             "--overlapped-distributed-optimizer (only the distributed "
                             "optimizer reduce-scatters gradients into shards).")


def ddp_config_for_optimizer(optimizer_config, grad_reduce_in_fp32: bool = False,
                             overlap_grad_reduce: bool = False,
                             bucket_size: Optional[int] = None,
                             reduce_bucket_size: int = 500_000_000,
                             shard_gradients: bool = False,
                             num_distributed_optimizer_instances: int = 1,
                             fp8_param_gather: bool = False
                             ) -> DistributedDataParallelConfig:
    """The DDP settings an optimizer config implies. ``--overlapped-distributed-optimizer``
    (Megatron-LLaMA's) is the distributed optimizer with the gradient reduce-scatter and the
    parameter all-gather both overlapped, in buckets of ``--reduce-bucket-size`` elements.
    ``shard_gradients`` (ZeRO-2) composes with either distributed optimizer."""
    if optimizer_config.overlapped_distributed_optimizer:
        return DistributedDataParallelConfig(
            grad_reduce_in_fp32=grad_reduce_in_fp32, overlap_grad_reduce=True,
            bucket_size=reduce_bucket_size, use_distributed_optimizer=True,
            overlap_param_gather=True, shard_gradients=shard_gradients,
            num_distributed_optimizer_instances=num_distributed_optimizer_instances,
            fp8_param_gather=fp8_param_gather)
    return DistributedDataParallelConfig(
        grad_reduce_in_fp32=grad_reduce_in_fp32, overlap_grad_reduce=overlap_grad_reduce,
        bucket_size=bucket_size,
        use_distributed_optimizer=optimizer_config.use_distributed_optimizer,
        shard_gradients=shard_gradients,
        num_distributed_optimizer_instances=num_distributed_optimizer_instances,
        fp8_param_gather=fp8_param_gather)
