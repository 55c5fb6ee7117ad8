"""Reading a parameter outside its owner module's forward.

Under the overlapped parameter all-gather (``overlap_param_gather``) a parameter holds this
step's values only once its bucket's all-gather has been waited for, and DDP waits in the
forward pre-hook of the module that owns it. Code that reads a parameter anywhere else (a tied
or shared weight used by another module, multi-token prediction's lookup table on the last
pipeline stage, any ``.weight`` handed to a function) takes it through ``gathered()``, which
waits for that parameter's bucket first. On gloo a missed wait reads last step's rows; on
nccl it is a race with no stream dependency (tests/nccl_faithful.py makes it visible on CPU).
"""
import torch

WAIT_ATTR = "wait_gathered"  # set by DistributedDataParallel on each overlapped parameter


def gathered(param: torch.Tensor) -> torch.Tensor:
    """``param``, after its pending all-gather (if any) has completed."""
    wait = getattr(param, WAIT_ATTR, None)
    if wait is not None:
        wait()
    return param
