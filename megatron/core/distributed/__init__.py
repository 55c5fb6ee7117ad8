"""Data parallelism: gradient buffers, buckets, overlapped reduction, gradient finalisation."""
from megatron.core.distributed.distributed_data_parallel import DistributedDataParallel
from megatron.core.distributed.distributed_data_parallel_config import (
    DistributedDataParallelConfig,
    ddp_config_for_optimizer,
)
from megatron.core.distributed.finalize_model_grads import finalize_model_grads
