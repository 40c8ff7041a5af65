"""A GRPO run's pace (steps done of steps planned), for the SFT control that runs beside it.

The trainer writes `pace.json` (steps done, steps planned, done) after every step. The
control anneals its learning rate by that fraction and stops when the file says done, so both
get the same wall time, on half of the machine each. The pipeline marks the file done when the
GRPO stage ends in any way, so that a failed GRPO run never leaves the control running.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

PACE_FILE = "pace.json"


def control_budget(seconds: float | None, follow: Path | None, steps: int | None) -> dict[str, Any]:
    """The one budget a control is given, as {"seconds" | "follow" | "steps": value}: none at
    all would train for ever, two would contradict each other."""
    given = {k: v for k, v in (("seconds", seconds), ("follow", follow), ("steps", steps))
             if v is not None}  # fmt: skip
    if len(given) != 1:
        raise ValueError(
            f"the control needs exactly one budget: seconds, a run to follow, or steps; got {given}"
        )
    if steps is not None and steps < 1:
        raise ValueError(f"the control's step budget must be at least 1, got {steps}")
    return given


def write_pace(path: Path, step: int, steps: int, done: bool = False) -> None:
    """Replace the pace file atomically: a reader never sees half a file."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps({"step": step, "steps": steps, "done": done}))
    os.replace(tmp, path)


def read_pace(path: Path) -> tuple[float, bool]:
    """(fraction of the steps done, done); (0.0, False) before the run wrote its first step."""
    if not path.exists():
        return 0.0, False
    p = json.loads(path.read_text())
    return min(1.0, p["step"] / max(p["steps"], 1)), bool(p["done"])


def mark_done(path: Path) -> None:
    """Mark the run done whatever it wrote last (a run that failed before its first step too)."""
    step, steps = 0, 1
    if path.exists():
        p = json.loads(path.read_text())
        step, steps = p["step"], p["steps"]
    path.parent.mkdir(parents=True, exist_ok=True)
    write_pace(path, step, steps, done=True)
