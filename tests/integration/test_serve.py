"""`grpo serve` end to end: real Prefect server, MLflow server and worker in subprocesses.

The deployment is triggered through Prefect's API (run_deployment) instead of waiting for the
cron; the worker runs it; the MLflow server must then hold the runs, metrics, artifacts and the
registered version, read over HTTP. Stopping serve must leave no process behind.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import psutil
import pytest
import yaml

from tests.helpers import ROOT, small_config

pytestmark = [pytest.mark.slow, pytest.mark.serve]

DEPLOYMENT = "grpo-pipeline/nightly-tiny"
READY = "Ctrl-C stops everything"
WAITING = ("SCHEDULED", "PENDING")  # not yet picked up by a worker


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Served:
    """A running `grpo serve` with its ports, state directory and output files."""

    def __init__(self, tmp: Path, model_name: str) -> None:
        cfg = small_config(
            tmp, f"tracking.registered_model={model_name}", "tracking.experiment=serve-e2e",
            f"deepspeed.master_port={_free_port()}",
        )  # fmt: skip
        self.config = tmp / "serve.yaml"
        self.config.write_text(yaml.safe_dump(cfg.model_dump(mode="json")))
        self.prefect, self.mlflow = _free_port(), _free_port()
        self.state, self.out = tmp / "state", tmp / "serve.out"
        env = {**os.environ, "PREFECT_WORKER_QUERY_SECONDS": "2"}
        env.pop("MLFLOW_TRACKING_URI", None)
        self.proc = subprocess.Popen(
            [str(Path(sys.executable).with_name("grpo")), "serve", "--config", str(self.config),
             "--prefect-port", str(self.prefect), "--mlflow-port", str(self.mlflow),
             "--state-dir", str(self.state), "--pool", "e2e-pool"],
            stdout=self.out.open("w"), stderr=subprocess.STDOUT, env=env, cwd=ROOT,
        )  # fmt: skip
        self.api = f"http://127.0.0.1:{self.prefect}/api"
        self.tracking = f"http://127.0.0.1:{self.mlflow}"

    def wait_ready(self, seconds: float = 300) -> None:
        deadline = time.time() + seconds
        while time.time() < deadline:
            if READY in self.out.read_text():
                return
            assert self.proc.poll() is None, f"serve exited early:\n{self.out.read_text()}"
            time.sleep(1)
        raise AssertionError(f"serve not ready in {seconds}s:\n{self.out.read_text()}")

    def children(self) -> list[psutil.Process]:
        return psutil.Process(self.proc.pid).children(recursive=True)

    def child(self, word: str) -> psutil.Process:
        """The direct child whose command line holds `word` (mlflow, worker, ...)."""
        kids = psutil.Process(self.proc.pid).children()
        return next(p for p in kids if word in " ".join(p.cmdline()))

    def trigger(self, timeout: float) -> dict:
        """run_deployment through Prefect's client, in a process pointed at this server."""
        code = (
            "import json, sys\n"
            "from prefect.deployments import run_deployment\n"
            f"fr = run_deployment({DEPLOYMENT!r}, timeout={timeout})\n"
            "print(json.dumps({'id': str(fr.id), 'state': fr.state.type.value}))\n"
        )
        env = {**os.environ, "PREFECT_API_URL": self.api}
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                             text=True, timeout=timeout + 120, cwd=ROOT)  # fmt: skip
        assert out.returncode == 0, out.stderr[-2000:]
        return json.loads(out.stdout.strip().splitlines()[-1])

    def api_post(self, path: str, body: dict) -> object:
        req = urllib.request.Request(f"{self.api}{path}", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})  # fmt: skip
        with urllib.request.urlopen(req, timeout=30) as r:
            return json.loads(r.read())

    def flow_run_state(self, run_id: str) -> str:
        with urllib.request.urlopen(f"{self.api}/flow_runs/{run_id}", timeout=30) as r:
            return json.loads(r.read())["state"]["type"]

    def wait_state(self, run_id: str, leave: tuple[str, ...], seconds: float, what: str) -> str:
        """Poll the flow run until its state is not in `leave`; fail naming `what` otherwise."""
        deadline = time.time() + seconds
        while (state := self.flow_run_state(run_id)) in leave:
            assert time.time() < deadline, f"{what} within {seconds:.0f}s (still {state})"
            assert self.proc.poll() is None, f"serve exited:\n{self.out.read_text()[-2000:]}"
            time.sleep(1)
        return state

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
        return self.proc.wait(timeout=120)


