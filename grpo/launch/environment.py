"""The environment every process of the project runs with, set in one place.

Set before torch is imported: OpenMP threads that spin-wait crawl on a shared 2-core machine
(PASSIVE makes idle threads sleep), tokenizers' own threads fight the ranks', and the
libraries' telemetry has no network to reach. Values a user set win.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping

QUIET_ENV = {
    "OMP_WAIT_POLICY": "PASSIVE",
    "TOKENIZERS_PARALLELISM": "false",
    "DO_NOT_TRACK": "true",
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    "HF_HUB_DISABLE_TELEMETRY": "1",
}


def quiet_environment(environ: MutableMapping[str, str] | None = None) -> None:
    """Give `environ` (this process's by default) every QUIET_ENV value it does not set."""
    env = os.environ if environ is None else environ
    for k, v in QUIET_ENV.items():
        env.setdefault(k, v)
