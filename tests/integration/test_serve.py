"""`grpo serve` end to end: real Prefect server, MLflow server and worker in subprocesses.

The deployment is triggered through Prefect's API (run_deployment) instead of waiting for the
cron; the worker runs it; the MLflow server must then hold the runs, metrics, artifacts and the
registered version, read over HTTP. Both servers want the credentials serve generated: the
attacks of an account without them are replayed and refused. Stopping serve must leave no
process behind.
"""

from __future__ import annotations

import base64
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
import pytest
import yaml

from grpo.launch.runner import free_port
from tasks.server_auth import credentials_path
from tests.helpers import ROOT, by_stage, small_config

pytestmark = [pytest.mark.slow, pytest.mark.serve]

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
        self.api = f"http://127.0.0.1:{self.prefect}/api"
        self.tracking = f"http://127.0.0.1:{self.mlflow}"
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
        }

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
        with urllib.request.urlopen(req, timeout=30) as r:
            return json.loads(r.read())

    def api_get(self, path: str) -> dict:
        req = urllib.request.Request(f"{self.api}{path}", headers=self._auth())
        with urllib.request.urlopen(req, timeout=30) as r:
            return json.loads(r.read())

    def api_patch(self, path: str, body: dict) -> None:
        hdrs = {"Content-Type": "application/json", **self._auth()}
        req = urllib.request.Request(f"{self.api}{path}", data=json.dumps(body).encode(),
                                     headers=hdrs, method="PATCH")  # fmt: skip
        with urllib.request.urlopen(req, timeout=30):
            pass

    def flow_run_state(self, run_id: str) -> str:
        req = urllib.request.Request(f"{self.api}/flow_runs/{run_id}", headers=self._auth())
        with urllib.request.urlopen(req, timeout=30) as r:
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


def _server_memory(s: Served) -> dict[str, float]:
    """Resident memory (MB) of each server with its children (server workers, PostgreSQL's
    backends), now: Prefect and MLflow are serve's children, PostgreSQL is the postmaster of
    the state directory's cluster."""
    roots = {"prefect": s.child("server start"), "mlflow": s.child("--app-name")}
    pid_file = s.state / "postgres" / "postmaster.pid"
    if pid_file.exists():
        roots["postgres"] = psutil.Process(int(pid_file.read_text().split()[0]))
    out: dict[str, float] = {}
    for name, root in roots.items():
        try:
            tree = [root, *root.children(recursive=True)]
            out[name] = sum(q.memory_info().rss for q in tree) / 2**20
        except psutil.NoSuchProcess:
            continue
    return out


def _grpo_stage_running(c) -> str | None:  # noqa: ANN001
    """A GRPO stage run of serve-e2e that is RUNNING and has logged a step, if any."""
    exp = c.get_experiment_by_name("serve-e2e")
    if exp is None:
        return None
    for r in c.search_runs([exp.experiment_id], "attributes.status = 'RUNNING'"):
        if r.info.run_name.endswith("/grpo") and "reward" in r.data.metrics:
            return r.info.run_id
    return None


def _restart_postgres(data: Path) -> float:
    """pg_ctl restart (fast: open connections are cut); returns the seconds it took."""
    from flows.postgres import pg_ctl_as_owner

    t0 = time.time()
    pg_ctl_as_owner(data, "restart")
    return time.time() - t0


def _check_postgres(s: Served, mlflow_run: str, flow_run: str) -> None:
    import psycopg

    sock = s.state / "postgres"
    with pytest.raises(psycopg.OperationalError, match="password"):
        psycopg.connect(host=str(sock), user="postgres", dbname="mlflow")
    pw = s.creds["postgres_password"]
    with psycopg.connect(host=str(sock), user="postgres", dbname="mlflow", password=pw) as con:
        got = con.execute("SELECT status FROM runs WHERE run_uuid = %s", (mlflow_run,))
        assert got.fetchone() == ("FINISHED",)
        (n,) = con.execute("SELECT count(*) FROM metrics m JOIN runs r USING (run_uuid) "
                           "WHERE r.name LIKE %s", ("%/grpo",)).fetchone()  # fmt: skip
        assert n > 0
    with psycopg.connect(host=str(sock), user="postgres", dbname="prefect", password=pw) as con:
        (state,) = con.execute("SELECT state_type FROM flow_run WHERE id = %s",
                               (flow_run,)).fetchone()  # fmt: skip
        assert state == "COMPLETED"