def _alive(procs: list[psutil.Process]) -> list[str]:
    out = []
    for p in procs:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                out.append(" ".join(p.cmdline())[:120])
        except psutil.NoSuchProcess:
            continue
    return out


def test_a_triggered_deployment_runs_on_the_worker_and_lands_in_the_mlflow_server(tmp_path):
    from mlflow import MlflowClient

    s = Served(tmp_path, "serve-e2e")
    try:
        s.wait_ready()
        t0 = time.time()
        run = s.trigger(timeout=0)  # returns at once; the worker must pick the run up
        s.wait_state(run["id"], WAITING, 120, "the worker did not start the run")
        state = s.wait_state(run["id"], ("RUNNING",), 600, "the run did not finish")
        print(f"flow run {run['id']} ended {state} after {time.time() - t0:.0f}s")
        assert state == "COMPLETED", s.out.read_text()[-3000:]
        # the evaluation table and the link to the MLflow run, on the flow run in Prefect
        query = {"artifacts": {"flow_run_id": {"any_": [run["id"]]}}}
        by_key = {a["key"]: a for a in s.api_post("/artifacts/filter", query)}
        assert {"evaluation", "evaluation-summary", "mlflow-run"} <= set(by_key)
        link = by_key["mlflow-run"]["data"]
        assert link.startswith("[MLflow run ") and s.tracking in link

        c = MlflowClient(s.tracking, s.tracking)
        exp = c.get_experiment_by_name("serve-e2e")
        assert exp.artifact_location.startswith("mlflow-artifacts:")  # proxied by the server
        parents = c.search_runs([exp.experiment_id], "attributes.status = 'FINISHED'")
        parent = next(r for r in parents if "mlflow.parentRunId" not in r.data.tags)
        assert parent.info.run_id in link
        kids = c.search_runs(
            [exp.experiment_id], f"tags.mlflow.parentRunId = '{parent.info.run_id}'"
        )
        by_name = {r.info.run_name: r for r in kids}
        assert {"validate", "sft", "grpo", "sft-control", "evaluate"} <= set(by_name)
        grpo_run = by_name["grpo"].info.run_id
        assert [m.step for m in c.get_metric_history(grpo_run, "reward")] == [1, 2]
        # an artifact's bytes come back over HTTP through the server's proxy
        local = c.download_artifacts(grpo_run, "completions.json", str(tmp_path / "dl"))
        assert json.loads(Path(local).read_text())
        mv = c.get_model_version_by_alias("serve-e2e", "challenger")
        assert mv.run_id == grpo_run and mv.tags["gate/decision"]
        # serve's store is its own: the project's plain mlflow.db was not touched
        assert (s.state / "mlflow-serve.db").exists() and not (s.state / "mlflow.db").exists()

        below = s.children()
        assert len(below) >= 3
    finally:
        rc = s.stop()
    assert rc == 0, s.out.read_text()[-2000:]
    time.sleep(1)
    assert not _alive(below), _alive(below)
    # after serve, a plain pipeline in the same state directory uses its own sqlite store
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
    out = subprocess.run(
        [str(Path(sys.executable).with_name("grpo")), "pipeline", "--config", str(s.config),
         "--set", "grpo.steps=1"],
        cwd=s.state, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    assert (s.state / "mlflow.db").exists()


def test_serve_reports_a_dead_mlflow_server_and_stops_the_rest(tmp_path):
    s = Served(tmp_path, "serve-kill")
    try:
        s.wait_ready()
        run = s.trigger(timeout=0)
        s.wait_state(run["id"], WAITING, 120, "the worker did not start the run")
        below = s.children()
        s.child("mlflow").kill()
        rc = s.proc.wait(timeout=120)
    finally:
        s.stop()
    out = s.out.read_text()
    assert rc == 2, out[-2000:]
    assert "the mlflow process exited" in out
    time.sleep(1)
    assert not _alive(below), _alive(below)
