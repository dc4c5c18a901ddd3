"""GPU timing with CUDA events: warm-up first, then the median of the timed calls."""

from __future__ import annotations

from collections.abc import Callable
from statistics import median

import torch

GPU_HOLD_CYCLES = 2_000_000
"""~1 ms of GPU spin before each timed call, so the host has queued the call before the
start event runs: the events then time the GPU's work, not the host's launch overhead."""


def median_ms(run: Callable[[], object], warmup: int = 3, timed: int = 10, hold: bool = True) -> float:
    """Median milliseconds of `run()` on the current stream, by CUDA events around each call.

    `hold`: spin the GPU ~1 ms before each call (see `GPU_HOLD_CYCLES`), so the events
    measure GPU time; set False to include host time (whole-model forwards).
    """
    for _ in range(warmup):
        run()
    torch.cuda.synchronize()
    times = []
    for _ in range(timed):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        if hold:
            torch.cuda._sleep(GPU_HOLD_CYCLES)
        start.record()
        run()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return median(times)
