"""A pipeline schedule's step: F, B or W of one microbatch on one model chunk. A leaf, so the
order modules (schedule_order.py, zero_bubble_order.py) import it and not each other."""
from dataclasses import dataclass

FORWARD, BACKWARD, WEIGHT = "F", "B", "W"


@dataclass(frozen=True)
class Step:
    kind: str  # FORWARD, BACKWARD or WEIGHT
    microbatch: int
    chunk: int = 0
