"""Named timers, Megatron-style: ``timers("forward-backward", log_level=1).start()``.

Timers of a level above ``--timing-log-level`` (0, 1 or 2) are free no-ops, so the loop can
time every stage unconditionally. This module knows nothing about CUDA.

No synchronize per start/stop (that would stall the host's run-ahead every microbatch): on
CUDA each start/stop records a timing event on the current stream (``device.record_event``),
so an interval is the stream's time from reaching start() to reaching stop(); on CPU the
host clock is the device's. The only ``device.synchronize()`` is in ``Timers.get_elapsed``,
once per read, i.e. at the log interval (Megatron synchronises at every start and stop).

Console formats: with ``log_option`` (``--timing-log-option``: 'max', 'minmax' -- the
default -- or 'all') Megatron's cross-rank report, gathered from every rank at the read,
printed by the last rank: ``(min, max) time across ranks (ms):`` then one
``    name .....: (min, max)`` line per timer. Without (``log_option=None``), this rank's times
in Megatron's older one-line style ``time (ms) | forward-backward: 1234.57 | ...``.
"""
import time
from typing import Callable, Dict, Iterable, List, Optional

import torch

from megatron.core import device

MAX_LOG_LEVEL = 2
LOG_OPTIONS = ("max", "minmax", "all")

_current: Optional["Timers"] = None


def _default_clock() -> float:
    # Looked up at call time so tests can monkeypatch time.perf_counter.
    return time.perf_counter()


def _barrier() -> None:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.barrier()


def set_timers(timers: Optional["Timers"]) -> None:
    """The run's timers, for code the loop calls without passing them (forward steps)."""
    global _current
    _current = timers


def get_timers() -> "Timers":
    """The run's timers (Megatron's get_timers()); a level-0 set, timing nothing extra,
    outside pretrain()."""
    global _current
    if _current is None:
        _current = Timers(log_level=0)
    return _current


