"""`grpo serve` when a machine dies: a worker killed with its flow run, then the MLflow server.
(Its own module, so that the two serve tests run on different test workers.)"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from tests.serve_harness import WAITING, Served, alive

pytestmark = [pytest.mark.slow, pytest.mark.serve]


def test_a_dead_workers_run_ends_crashed_and_a_dead_mlflow_server_stops_serve(
    tmp_path, monkeypatch
):
    """A worker killed with its flow run (SIGKILL, as when its machine dies): the flow run
    stops sending heartbeats, Prefect sets it Crashed saying why, and serve ends its MLflow
    runs KILLED. Then the MLflow server is killed: serve exits 2 naming it, and stops the rest."""
    from mlflow import MlflowClient

    s = Served(tmp_path, "serve-kill", extra=("--crashed-after-s", "40"))
    doomed = None
    try:
        s.wait_ready()
        assert "a run with no heartbeat for 40 s is set Crashed" in s.out.read_text()
        # serve's own worker is frozen, so that the doomed worker takes the run
        own = s.child("worker start")
        own.suspend()
        doomed = subprocess.Popen(
            [str(Path(sys.executable).with_name("grpo")), "worker", "--pool", "e2e-pool",
             "--name", "doomed"],
            env={**os.environ, **s.client_env(), "PREFECT_WORKER_QUERY_SECONDS": "2",
                 "PREFECT_FLOWS_HEARTBEAT_FREQUENCY": "30"},
            stdout=(tmp_path / "doomed.out").open("w"), stderr=subprocess.STDOUT, cwd=tmp_path,
        )  # fmt: skip
        run = s.trigger(timeout=0, overrides=["grpo.steps=400"])
        c = MlflowClient(s.tracking, s.tracking)
        for k, v in s.client_env().items():
            monkeypatch.setenv(k, v)
        parent = _wait_for_parent(c, run["id"], 180)
        tree = [psutil.Process(doomed.pid), *psutil.Process(doomed.pid).children(recursive=True)]
        for p in tree:  # the worker, its flow run and its stages' processes, at once
            p.kill()
        own.resume()
        t0 = time.time()
        state = s.wait_state(run["id"], ("RUNNING",), 240, "the dead run was not set Crashed")
        print(f"the dead worker's run was {state} {time.time() - t0:.0f}s after the kill")
        assert state == "CRASHED"
        got = s.api_get(f"/flow_runs/{run['id']}")["state"]["message"]
        assert "no heartbeat for 40 s" in got and "worker or its machine died" in got
        deadline = time.time() + 60
        while (p := c.get_run(parent)).info.status == "RUNNING":
            assert time.time() < deadline, "serve did not end the crashed run's MLflow run"
            time.sleep(2)
        assert p.info.status == "KILLED" and run["id"] in p.data.tags["killed_by"]
        exp = p.info.experiment_id
        kids = c.search_runs([exp], f"tags.mlflow.parentRunId = '{parent}'")
        assert kids and all(k.info.status != "RUNNING" for k in kids)
        assert "ended KILLED" in s.out.read_text()

        run = s.trigger(timeout=0)
        s.wait_state(run["id"], WAITING, 120, "the worker did not start the run")
        below = s.children()
        s.child("--app-name").kill()  # the MLflow server
        rc = s.proc.wait(timeout=120)
    finally:
        if doomed is not None and doomed.poll() is None:
            doomed.kill()
        s.stop()
    out = s.out.read_text()
    assert rc == 2, out[-2000:]
    assert "the mlflow process exited" in out
    time.sleep(1)
    assert not alive(below), alive(below)


def _wait_for_parent(c, flow_run_id: str, seconds: float) -> str:  # noqa: ANN001
    """The MLflow parent run of a flow run, once its stages have started."""
    deadline = time.time() + seconds
    while time.time() < deadline:
        for e in c.search_experiments():
            got = c.search_runs([e.experiment_id],
                                f"tags.`prefect.flow_run_id` = '{flow_run_id}'")  # fmt: skip
            if got and c.search_runs(
                [e.experiment_id], f"tags.mlflow.parentRunId = '{got[0].info.run_id}'"
            ):
                return got[0].info.run_id
        time.sleep(1)
    raise AssertionError(f"no MLflow run of flow run {flow_run_id} within {seconds:.0f}s")
