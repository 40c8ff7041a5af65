"""Learning-rate schedules as LambdaLR multipliers: by optimizer step, or by wall-clock time."""

from __future__ import annotations

import math
import time
from collections.abc import Callable


def lr_lambda(warmup: int, total: int, schedule: str) -> Callable[[int], float]:
    """Linear warmup then constant, linear or cosine decay to 0 at `total` optimizer steps."""

    def f(step: int) -> float:
        if warmup and step < warmup:
            return (step + 1) / warmup
        if schedule == "constant":
            return 1.0
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        if schedule == "linear":
            return 1.0 - progress
        return 0.5 * (1.0 + math.cos(math.pi * progress))

    return f


def time_cosine(warmup: int, seconds: float) -> Callable[[int], float]:
    """Warmup by steps, then cosine decay over wall-clock time: a run given a time budget
    (the SFT control) anneals fully by its end, however many steps fit."""
    start: list[float] = []

    def f(step: int) -> float:
        if not start:
            start.append(time.time())
        if warmup and step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (time.time() - start[0]) / seconds)
        return 0.5 * (1.0 + math.cos(math.pi * progress))

    return f