def _status(method: str, url: str, body: object = None, headers: dict | None = None) -> int:
    """The HTTP status of one request (no exception for 4xx)."""
    data = body if isinstance(body, bytes) else None if body is None else json.dumps(body).encode()
    hdrs = {"Content-Type": "application/json", **(headers or {})}
    req = urllib.request.Request(url, data=data, method=method, headers=hdrs)
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


def _replay_attacks(s: Served) -> None:
    """What an account on the machine without the credentials tried (issue #22), refused."""
    deps = s.api_post("/deployments/filter", {})
    dep_id = next(d["id"] for d in deps if d["name"] == "nightly-tiny")
    pwned = s.state.parent / "pwned"
    attack = {"job_variables": {"command": f"sh -c 'id > {pwned}'"}}
    create = f"{s.api}/deployments/{dep_id}/create_flow_run"
    assert _status("POST", create, attack) == 401
    # even with the credentials, the pool's template lets no flow run set a command or env
    assert _status("POST", create, attack, s._auth()) == 422
    env_attack = {"job_variables": {"env": {"LD_PRELOAD": "x"}}}
    assert _status("POST", create, env_attack, s._auth()) == 422
    # the deployment's cron schedule may already have queued its next runs; none other exists
    made = [r for r in s.api_post("/flow_runs/filter", {}) if not r["auto_scheduled"]]
    assert made == [], [(r["name"], r["created_by"], r["job_variables"]) for r in made]
    # MLflow: create a run, upload an artifact through the proxy, register it, move @champion
    api = f"{s.tracking}/api/2.0/mlflow"
    assert _status("POST", f"{api}/runs/create", {"experiment_id": "0"}) == 401
    art = f"{s.tracking}/api/2.0/mlflow-artifacts/artifacts/0/x/MLmodel"
    assert _status("PUT", art, b"flavors: {}") == 401
    assert _status("POST", f"{api}/registered-models/create", {"name": "serve-e2e"}) == 401
    version = {"name": "serve-e2e", "source": "mlflow-artifacts:/0/x"}
    assert _status("POST", f"{api}/model-versions/create", version) == 401
    alias = {"name": "serve-e2e", "alias": "champion", "version": "1"}
    assert _status("POST", f"{api}/registered-models/alias", alias) == 401
    assert _status("POST", f"{api}/experiments/search", {"max_results": 1}) == 401

    # every call of both APIs, without credentials, with a wrong password, or with another
    # server's password, is refused, reads included
    def basic(user: str, pw: str) -> dict[str, str]:
        return {"Authorization": "Basic " + base64.b64encode(f"{user}:{pw}".encode()).decode()}

    wrong = [None, basic("admin", "wrong"), basic("admin", s.creds["mlflow_password"]),
             basic("nobody", s.creds["prefect_password"])]  # fmt: skip
    prefect_calls = [
        ("POST", f"{s.api}/flow_runs/filter", {}),
        ("POST", f"{s.api}/deployments/filter", {}),
        ("POST", f"{s.api}/block_documents/filter", {}),
        ("POST", f"{s.api}/automations/filter", {}),
        ("GET", f"{s.api}/deployments/{dep_id}", None),
        ("POST", create, {}),
    ]
    for method, url, body in prefect_calls:
        for hdrs in wrong[:2] + wrong[2:3]:  # the MLflow password is wrong here
            assert _status(method, url, body, hdrs) == 401, (method, url, hdrs)
    mlflow_calls = [
        ("POST", f"{api}/runs/create", {"experiment_id": "0"}),
        ("POST", f"{api}/experiments/search", {"max_results": 1}),
        ("GET", f"{api}/registered-models/search", None),
        ("POST", f"{api}/registered-models/alias", alias),
        ("PUT", art, b"x"),
    ]
    for method, url, body in mlflow_calls:
        for hdrs in wrong[:2] + wrong[3:]:  # the Prefect password is wrong here
            assert _status(method, url, body, hdrs) == 401, (method, url, hdrs)
    assert not pwned.exists()


