"""Honest timing of one callable: warm-up discarded, synchronized, repeated.

Habits (gpt-fast, pyperf): synchronize the device before starting the clock
and before stopping it; run warm-up iterations first and keep their times
apart from the values; report min, median and p90 rather than a mean. Host
time is ``time.perf_counter`` around the synchronized call (what a serving
loop experiences); on CUDA the device time between two CUDA events is kept
as well. Neither replaces the other.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Sequence

import torch


def quantile(values: Sequence[float], q: float) -> float:
    """Linear-interpolation quantile (numpy's default), q in [0, 1]."""
    if not values:
        raise ValueError("quantile of no values")
    xs = sorted(values)
    pos = q * (len(xs) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


@dataclass(frozen=True, slots=True)
class Timing:
    """Seconds of each timed call; warm-up calls are kept but never summarized."""

    host_s: tuple[float, ...]
    warmup_host_s: tuple[float, ...]
    device_s: tuple[float, ...] | None = None     # CUDA-event time, CUDA only

    @property
    def num_repeats(self) -> int:
        return len(self.host_s)

    @property
    def min_s(self) -> float:
        return min(self.host_s)

    @property
    def median_s(self) -> float:
        return quantile(self.host_s, 0.5)

    @property
    def p90_s(self) -> float:
        return quantile(self.host_s, 0.9)

    @property
    def device_median_s(self) -> float | None:
        return None if not self.device_s else quantile(self.device_s, 0.5)


def set_cpu_threads(num_threads: int | None) -> int:
    """Fix torch's intra-op thread count (None: keep the current one) and return it.

    A fixed, recorded count keeps CPU timings comparable between runs.
    """
    if num_threads is not None:
        if num_threads < 1:
            raise ValueError(f"num_threads must be >= 1, got {num_threads}")
        torch.set_num_threads(num_threads)
    return torch.get_num_threads()


def time_callable(fn: Callable[[], object], synchronize: Callable[[], None], *,
                  num_warmup: int = 2, num_repeats: int = 5,
                  cuda_device: torch.device | None = None) -> Timing:
    """Run ``fn`` num_warmup + num_repeats times and time each call.

    Every call is bracketed by ``synchronize()`` so queued device work is
    neither charged to the next call nor left out of this one. With
    ``cuda_device`` set, a CUDA event pair around each call gives device time.
    Raises ValueError for num_repeats < 1 or num_warmup < 0.
    """
    if num_repeats < 1 or num_warmup < 0:
        raise ValueError(f"need num_repeats >= 1 and num_warmup >= 0, got {num_repeats}, {num_warmup}")
    warm: list[float] = []
    host: list[float] = []
    device: list[float] = []
    use_events = cuda_device is not None and cuda_device.type == "cuda"
    for i in range(num_warmup + num_repeats):
        if use_events:
            start_ev = torch.cuda.Event(enable_timing=True)
            end_ev = torch.cuda.Event(enable_timing=True)
        synchronize()
        t0 = time.perf_counter()
        if use_events:
            start_ev.record()
        fn()
        if use_events:
            end_ev.record()
        synchronize()
        elapsed_s = time.perf_counter() - t0
        if i < num_warmup:
            warm.append(elapsed_s)
            continue
        host.append(elapsed_s)
        if use_events:
            device.append(start_ev.elapsed_time(end_ev) * 1e-3)   # ms -> s
    return Timing(tuple(host), tuple(warm), tuple(device) if use_events else None)
