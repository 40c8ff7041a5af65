"""Progress bars that suit both a terminal and a log file (Prefect, CI)."""

from __future__ import annotations

import os
from typing import Any


def progress_bar(
    total: int | None, desc: str, unit: str, *, enabled: bool = True, initial: int = 0
) -> Any:
    """A tqdm bar with rate and ETA. On a terminal it redraws often; in a log every redraw is a
    line, so there it redraws every 15 s."""
    from tqdm import tqdm

    interval = 0.2 if os.isatty(2) else 15.0
    return tqdm(
        total=total,
        desc=desc,
        unit=unit,
        disable=not enabled,
        mininterval=interval,
        initial=initial,
    )