def _cmdlines() -> set[str]:
    """Every process's command line, as any account on the machine can read it."""
    out = set()
    for p in psutil.process_iter():
        try:
            out.add(" ".join(p.cmdline()))
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return out


def _alive(procs: list[psutil.Process]) -> list[str]:
    out = []
    for p in procs:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                out.append(" ".join(p.cmdline())[:120])
        except psutil.NoSuchProcess:
            continue
    return out


def test_a_triggered_deployment_runs_on_the_worker_and_lands_in_the_mlflow_server(
    tmp_path, monkeypatch
):
    from mlflow import MlflowClient

    hook = Receiver()
    s = Served(tmp_path, "serve-e2e", alert_url=hook.url, database="local")
    w2 = None
    try:
        s.wait_ready()
        out = s.out.read_text()
        assert f"alerts to http://127.0.0.1:{hook.server.server_port}/..." in out
        assert credentials_path(s.state).stat().st_mode & 0o077 == 0
        _replay_attacks(s)
        # a second serve on the same state directory is refused and leaves the first's logs
        worker_log = s.state / "runs" / "serve" / "mlflow.log"
        before = worker_log.stat().st_size
        second = subprocess.run(
            [str(Path(sys.executable).with_name("grpo")), "serve", "--state-dir", str(s.state),
             "--prefect-port", str(free_port()), "--mlflow-port", str(free_port())],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert second.returncode == 2, second.stderr
        assert "another grpo serve" in second.stderr and len(second.stderr.splitlines()) == 1
        assert worker_log.stat().st_size >= before > 0
        for k, v in s.client_env().items():
            monkeypatch.setenv(k, v)
        # a run of the deployment that fails (a bad parameter): the receiver is told, naming it
        bad = s.trigger(timeout=0, overrides=["grpo.steps=0"])
        assert s.wait_state(bad["id"], (*WAITING, "RUNNING"), 180, "the bad run ended") == "FAILED"
        note = hook.wait_for(lambda b: b.get("flow_run_id") == bad["id"], 60, "no failure alert")
        assert note["path"] == f"/hooks/{hook.token}"
        assert note["body"]["alert"] == "flow run failed" and note["body"]["state"] == "Failed"
        assert "grpo.steps" in note["body"]["message"] and DEPLOYMENT in note["body"]["deployment"]
        assert note["body"]["url"].endswith(f"/runs/flow-run/{bad['id']}")
        print("failure alert as received:", json.dumps(note["body"], indent=1))
        # and, no run having completed for 15 s, the nightly's staleness alert
        hook.wait_for(lambda b: b.get("alert", "").startswith("no completed run"), 60,
                      "no staleness alert")  # fmt: skip
        # load: a second worker on the pool, started as on a trainer machine (`grpo worker`),
        # the pool and the deployment at two runs at once, four runs triggered together
        worker_out = tmp_path / "worker2.out"
        w2 = subprocess.Popen(
            [str(Path(sys.executable).with_name("grpo")), "worker", "--pool", "e2e-pool",
             "--name", "second-worker"],
            env={**os.environ, **s.client_env(), "PREFECT_WORKER_QUERY_SECONDS": "2"},
            stdout=worker_out.open("w"), stderr=subprocess.STDOUT, cwd=tmp_path,
        )  # fmt: skip
        dep = s.api_get(f"/deployments/name/{DEPLOYMENT}")
        s.api_patch("/work_pools/e2e-pool", {"concurrency_limit": 2})
        s.api_patch(f"/deployments/{dep['id']}", {"concurrency_limit": 2})
        t0 = time.time()
        # the first run as the deployment says (with its SFT control), three without the
        # control, to keep the test's time down
        quick = {"params": {**dep["parameters"]["params"], "control": False}}
        runs = [s.api_post(f"/deployments/{dep['id']}/create_flow_run",
                           {"parameters": quick} if i else {})["id"]
                for i in range(4)]  # fmt: skip
        cmdlines, deadline = set(), time.time() + 900  # the process list, sampled each second
        peak, most_at_once, restarted = {}, 0, None
        c = MlflowClient(s.tracking, s.tracking)
        while states := [st for r in runs if (st := s.flow_run_state(r)) in (*WAITING, "RUNNING")]:
            most_at_once = max(most_at_once, states.count("RUNNING"))
            if restarted is None and (training := _grpo_stage_running(c)):
                # PostgreSQL restarted under both servers while a GRPO stage streams metrics
                restarted = (training, _restart_postgres(s.state / "postgres"))
            cmdlines |= _cmdlines()
            for name, mb in _server_memory(s).items():
                peak[name] = max(peak.get(name, 0.0), mb)
            assert time.time() < deadline, f"4 runs not finished within 900s: {states}"
            assert w2.poll() is None, worker_out.read_text()[-2000:]
            time.sleep(1)
        took = time.time() - t0
        ended = [s.flow_run_state(r) for r in runs]
        print(f"4 flow runs on 2 workers ended {ended} after {took:.0f}s, at most "
              f"{most_at_once} at once; peak memory (MB): {peak}")  # fmt: skip
        assert ended == ["COMPLETED"] * 4, s.out.read_text()[-3000:]
        assert restarted is not None, "no GRPO stage was seen running"
        print(f"PostgreSQL restarted in {restarted[1]:.1f}s while {restarted[0]} trained")
        assert most_at_once <= 2  # the concurrency limit held
        # the second worker took part
        assert "Worker 'second-worker' submitting flow run" in worker_out.read_text(), (
            worker_out.read_text()[-2000:])  # fmt: skip
        run = {"id": runs[0]}
        # the evaluation table and the link to the MLflow run, on the flow run in Prefect
        query = {"artifacts": {"flow_run_id": {"any_": [run["id"]]}}}
        by_key = {a["key"]: a for a in s.api_post("/artifacts/filter", query)}
        assert {"evaluation", "evaluation-summary", "mlflow-run"} <= set(by_key)
        link = by_key["mlflow-run"]["data"]
        assert link.startswith("[MLflow run ") and s.tracking in link
        assert "?workflowType=machine_learning" in link  # the UI's runs view, not its GenAI one

        exp = c.get_experiment_by_name("serve-e2e")
        assert exp.artifact_location.startswith("mlflow-artifacts:")  # proxied by the server
        parents = c.search_runs([exp.experiment_id], "tags.run_kind = 'pipeline'")
        # four pipelines, each whole: its own stage runs, every metric point of its GRPO stage
        finished = [p for p in parents if p.info.status == "FINISHED"]
        assert len(finished) == 4, [(p.info.run_id, p.info.status) for p in parents]
        grpo_runs = {}
        for p in finished:
            kids = c.search_runs(
                [exp.experiment_id], f"tags.mlflow.parentRunId = '{p.info.run_id}'"
            )
            by_name = by_stage(kids)
            assert {"validate", "sft", "grpo", "evaluate"} <= set(by_name)
            grpo_runs[p.info.run_id] = by_name["grpo"].info.run_id
            steps = [m.step for m in c.get_metric_history(grpo_runs[p.info.run_id], "reward")]
            assert steps == [1, 2], steps
        (parent,) = [p for p in finished if p.info.run_id in link]
        first = c.search_runs([exp.experiment_id],
                              f"tags.mlflow.parentRunId = '{parent.info.run_id}'")  # fmt: skip
        assert "sft_continued" in by_stage(first)  # the deployment's own parameters: a control
        grpo_run = grpo_runs[parent.info.run_id]
        # an artifact's bytes come back over HTTP through the server's proxy
        local = c.download_artifacts(grpo_run, "completions.json", str(tmp_path / "dl"))
        assert json.loads(Path(local).read_text())
        # the registry: one version per pipeline, unique numbers, each decision recorded
        # against the champion it was measured with; never two champions
        versions = c.search_model_versions("name = 'serve-e2e'")
        assert sorted(v.run_id for v in versions) == sorted(grpo_runs.values())
        assert len({v.version for v in versions}) == 4
        assert all(v.tags["gate/decision"] and "gate/champion_version" in v.tags for v in versions)
        aliases = c.get_registered_model("serve-e2e").aliases
        assert set(aliases) <= {"champion", "challenger"}
        (mv,) = [v for v in versions if v.run_id == grpo_run]
        # both stores are in the PostgreSQL serve started (no SQLite file), which asks for the
        # password it was given and holds what the servers showed
        assert not list(s.state.glob("*.db")) and "stores: PostgreSQL" in s.out.read_text()
        _check_postgres(s, parent.info.run_id, run["id"])

        # the CLI finds the credentials by itself (GRPO_SERVE_STATE) for promote and evaluate
        cli_env = {k: v for k, v in os.environ.items() if not k.endswith(("USERNAME", "PASSWORD"))}
        cli_env |= {"MLFLOW_TRACKING_URI": s.tracking, "GRPO_SERVE_STATE": str(s.state)}
        grpo = str(Path(sys.executable).with_name("grpo"))
        out = subprocess.run([grpo, "promote", "--config", str(s.config), "--version", mv.version,
                              "--reason", "e2e"], env=cli_env, capture_output=True, text=True,
                             cwd=tmp_path, timeout=120)  # fmt: skip
        assert out.returncode == 0, out.stderr[-2000:]
        assert c.get_model_version_by_alias("serve-e2e", "champion").version == mv.version
        out = subprocess.run([grpo, "evaluate", "--config", str(s.config), "--model",
                              "models:/serve-e2e@champion", "--sets", "synthetic", "--limit", "8",
                              "--out", str(tmp_path / "ev")], env=cli_env, capture_output=True,
                             text=True, cwd=tmp_path, timeout=300)  # fmt: skip
        assert out.returncode == 0, out.stderr[-2000:]
        assert (tmp_path / "ev" / "report.json").exists()

        # no secret in MLflow params or tags, Prefect parameters, logs or command lines
        secrets = [s.creds["mlflow_password"], s.creds["prefect_password"],
                   s.creds["flask_secret_key"], s.creds["postgres_password"],
                   hook.token]  # fmt: skip
        recorded = [json.dumps(r.data.params) + json.dumps(r.data.tags) for r in parents + kids]
        recorded += [json.dumps(mv.tags), json.dumps(s.api_post("/flow_runs/filter", {}))]
        for f in s.state.rglob("*"):
            if f.is_file() and f != credentials_path(s.state) and f.suffix != ".db":
                recorded.append(f.read_text(errors="replace"))
        recorded += [*sorted(cmdlines), s.out.read_text(), worker_out.read_text()]
        assert not [x for x in secrets for r in recorded if x in r]

        below = s.children()
        assert len(below) >= 3
    finally:
        if w2 is not None:
            w2.send_signal(signal.SIGINT)
            w2.wait(timeout=60)
        rc = s.stop()
    assert rc == 0, s.out.read_text()[-2000:]
    time.sleep(1)
    assert not _alive(below), _alive(below)
    # nor its PostgreSQL, restarted under it or not
    pg = [p.pid for p in psutil.process_iter(["cmdline"])
          if f"-D {s.state / 'postgres'}" in " ".join(p.info["cmdline"] or [])]  # fmt: skip
    assert not pg, pg
    # after serve, a plain command in the same state directory resolves its own sqlite store,
    # not serve's (a plain pipeline's store: tests/integration/test_install.py)
    env = {k: v for k, v in os.environ.items() if k not in s.client_env()}
    code = ("from grpo.config import load_config; from tasks.tracking import tracking_uri; "
            "from tasks.server_auth import apply_to_environment; apply_to_environment(); "
            f"print(tracking_uri(load_config({str(s.config)!r}, [])))")  # fmt: skip
    out = subprocess.run([sys.executable, "-c", code], cwd=s.state, env=env,
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == f"sqlite:///{s.state / 'mlflow.db'}"


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
    assert not _alive(below), _alive(below)


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
