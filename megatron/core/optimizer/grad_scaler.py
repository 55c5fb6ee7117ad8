"""Loss scaling for fp16: the loss is multiplied by ``scale`` before backward so small
gradients survive fp16; the optimizer divides it out and skips steps whose gradients overflowed.
"""
from typing import Dict


class ConstantGradScaler:
    def __init__(self, scale: float):
        self.scale = float(scale)

    @property
    def inv_scale(self) -> float:
        return 1.0 / self.scale

    def update(self, found_inf: bool) -> None:
        pass

    def state_dict(self) -> Dict:
        return {"scale": self.scale}

    def load_state_dict(self, state: Dict) -> None:
        self.scale = float(state["scale"])


class DynamicGradScaler(ConstantGradScaler):
    """Megatron's: ``hysteresis`` overflowing steps (not necessarily in a row) halve the scale
    (not below ``min_scale``); ``growth_interval`` clean steps in a row double it."""

    def __init__(self, initial_scale: float, min_scale: float, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, growth_interval: int = 1000,
                 hysteresis: int = 2):
        super().__init__(initial_scale)
        self.min_scale = float(min_scale)
        self.growth_factor, self.backoff_factor = growth_factor, backoff_factor
        self.growth_interval, self.hysteresis = int(growth_interval), int(hysteresis)
        self.growth_tracker = 0
        self.hysteresis_tracker = self.hysteresis

    def update(self, found_inf: bool) -> None:
        if found_inf:
            self.growth_tracker = 0
            self.hysteresis_tracker -= 1
            if self.hysteresis_tracker <= 0:
                self.scale = max(self.scale * self.backoff_factor, self.min_scale)
        else:
            self.growth_tracker += 1
            if self.growth_tracker == self.growth_interval:
                self.growth_tracker = 0
                self.hysteresis_tracker = self.hysteresis
                self.scale *= self.growth_factor

    def state_dict(self) -> Dict:
        return {"scale": self.scale, "growth_tracker": self.growth_tracker,
                "hysteresis_tracker": self.hysteresis_tracker}

    def load_state_dict(self, state: Dict) -> None:
        self.scale = float(state["scale"])
        self.growth_tracker = int(state["growth_tracker"])
        self.hysteresis_tracker = int(state["hysteresis_tracker"])
