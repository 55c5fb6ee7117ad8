"""Settings every tensor-parallel layer needs; TransformerConfig extends it."""
from dataclasses import dataclass
from typing import Optional

import torch


@dataclass
class ModelParallelConfig:
    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    virtual_pipeline_model_parallel_size: Optional[int] = None
    # Shard LayerNorm/dropout activations along the sequence across TP ranks (Korthikanti et al.).
    sequence_parallel: bool = False
    params_dtype: torch.dtype = torch.float32
    # False when weights will be loaded anyway (skips the master-weight init).
    perform_initialization: bool = True

