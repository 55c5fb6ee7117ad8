"""The process groups this rank belongs to, by kind, and the global ranks of each: one registry
for parallel_state's groups and expert_parallel_state's (so destroy_model_parallel forgets
both). A leaf (no other megatron import): parallel_state imports expert_parallel_state, both
import this, and neither has to import the other back. parallel_state makes, records and
destroys the groups; expert_parallel_state only reads them.
"""
from typing import Dict, List

import torch.distributed as dist

GROUPS: Dict[str, dist.ProcessGroup] = {}
GROUP_RANKS: Dict[str, List[int]] = {}
