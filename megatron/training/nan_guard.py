"""``--check-for-nan-in-loss-and-grad``: an update whose gradients are not finite is skipped by
the optimizer (the global norm is checked, so every rank skips alike); this counts such
iterations, logs each one, and says when too many came in a row to go on."""
import math
from typing import List, Optional

import torch.distributed as dist


class NanGuard:
    def __init__(self, enabled: bool, max_in_a_row: int):
        self.enabled, self.max_in_a_row = enabled, max_in_a_row
        self.streak: List[int] = []

    def check(self, iteration: int, grad_norm: Optional[float]) -> bool:
        """Record this iteration; True when the run must stop."""
        if not self.enabled or grad_norm is None or math.isfinite(grad_norm):
            self.streak = []
            return False
        self.streak.append(iteration)
        if dist.get_rank() == 0:
            print(f"iteration {iteration}: non-finite gradients (grad norm {grad_norm}): the "
                  f"update was skipped ({len(self.streak)} in a row)", flush=True)
        return len(self.streak) >= self.max_in_a_row

    def stop_message(self, iteration: int, save_dir: Optional[str]) -> str:
        kept = (f"the last good state (no update since iteration {self.streak[0] - 1}) is saved "
                f"in {save_dir} as iteration {iteration}") if save_dir else \
            "nothing was saved (no --save)"
        return (f"{len(self.streak)} iterations in a row ({self.streak[0]}-{self.streak[-1]}) had "
                f"non-finite gradients; stopping: {kept}. Lower the learning rate, check the "
                f"data around these iterations, or raise --max-consecutive-nan-iterations.")
