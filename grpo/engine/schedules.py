"""Learning-rate schedules as LambdaLR multipliers: by optimizer step, by wall-clock time or
another run's progress, or cut at validation-loss plateaus."""

from __future__ import annotations

import math
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


def paced_cosine(warmup: int, progress: Callable[[], float]) -> Callable[[int], float]:
    """Warmup by steps, then cosine decay over `progress()` going from 0 to 1, whatever it
    measures (wall-clock time, another run's steps): a budget not counted in own steps."""

    def f(step: int) -> float:
        done = min(1.0, progress())  # always read: a clock starts at the first call
        if warmup and step < warmup:
            return (step + 1) / warmup
        return 0.5 * (1.0 + math.cos(math.pi * done))

    return f


class PlateauLR:
    """Linear warmup, then the learning rate is cut by `factor` each time the validation loss
    has not improved for `patience` validations; after `cuts` cuts, the next such plateau ends
    training. A reference trained this way has stopped improving at a small learning rate too,
    not only at its peak one, where the validation loss is noisiest.

    >>> p = PlateauLR(warmup=0, patience=2, cuts=1, factor=0.5)
    >>> [p.report(v) for v in (3.0, 2.0, 2.5, 2.1)], p(100)
    ([False, False, False, False], 0.5)
    >>> [p.report(v) for v in (1.9, 2.0, 1.95)]
    [False, False, True]
    """

    def __init__(
        self, warmup: int, patience: int, cuts: int, factor: float, min_delta: float = 1e-4
    ) -> None:
        self.warmup, self.patience, self.cuts, self.factor = warmup, patience, cuts, factor
        self.min_delta = min_delta  # a smaller gain is noise, not an improvement
        self.scale, self.cuts_made, self.bad = 1.0, 0, 0
        self.best = math.inf

    def __call__(self, step: int) -> float:
        """The LambdaLR multiplier at optimizer step `step`."""
        warm = (step + 1) / self.warmup if self.warmup and step < self.warmup else 1.0
        return warm * self.scale

    def report(self, val_loss: float) -> bool:
        """Record one validation loss; True when training should stop."""
        if val_loss < self.best - self.min_delta:
            self.best, self.bad = val_loss, 0
            return False
        self.bad += 1
        if self.bad < self.patience:
            return False
        if self.cuts_made == self.cuts:
            return True
        self.scale *= self.factor
        self.cuts_made += 1
        self.bad = 0
        return False
