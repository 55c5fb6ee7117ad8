"""Named wall-clock timers, Megatron-style: ``timers("forward-backward", log_level=1).start()``.

Timers of a level above ``--timing-log-level`` (0, 1 or 2) are free no-ops, so the loop can
time every stage unconditionally. Device work is asynchronous, so start/stop synchronise
through ``megatron.core.device.synchronize()`` (a no-op on CPU); this module knows nothing
about CUDA.

Console format (``Timers.log_string``): single-rank, in Megatron's older style,
``time (ms) | forward-backward: 1234.57 | optimizer: 12.35`` (milliseconds divided by the
normalizer). We do not gather min/max across ranks: that needs a collective on every log
step; the rank that prints (the last) is the one whose times matter for pipeline bubbles.
"""
import time
from typing import Callable, Dict, Iterable, Optional

import torch

from megatron.core import device

MAX_LOG_LEVEL = 2


def _default_clock() -> float:
    # Looked up at call time so tests can monkeypatch time.perf_counter.
    return time.perf_counter()


def _barrier() -> None:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.barrier()


class Timer:
    """Accumulates seconds between start() and stop() calls until reset."""

    def __init__(self, name: str, clock: Callable[[], float] = _default_clock):
        self.name = name
        self._clock = clock
        self._elapsed = 0.0
        self._active_time = 0.0  # total over the whole run, never reset
        self._started = False
        self._start_time = 0.0

    def start(self, barrier: bool = False) -> None:
        if self._started:
            raise RuntimeError(f"timer {self.name!r} has already been started")
        if barrier:
            _barrier()
        device.synchronize()
        self._start_time = self._clock()
        self._started = True

    def stop(self, barrier: bool = False) -> None:
        if not self._started:
            raise RuntimeError(f"timer {self.name!r} is not started")
        if barrier:
            _barrier()
        device.synchronize()
        interval = self._clock() - self._start_time
        self._elapsed += interval
        self._active_time += interval
        self._started = False

    def reset(self) -> None:
        self._elapsed = 0.0
        self._started = False

    def elapsed(self, reset: bool = True, barrier: bool = False) -> float:
        """Seconds accumulated so far; a running timer keeps running (restarted after)."""
        was_started = self._started
        if was_started:
            self.stop(barrier=barrier)
        value = self._elapsed
        if reset:
            self.reset()
        if was_started:
            self.start(barrier=barrier)
        return value

    def active_time(self) -> float:
        return self._active_time


class _DummyTimer:
    """Returned for timers above the log level: every call is a cheap no-op."""

    name = "dummy"

    def start(self, barrier: bool = False) -> None:
        pass

    def stop(self, barrier: bool = False) -> None:
        pass

    def reset(self) -> None:
        pass

    def elapsed(self, reset: bool = True, barrier: bool = False) -> float:
        raise RuntimeError("a timer above --timing-log-level has no elapsed time")

    def active_time(self) -> float:
        raise RuntimeError("a timer above --timing-log-level has no active time")


class Timers:
    """A registry of named timers filtered by ``log_level`` (``--timing-log-level``)."""

    def __init__(self, log_level: int = 0, clock: Callable[[], float] = _default_clock):
        if not 0 <= log_level <= MAX_LOG_LEVEL:
            raise ValueError(f"--timing-log-level must be 0, 1 or 2, got {log_level}")
        self._log_level = log_level
        self._clock = clock
        self._timers: Dict[str, Timer] = {}
        self._levels: Dict[str, int] = {}
        self._dummy = _DummyTimer()

    def __call__(self, name: str, log_level: Optional[int] = None):
        if name in self._timers:
            if log_level is not None and log_level != self._levels[name]:
                raise ValueError(f"timer {name!r} was created with log level "
                                 f"{self._levels[name]}, not {log_level}")
            return self._timers[name]
        level = MAX_LOG_LEVEL if log_level is None else log_level
        if not 0 <= level <= MAX_LOG_LEVEL:
            raise ValueError(f"timer log level must be 0, 1 or 2, got {level}")
        if level > self._log_level:
            return self._dummy
        self._timers[name] = Timer(name, self._clock)
        self._levels[name] = level
        return self._timers[name]

    def get_elapsed(self, names: Iterable[str], reset: bool = True,
                    normalizer: float = 1.0) -> Dict[str, float]:
        """Seconds per name divided by ``normalizer``; names never created are left out."""
        if normalizer <= 0:
            raise ValueError("normalizer must be positive")
        return {name: self._timers[name].elapsed(reset=reset) / normalizer
                for name in names if name in self._timers}

    def log_string(self, names: Iterable[str], normalizer: float = 1.0,
                   reset: bool = True) -> str:
        """``time (ms) | name: X.XX | ...``; empty when none of the names is timed."""
        times = self.get_elapsed(names, reset=reset, normalizer=normalizer)
        if not times:
            return ""
        return "time (ms)" + "".join(f" | {name}: {seconds * 1000.0:.2f}"
                                     for name, seconds in times.items())

    def log(self, names: Iterable[str], normalizer: float = 1.0, reset: bool = True,
            print_fn: Callable[[str], None] = print) -> None:
        line = self.log_string(names, normalizer=normalizer, reset=reset)
        if line:
            print_fn(line)

    def write(self, names: Iterable[str], writer, iteration: int, normalizer: float = 1.0,
              reset: bool = False) -> None:
        """``add_scalar(name + '-time', seconds / normalizer, iteration)``, Megatron's tags.

        Does not reset by default: the console log at the log interval does that.
        """
        if writer is None:
            return
        for name, seconds in self.get_elapsed(names, reset=reset,
                                              normalizer=normalizer).items():
            writer.add_scalar(name + "-time", seconds, iteration)
