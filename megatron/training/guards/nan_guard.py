"""``--check-for-nan-in-loss-and-grad``: an update whose gradients are not finite is skipped by
the optimizer (the global norm is checked, so every rank skips alike); this counts such
iterations, and those whose loss is not finite (inf or nan), logs each one, and says when too
many came in a row to go on."""
import math
from typing import List, Mapping, Optional

import torch
import torch.distributed as dist

from megatron.core import device, parallel_state


class NanGuard:
    def __init__(self, enabled: bool, max_in_a_row: int):
        self.enabled, self.max_in_a_row = enabled, max_in_a_row
        self.streak: List[int] = []

    def check(self, iteration: int, grad_norm: Optional[float],
              losses: Optional[Mapping[str, float]] = None) -> bool:
        """Record this iteration; True when the run must stop. Collective under pipeline
        parallelism when enabled (only the last stage holds the loss)."""
        if not self.enabled:
            return False
        bad_grads = grad_norm is not None and not math.isfinite(grad_norm)
        bad_loss = _loss_not_finite(losses)
        if not (bad_grads or bad_loss):
            self.streak = []
            return False
        self.streak.append(iteration)
        if _is_rank_zero():
            what = (f"non-finite gradients (grad norm {grad_norm}): the update was skipped"
                    if bad_grads else "non-finite loss")
            print(f"iteration {iteration}: {what} ({len(self.streak)} in a row)", flush=True)
        return len(self.streak) >= self.max_in_a_row

    def stop_message(self, iteration: int, save_dir: Optional[str]) -> str:
        kept = (f"the last good state (no update since iteration {self.streak[0] - 1}) is saved "
                f"in {save_dir} as iteration {iteration}") if save_dir else \
            "nothing was saved (no --save)"
        return (f"{len(self.streak)} iterations in a row ({self.streak[0]}-{self.streak[-1]}) had "
                f"non-finite gradients; stopping: {kept}. Lower the learning rate, check the "
                f"data around these iterations, or raise --max-consecutive-nan-iterations.")


def _is_rank_zero() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def _loss_not_finite(losses: Optional[Mapping[str, float]]) -> bool:
    """Whether a reported loss is inf or nan. Under pipeline parallelism only the last stage
    has it: the stages agree with one small all-reduce, so all stop alike."""
    bad = any(not math.isfinite(float(v)) for v in (losses or {}).values())
    if not dist.is_initialized() or parallel_state.get_pipeline_model_parallel_world_size() == 1:
        return bad  # every rank holds the same (DP-averaged) losses
    flag = device.tensor([int(bad)], dtype=torch.int32)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())
