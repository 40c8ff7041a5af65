"""MLflow runs of crashed flow runs, ended KILLED by `grpo serve`.

A pipeline whose process died (its worker or machine killed) cannot end its own MLflow runs:
they would stay RUNNING in the UI forever. Prefect sets such a flow run Crashed (the
heartbeat automation of flows/alerts.py); serve then finds the MLflow runs the pipeline tagged
with that flow run's id (tasks.tracking.FLOW_RUN_TAG) and ends those still RUNNING, with a tag
saying why. Plain REST with the servers' credentials: serve's own process has no MLflow or
Prefect client settings.
"""

from __future__ import annotations

import base64
import json
import time
import urllib.request
from typing import Any


def _call(url: str, auth: str, body: dict[str, Any] | None, method: str = "POST") -> Any:
    token = base64.b64encode(auth.encode()).decode()
    req = urllib.request.Request(
        url, data=None if body is None else json.dumps(body).encode(), method=method,
        headers={"Authorization": f"Basic {token}", "Content-Type": "application/json"},
    )  # fmt: skip
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.loads(r.read() or b"{}")


class Reaper:
    """Ends the MLflow runs of Crashed flow runs; call sweep() now and then."""

    def __init__(self, api_url: str, tracking: str, prefect_auth: str, mlflow_auth: str) -> None:
        self.api, self.tracking = api_url.rstrip("/"), tracking.rstrip("/")
        self.prefect_auth, self.mlflow_auth = prefect_auth, mlflow_auth
        self.done: set[str] = set()

    def sweep(self) -> list[str]:
        """One pass; returns the MLflow run ids it ended."""
        crashed = _call(f"{self.api}/flow_runs/filter", self.prefect_auth, {
            "flow_runs": {"state": {"type": {"any_": ["CRASHED"]}}},
            "sort": "EXPECTED_START_TIME_DESC", "limit": 50,
        })  # fmt: skip
        ended: list[str] = []
        for fr in crashed:
            if fr["id"] in self.done:
                continue
            ended += self._end_runs_of(fr["id"], fr["state"].get("message") or "crashed")
            self.done.add(fr["id"])
        return ended

    def _search(self, filter_string: str) -> list[dict[str, Any]]:
        api = f"{self.tracking}/api/2.0/mlflow"
        exps = _call(f"{api}/experiments/search", self.mlflow_auth, {"max_results": 1000})
        ids = [e["experiment_id"] for e in exps.get("experiments", [])]
        if not ids:
            return []
        got = _call(
            f"{api}/runs/search",
            self.mlflow_auth,
            {"experiment_ids": ids, "filter": filter_string, "max_results": 1000},
        )
        return got.get("runs", [])

    def _end_runs_of(self, flow_run_id: str, why: str) -> list[str]:
        from tasks.tracking import FLOW_RUN_TAG

        api = f"{self.tracking}/api/2.0/mlflow"
        parents = self._search(
            f"tags.`{FLOW_RUN_TAG}` = '{flow_run_id}' and attributes.status = 'RUNNING'"
        )
        runs: list[str] = []
        for pid in [p["info"]["run_id"] for p in parents]:
            kids = self._search(
                f"tags.mlflow.parentRunId = '{pid}' and attributes.status = 'RUNNING'"
            )
            # a parent's stage runs before the parent: whoever sees the parent ended (the UI,
            # a script polling it) never finds one of its stages still RUNNING
            runs += [k["info"]["run_id"] for k in kids] + [pid]
        now = int(time.time() * 1000)
        said = f"grpo serve: Prefect flow run {flow_run_id} crashed ({why})"
        for rid in runs:
            _call(f"{api}/runs/set-tag", self.mlflow_auth,
                  {"run_id": rid, "key": "killed_by", "value": said})  # fmt: skip
            _call(f"{api}/runs/update", self.mlflow_auth,
                  {"run_id": rid, "status": "KILLED", "end_time": now})  # fmt: skip
        return runs
