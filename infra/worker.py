"""`grpo worker`: another worker for a running serve's pool, on this machine or another."""

from __future__ import annotations

import base64
import os
import urllib.error
import urllib.request

from infra.serve import POOL, ServeError
from infra.supervision import bin_path


def worker(pool: str = POOL, name: str | None = None, limit: int = 1) -> None:
    """Another worker for a running serve's pool, on this machine or another: checks that the
    Prefect API (PREFECT_API_URL, credentials as for any client) answers, then becomes
    `prefect worker start`. Its flow runs run in this worker's own checkout (the one it is
    started from, or GRPO_PROJECT_DIR: the deployment's pull step,
    infra.deployment_steps.enter_project) and need MLflow's address and credentials in this
    environment; every artifact goes to the MLflow server through its artifact proxy."""
    api = os.environ.get("PREFECT_API_URL", "")
    if not api.startswith(("http://", "https://")):
        raise ServeError(
            "grpo worker: set PREFECT_API_URL to the serve's API (http://HOST:4200/api) and its "
            "credentials (infra/TEAM.md)"
        )
    needed = ("MLFLOW_TRACKING_URI", "PREFECT_API_AUTH_STRING")
    missing = [k for k in needed if not os.environ.get(k)]
    if missing:
        raise ServeError(f"grpo worker: {', '.join(missing)} not set: its flow runs could not "
                         "reach the servers (infra/TEAM.md)")  # fmt: skip
    token = base64.b64encode(os.environ["PREFECT_API_AUTH_STRING"].encode()).decode()
    req = urllib.request.Request(f"{api.rstrip('/')}/flow_runs/count", data=b"{}",
                                 headers={"Authorization": f"Basic {token}",
                                          "Content-Type": "application/json"})  # fmt: skip
    try:
        with urllib.request.urlopen(req, timeout=30):
            pass
    except urllib.error.HTTPError as e:
        raise ServeError(f"grpo worker: {api} refused the credentials ({e.code})") from None
    except (urllib.error.URLError, OSError) as e:
        raise ServeError(f"grpo worker: {api} does not answer ({e})") from None
    cmd = [bin_path("prefect"), "worker", "start", "--pool", pool, "--limit", str(limit),
           *(["--name", name] if name else [])]  # fmt: skip
    os.execv(cmd[0], cmd)
