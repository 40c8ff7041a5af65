"""A command stopped by a signal someone else handled first."""

from __future__ import annotations


class Interrupted(KeyboardInterrupt):
    """A command stopped by a signal that someone else handled first (the pipeline's flow)."""

    def __init__(self, signum: int, detail: str = "") -> None:
        super().__init__()
        self.signum, self.detail = signum, detail