class Timer:
    """Accumulates seconds between start() and stop() calls until reset."""

    def __init__(self, name: str, clock: Callable[[], float] = _default_clock):
        self.name = name
        self._clock = clock
        self._elapsed = 0.0
        self._active_time = 0.0  # total over the whole run, never reset
        self._started = False
        self._start_time = 0.0
        self._start_event = None
        self._pending: List = []  # (start, stop) device events not yet read

    def start(self, barrier: bool = False) -> None:
        if self._started:
            raise RuntimeError(f"timer {self.name!r} has already been started")
        if barrier:
            _barrier()
        self._start_event = device.record_event(timing=True)
        self._start_time = self._clock()
        self._started = True

    def stop(self, barrier: bool = False) -> None:
        if not self._started:
            raise RuntimeError(f"timer {self.name!r} is not started")
        if barrier:
            _barrier()
        end_event = device.record_event(timing=True)
        if end_event is None:
            self._add(self._clock() - self._start_time)
        else:
            self._pending.append((self._start_event, end_event))
            self._fold(wait=False)  # keeps the list short without waiting on the device
        self._started = False

    def _add(self, seconds: float) -> None:
        self._elapsed += seconds
        self._active_time += seconds

    def _fold(self, wait: bool) -> None:
        """Add the pending device intervals that have completed (all of them with ``wait``,
        which the caller has made true by synchronising)."""
        while self._pending and (wait or self._pending[0][1].query()):
            start, end = self._pending.pop(0)
            self._add(start.elapsed_time(end) / 1000.0)

    def reset(self) -> None:
        # Intervals still on the device are dropped unread rather than waited for (they
        # belong before the reset; only active_time misses them).
        self._fold(wait=False)
        self._pending.clear()
        self._elapsed = 0.0
        self._started = False

    def elapsed(self, reset: bool = True, barrier: bool = False,
                synchronized: bool = False) -> float:
        """Seconds accumulated so far; a running timer keeps running (restarted after).
        ``synchronized``: the caller has synchronised the device (Timers.get_elapsed)."""
        was_started = self._started
        if was_started:
            self.stop(barrier=barrier)
        if self._pending:
            if was_started or not synchronized:
                device.synchronize()  # (a running timer's stop() just recorded one more)
            self._fold(wait=True)
        value = self._elapsed
        if reset:
            self.reset()
        if was_started:
            self.start(barrier=barrier)
        return value

    def active_time(self) -> float:
        if self._pending:
            device.synchronize()
            self._fold(wait=True)
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
    """A registry of named timers filtered by ``log_level`` (``--timing-log-level``);
    ``log_option`` (``--timing-log-option``) picks the cross-rank report, None this rank's."""

    def __init__(self, log_level: int = 0, log_option: Optional[str] = None,
                 clock: Callable[[], float] = _default_clock):
        if not 0 <= log_level <= MAX_LOG_LEVEL:
            raise ValueError(f"--timing-log-level must be 0, 1 or 2, got {log_level}")
        if log_option is not None and log_option not in LOG_OPTIONS:
            raise ValueError(f"--timing-log-option must be one of {LOG_OPTIONS}, got "
                             f"{log_option!r}")
        self._log_level = log_level
        self._log_option = log_option
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
        """Seconds per name divided by ``normalizer``; names never created are left out.
        Synchronises the device once (not at all when no timer is read)."""
        if normalizer <= 0:
            raise ValueError("normalizer must be positive")
        names = [name for name in names if name in self._timers]
        if names:
            device.synchronize()  # every event recorded so far has completed
        return {name: self._timers[name].elapsed(reset=reset, synchronized=True) / normalizer
                for name in names}

    def _all_ranks(self, names: List[str], reset: bool, normalizer: float) -> List[List[float]]:
        """[rank][name] seconds / normalizer, 0 where a rank has no such timer. A collective:
        every rank calls it with the same names (Megatron's _get_elapsed_time_all_ranks)."""
        mine = self.get_elapsed(names, reset=reset, normalizer=normalizer)
        row = device.tensor([mine.get(name, 0.0) for name in names], dtype=torch.float64)
        if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
            return [row.tolist()]
        rows = [torch.zeros_like(row) for _ in range(torch.distributed.get_world_size())]
        torch.distributed.all_gather(rows, row)
        return [r.tolist() for r in rows]

    def log_string(self, names: Iterable[str], normalizer: float = 1.0,
                   reset: bool = True) -> str:
        """The report as configured; empty when none of the names is timed anywhere.
        With a ``log_option`` every rank must call it (it gathers)."""
        names = list(names)
        if self._log_option is None:
            times = self.get_elapsed(names, reset=reset, normalizer=normalizer)
            if not times:
                return ""
            return "time (ms)" + "".join(f" | {name}: {seconds * 1000.0:.2f}"
                                         for name, seconds in times.items())
        table = self._all_ranks(names, reset, normalizer / 1000.0)  # milliseconds
        lines = []
        for i, name in enumerate(names):
            per_rank = [(rank, row[i]) for rank, row in enumerate(table) if row[i] > 0.0]
            if not per_rank:
                continue
            label = (name + " ").ljust(48, ".")
            values = [ms for _, ms in per_rank]
            if self._log_option == "max":
                lines.append(f"    {label}: {max(values):.2f}")
            elif self._log_option == "minmax":
                lines.append(f"    {label}: ({min(values):.2f}, {max(values):.2f})")
            else:
                lines.append(f"  {name}:")
                lines.extend(f"     rank {rank:2d}: {ms:.2f}" for rank, ms in per_rank)
        if not lines:
            return ""
        title = {"max": "max time across ranks (ms):",
                 "minmax": "(min, max) time across ranks (ms):",
                 "all": "times across ranks (ms):"}[self._log_option]
        return "\n".join([title] + lines)

    def log(self, names: Iterable[str], normalizer: float = 1.0, reset: bool = True,
            print_fn: Callable[[str], None] = print) -> None:
        line = self.log_string(names, normalizer=normalizer, reset=reset)
        if line:
            print_fn(line)

    def write(self, names: Iterable[str], writer, iteration: int, normalizer: float = 1.0,
              reset: bool = False) -> None:
        """``add_scalar(name + '-time', seconds / normalizer, iteration)``, Megatron's tags,
        this rank's times (the writing rank's: no collective, so ranks without a writer need
        not call it). Does not reset by default: the console log at the log interval does."""
        if writer is None:
            return
        for name, seconds in self.get_elapsed(names, reset=reset,
                                              normalizer=normalizer).items():
            writer.add_scalar(name + "-time", seconds, iteration)
