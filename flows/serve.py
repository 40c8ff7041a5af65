"""`grpo serve`: local Prefect and MLflow servers, the work pool, the deployment and a worker.

Everything listens on 127.0.0.1 unless GRPO_SERVE_HOST says otherwise. The deployment (with its
cron schedule) is declared in prefect.yaml; the worker runs scheduled pipeline runs. The servers'
state (Prefect's home, the MLflow store and artifacts, the logs) lives in one state directory,
the project directory by default.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import psutil

PROJECT = Path(__file__).resolve().parents[1]
POOL = "grpo-process-pool"
DEPLOYMENT = "nightly-tiny"  # the deployment in prefect.yaml


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


class ServeError(RuntimeError):
    """A server or the worker died, or a setup command failed; the message names it."""


def serve(
    config: str | None,
    prefect_port: int = 4200,
    mlflow_port: int = 5000,
    state_dir: str | Path | None = None,
    pool: str = POOL,
) -> None:
    """Start everything, deploy `config` as the scheduled pipeline, watch the children.

    The MLflow server has its own store (mlflow-serve.db, artifacts proxied to mlartifacts/):
    runs created through a server get mlflow-artifacts:/ locations, which a direct sqlite
    client cannot read, so the plain CLI's mlflow.db is never shared with it. Point the CLI at
    the server with MLFLOW_TRACKING_URI=http://127.0.0.1:5000 to use the served store.
    """
    host = os.environ.get("GRPO_SERVE_HOST", "127.0.0.1")
    state = Path(state_dir).resolve() if state_dir else PROJECT
    env = {
        **os.environ,
        "PREFECT_HOME": str(state / ".prefect"),
        "PREFECT_API_URL": f"http://{host}:{prefect_port}/api",
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "DO_NOT_TRACK": "true",
        "MLFLOW_TRACKING_URI": f"http://{host}:{mlflow_port}",
        "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false",
        "HF_HUB_OFFLINE": "1",
    }
    logs = state / "runs" / "serve"
    logs.mkdir(parents=True, exist_ok=True)
    procs: dict[str, subprocess.Popen] = {}

    def start(cmd: list[str], name: str) -> None:
        f = (logs / f"{name}.log").open("w")
        # a session of its own: stopping it stops its children too (server workers, flow runs)
        procs[name] = subprocess.Popen(
            cmd, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True
        )

    stop = {"signal": None}

    def on_signal(signum: int, frame: object) -> None:
        stop["signal"] = signum

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    db = f"sqlite:///{state / 'mlflow-serve.db'}"
    start(
        [_bin("prefect"), "server", "start", "--host", host, "--port", str(prefect_port)], "prefect"
    )
    start([_bin("mlflow"), "server", "--backend-store-uri", db, "--artifacts-destination",
           str(state / "mlartifacts"), "--host", host, "--port", str(mlflow_port), "-w", "1"],
          "mlflow")  # fmt: skip
    try:
        _wait(f"http://{host}:{prefect_port}/api/health", 120, "Prefect server")
        _wait(f"http://{host}:{mlflow_port}/health", 120, "MLflow server")
        _run([_bin("prefect"), "work-pool", "create", pool, "--type", "process", "--overwrite"],
             env, "creating the work pool")  # fmt: skip
        params = {"params": {"config": str(Path(config).resolve()) if config else None,
                             "overrides": [], "control": True}}  # fmt: skip
        _run([_bin("prefect"), "--no-prompt", "deploy", "--name", DEPLOYMENT, "--pool", pool,
              "--params", json.dumps(params)], env, "deploying prefect.yaml")  # fmt: skip
        start([_bin("prefect"), "worker", "start", "--pool", pool], "worker")
        print(f"Prefect UI: http://{host}:{prefect_port}")
        print(f"MLflow UI:  http://{host}:{mlflow_port}")
        print(f"deployment grpo-pipeline/{DEPLOYMENT} runs {config or 'the default config'}")
        print(f"logs in {logs}; Ctrl-C stops everything", flush=True)
        while stop["signal"] is None:
            for name, p in procs.items():
                if p.poll() is not None:
                    raise ServeError(
                        f"the {name} process exited with {p.returncode}; see {logs / name}.log"
                    )
            time.sleep(1)
    finally:
        _stop_all(procs)


def _run(cmd: list[str], env: dict[str, str], what: str) -> None:
    out = subprocess.run(cmd, env=env, cwd=PROJECT, capture_output=True, text=True)
    if out.returncode != 0:
        tail = (out.stdout + out.stderr).strip().splitlines()[-3:]
        raise ServeError(f"{what} failed ({out.returncode}): {' | '.join(tail)}")


def _descendants(pid: int) -> list[psutil.Process]:
    with contextlib.suppress(psutil.NoSuchProcess):
        return psutil.Process(pid).children(recursive=True)
    return []


def _stop_all(procs: dict[str, subprocess.Popen]) -> None:
    """SIGTERM every child's process group, then SIGKILL what is left after 20 s.

    Descendants are listed first: a flow run started by the worker lives in a session of its
    own, out of reach of the worker's process group.
    """
    below = [d for p in procs.values() for d in _descendants(p.pid)]
    for d in below:
        with contextlib.suppress(psutil.NoSuchProcess):
            d.terminate()
    for p in procs.values():
        if p.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGTERM)
    deadline = time.time() + 20
    for p in procs.values():
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.wait(timeout=max(0.1, deadline - time.time()))
    for p in procs.values():
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGKILL)  # the group may outlive its leader
        p.wait()
    _gone, alive = psutil.wait_procs(below, timeout=max(0.1, deadline - time.time()))
    for d in alive:
        with contextlib.suppress(psutil.NoSuchProcess):
            d.kill()
