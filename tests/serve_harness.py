"""`grpo serve` as the serve tests start it: the command in a subprocess with its ports, state
directory and output, a client of its servers, and a webhook receiver for its alerts."""

from __future__ import annotations

import base64
import json
import os
import signal
import ssl
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import psutil
import yaml

from grpo.launch.runner import free_port
from infra.auth import credentials_path
from tests.helpers import ROOT, small_config

DEPLOYMENT = "grpo-pipeline/nightly-tiny"
READY = "Ctrl-C stops everything"
WAITING = ("SCHEDULED", "PENDING")  # not yet picked up by a worker


class Served:
    """A running `grpo serve` with its ports, state directory and output files."""

    def __init__(
        self, tmp: Path, model_name: str, alert_url: str | None = None,
        database: str | None = None, extra: tuple[str, ...] = (),
    ) -> None:  # fmt: skip
        cfg = small_config(
            tmp, f"tracking.registered_model={model_name}", "tracking.experiment=serve-e2e",
            f"deepspeed.master_port={free_port()}",
        )  # fmt: skip
        self.config = tmp / "serve.yaml"
        self.config.write_text(yaml.safe_dump(cfg.model_dump(mode="json")))
        self.prefect, self.mlflow = free_port(), free_port()
        self.state, self.out = tmp / "state", tmp / "serve.out"
        env = {**os.environ, "PREFECT_WORKER_QUERY_SECONDS": "2"}
        env.pop("MLFLOW_TRACKING_URI", None)
        env.pop("GRPO_ALERT_WEBHOOK_URL", None)
        stale: list[str] = []
        if alert_url:  # the nightly's "no completed run" alert after 15 s instead of 26 h
            env["GRPO_ALERT_WEBHOOK_URL"] = alert_url
            stale = ["--alert-stale-hours", str(15 / 3600)]
        if database:
            stale += ["--database", database]
        stale += list(extra)
        # flow runs beat every 30 s (Prefect's least; 180 by default), so that a dead one is
        # found within a test's patience
        env["PREFECT_FLOWS_HEARTBEAT_FREQUENCY"] = "30"
        for k in ("MLFLOW_TRACKING_URI", "MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD"):
            env.pop(k, None)
        # started outside the project: the deployment must still find flows/pipeline.py
        self.proc = subprocess.Popen(
            [str(Path(sys.executable).with_name("grpo")), "serve", "--config", str(self.config),
             "--prefect-port", str(self.prefect), "--mlflow-port", str(self.mlflow),
             "--state-dir", str(self.state), "--pool", "e2e-pool", *stale],
            stdout=self.out.open("w"), stderr=subprocess.STDOUT, env=env, cwd=tmp,
        )  # fmt: skip
        scheme = "https" if "--tls-self-signed" in extra else "http"
        self.api = f"{scheme}://127.0.0.1:{self.prefect}/api"
        self.tracking = f"{scheme}://127.0.0.1:{self.mlflow}"
        tls = self.state / ".grpo-serve" / "tls"
        self.ca = tls / "ca-bundle.pem" if scheme == "https" else None
        self.creds: dict = {}

    def wait_ready(self, seconds: float = 300) -> None:
        deadline = time.time() + seconds
        while time.time() < deadline:
            if READY in self.out.read_text():
                self.creds = json.loads(credentials_path(self.state).read_text())
                return
            assert self.proc.poll() is None, f"serve exited early:\n{self.out.read_text()}"
            time.sleep(1)
        raise AssertionError(f"serve not ready in {seconds}s:\n{self.out.read_text()}")

    def client_env(self) -> dict[str, str]:
        """What a client is told to set (README): the credentials file's secrets."""
        return {
            "MLFLOW_TRACKING_URI": self.tracking,
            "MLFLOW_TRACKING_USERNAME": "admin",
            "MLFLOW_TRACKING_PASSWORD": self.creds["mlflow_password"],
            "PREFECT_API_URL": self.api,
            "PREFECT_API_AUTH_STRING": f"admin:{self.creds['prefect_password']}",
            # on https: the standard variables name the CA bundle serve made
            **({"SSL_CERT_FILE": str(self.ca), "REQUESTS_CA_BUNDLE": str(self.ca)}
               if self.ca else {}),
        }  # fmt: skip

    def ssl_context(self) -> ssl.SSLContext | None:
        """On https: a context that trusts serve's CA bundle (and nothing else)."""
        return ssl.create_default_context(cafile=str(self.ca)) if self.ca else None

    def _auth(self) -> dict[str, str]:
        token = base64.b64encode(f"admin:{self.creds['prefect_password']}".encode()).decode()
        return {"Authorization": f"Basic {token}"}

    def children(self) -> list[psutil.Process]:
        return psutil.Process(self.proc.pid).children(recursive=True)

    def child(self, word: str) -> psutil.Process:
        """The direct child whose command line holds `word` (mlflow, worker, ...)."""
        kids = psutil.Process(self.proc.pid).children()
        return next(p for p in kids if word in " ".join(p.cmdline()))

    def trigger(self, timeout: float, overrides: list[str] | None = None) -> dict:
        """run_deployment through Prefect's client, in a process pointed at this server."""
        params = {"params": {"overrides": overrides}} if overrides else None
        code = (
            "import json, sys\n"
            "from prefect.deployments import run_deployment\n"
            f"fr = run_deployment({DEPLOYMENT!r}, timeout={timeout}, parameters={params!r})\n"
            "print(json.dumps({'id': str(fr.id), 'state': fr.state.type.value}))\n"
        )
        env = {**os.environ, **self.client_env()}
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                             text=True, timeout=timeout + 120, cwd=ROOT)  # fmt: skip
        assert out.returncode == 0, out.stderr[-2000:]
        return json.loads(out.stdout.strip().splitlines()[-1])

    def api_post(self, path: str, body: dict) -> object:
        hdrs = {"Content-Type": "application/json", **self._auth()}
        req = urllib.request.Request(f"{self.api}{path}", data=json.dumps(body).encode(),
                                     headers=hdrs)  # fmt: skip
        with urllib.request.urlopen(req, timeout=30, context=self.ssl_context()) as r:
            return json.loads(r.read())

    def api_get(self, path: str) -> dict:
        req = urllib.request.Request(f"{self.api}{path}", headers=self._auth())
        with urllib.request.urlopen(req, timeout=30, context=self.ssl_context()) as r:
            return json.loads(r.read())

    def api_patch(self, path: str, body: dict) -> None:
        hdrs = {"Content-Type": "application/json", **self._auth()}
        req = urllib.request.Request(f"{self.api}{path}", data=json.dumps(body).encode(),
                                     headers=hdrs, method="PATCH")  # fmt: skip
        with urllib.request.urlopen(req, timeout=30, context=self.ssl_context()):
            pass

    def flow_run_state(self, run_id: str) -> str:
        req = urllib.request.Request(f"{self.api}/flow_runs/{run_id}", headers=self._auth())
        with urllib.request.urlopen(req, timeout=30, context=self.ssl_context()) as r:
            return json.loads(r.read())["state"]["type"]

    def why(self, run_id: str, lines: int = 40) -> str:
        """A flow run's state, its message and its last log lines: what a failed run said."""
        state = self.api_get(f"/flow_runs/{run_id}")["state"]
        query = {"logs": {"flow_run_id": {"any_": [run_id]}}, "sort": "TIMESTAMP_DESC"}
        logs = self.api_post("/logs/filter", {**query, "limit": lines})
        said = "\n".join(f"  {x['message']}" for x in reversed(logs))
        return f"{run_id} {state['type']}: {state.get('message')}\n{said}"

    def wait_state(self, run_id: str, leave: tuple[str, ...], seconds: float, what: str) -> str:
        """Poll the flow run until its state is not in `leave`; fail naming `what` otherwise."""
        deadline = time.time() + seconds
        while (state := self.flow_run_state(run_id)) in leave:
            assert time.time() < deadline, f"{what} within {seconds:.0f}s (still {state})"
            assert self.proc.poll() is None, f"serve exited:\n{self.out.read_text()[-2000:]}"
            time.sleep(1)
        return state

    def stop(self, *workers: subprocess.Popen | None) -> int:
        """Ctrl-C to the test's own extra workers (those started), then to serve; its code."""
        for w in workers:
            if w is not None:
                w.send_signal(signal.SIGINT)
                w.wait(timeout=60)
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
        return self.proc.wait(timeout=120)


class Receiver:
    """An HTTP server on loopback that records every POST it gets (the alerts' webhook)."""

    def __init__(self) -> None:
        import threading
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        got = self.got = []

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server's name)
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                try:
                    got.append({"path": self.path, "body": json.loads(body)})
                except ValueError:  # recorded as text: the test fails naming it
                    got.append({"path": self.path, "body": {"not_json": body.decode()}})
                self.send_response(204)
                self.end_headers()

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        # a path with a token in it, as a chat service's webhook has: never printed or logged
        self.token = "tok-" + base64.b32encode(os.urandom(10)).decode().lower()
        self.url = f"http://127.0.0.1:{self.server.server_port}/hooks/{self.token}"

    def wait_for(self, pred, seconds: float, what: str) -> dict:  # noqa: ANN001
        deadline = time.time() + seconds
        while time.time() < deadline:
            if hits := [g for g in self.got if pred(g["body"])]:
                return hits[0]
            time.sleep(0.5)
        raise AssertionError(f"{what} within {seconds:.0f}s; received: {self.got}")


def alive(procs: list[psutil.Process]) -> list[str]:
    out = []
    for p in procs:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                out.append(" ".join(p.cmdline())[:120])
        except psutil.NoSuchProcess:
            continue
    return out
