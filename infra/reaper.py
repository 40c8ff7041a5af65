"""MLflow runs of crashed flow runs, ended KILLED by `grpo serve`.

A pipeline whose process died (its worker or machine killed) cannot end its own MLflow runs:
they would stay RUNNING in the UI forever. Prefect sets such a flow run Crashed (the
heartbeat automation of infra/alerts.py); serve then ends the MLflow runs the pipeline tagged
with that flow run's id, the same way a pipeline ends the orphans of its own host
(tasks.tracking.end_killed). Serve's own process holds no client credentials in its
environment (its children must not inherit them), so they are set only around each sweep.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import urllib.request
from collections.abc import Iterator
from typing import Any


def _call(url: str, auth: str, body: dict[str, Any]) -> Any:
    token = base64.b64encode(auth.encode()).decode()
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), method="POST",
        headers={"Authorization": f"Basic {token}", "Content-Type": "application/json"},
    )  # fmt: skip
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.loads(r.read() or b"{}")


@contextlib.contextmanager
def _mlflow_credentials(user: str, password: str) -> Iterator[None]:
    keys = ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD")
    saved = {k: os.environ.get(k) for k in keys}
    os.environ.update(dict(zip(keys, (user, password), strict=True)))
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


class Reaper:
    """Ends the MLflow runs of Crashed flow runs; call sweep() now and then."""

    def __init__(
        self, api_url: str, tracking: str, prefect_auth: str, mlflow_auth: tuple[str, str]
    ) -> None:
        self.api, self.tracking = api_url.rstrip("/"), tracking.rstrip("/")
        self.prefect_auth, self.mlflow_auth = prefect_auth, mlflow_auth
        self.done: set[str] = set()

    def sweep(self) -> list[str]:
        """One pass; returns the MLflow run ids it ended."""
        from mlflow.tracking import MlflowClient

        from tasks.tracking import end_runs_of_flow_run

        crashed = _call(f"{self.api}/flow_runs/filter", self.prefect_auth, {
            "flow_runs": {"state": {"type": {"any_": ["CRASHED"]}}},
            "sort": "EXPECTED_START_TIME_DESC", "limit": 50,
        })  # fmt: skip
        ended: list[str] = []
        fresh = [fr for fr in crashed if fr["id"] not in self.done]
        if not fresh:
            return ended
        client = MlflowClient(tracking_uri=self.tracking)
        with _mlflow_credentials(*self.mlflow_auth):
            for fr in fresh:
                why = f"grpo serve: Prefect flow run {fr['id']} crashed "
                why += f"({fr['state'].get('message') or 'crashed'})"
                ended += end_runs_of_flow_run(client, fr["id"], why)
                self.done.add(fr["id"])
        return ended
