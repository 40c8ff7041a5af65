"""The one environment every benchmark script starts with, before anything imports torch.

`prepare()` puts the project on sys.path (the scripts run as `python benchmarks/x.py`) and sets
the CLI's environment: torch's CPU kernels pinned as `grpo` pins them, quiet offline operation.
So an SFT reference a benchmark builds is the one `make run` would build under the same cache
key, and its numbers are the CLI's.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def prepare() -> Path:
    """Set up the environment; returns the project root."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    from grpo.launch.environment import quiet_environment

    quiet_environment()
    return ROOT
