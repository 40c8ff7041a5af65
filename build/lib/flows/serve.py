"""`grpo serve`: local Prefect and MLflow servers, the work pool, the deployment and a worker.

Everything listens on 127.0.0.1 unless GRPO_SERVE_HOST says otherwise. The deployment (with its
cron schedule) is declared in prefect.yaml; the worker runs scheduled pipeline runs.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

PROJECT = Path(__file__).resolve().parents[1]
POOL = "grpo-process-pool"


def _bin(name: str) -> str:
    return str(Path(sys.executable).with_name(name))


def _wait(url: str, seconds: float, what: str) -> None:
    deadline = time.time() + seconds
    while time.time() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=2):
                return
        except (urllib.error.URLError, OSError):
            time.sleep(1)
    raise RuntimeError(f"{what} did not answer at {url} within {seconds:.0f}s")


def serve(config: str, prefect_port: int = 4200, mlflow_port: int = 5000) -> None:
    host = os.environ.get("GRPO_SERVE_HOST", "127.0.0.1")
    home = PROJECT / ".prefect"
    env = {
        **os.environ,
        "PREFECT_HOME": str(home),
        "PREFECT_API_URL": f"http://{host}:{prefect_port}/api",
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "DO_NOT_TRACK": "true",
        "MLFLOW_TRACKING_URI": f"http://{host}:{mlflow_port}",
        "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false",
        "HF_HUB_OFFLINE": "1",
    }
    logs = PROJECT / "runs" / "serve"
    logs.mkdir(parents=True, exist_ok=True)
    procs: list[subprocess.Popen] = []

    def start(cmd: list[str], name: str) -> None:
        f = (logs / f"{name}.log").open("w")
        procs.append(subprocess.Popen(cmd, env=env, stdout=f, stderr=subprocess.STDOUT))

    db = f"sqlite:///{PROJECT / 'mlflow.db'}"
    start(
        [_bin("prefect"), "server", "start", "--host", host, "--port", str(prefect_port)], "prefect"
    )
    start([_bin("mlflow"), "server", "--backend-store-uri", db, "--artifacts-destination",
           str(PROJECT / "mlartifacts"), "--host", host, "--port", str(mlflow_port), "-w", "1"],
          "mlflow")  # fmt: skip
    try:
        _wait(f"http://{host}:{prefect_port}/api/health", 120, "Prefect server")
        _wait(f"http://{host}:{mlflow_port}/health", 120, "MLflow server")
        subprocess.run([_bin("prefect"), "work-pool", "create", POOL, "--type", "process",
                        "--overwrite"], env=env, check=True, cwd=PROJECT)  # fmt: skip
        subprocess.run([_bin("prefect"), "--no-prompt", "deploy", "--all"],
                       env=env, check=True, cwd=PROJECT)  # fmt: skip
        start([_bin("prefect"), "worker", "start", "--pool", POOL], "worker")
        print(f"Prefect UI: http://{host}:{prefect_port}")
        print(f"MLflow UI:  http://{host}:{mlflow_port}")
        print(f"logs in {logs}; Ctrl-C stops everything")
        signal.sigwait({signal.SIGINT, signal.SIGTERM})
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(timeout=30)
