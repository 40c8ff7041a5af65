"""`grpo serve` end to end: real Prefect server, MLflow server and worker in subprocesses.

The deployment is triggered through Prefect's API (run_deployment) instead of waiting for the
cron; the worker runs it; the MLflow server must then hold the runs, metrics, artifacts and the
registered version, read over HTTP. Both servers want the credentials serve generated: the
attacks of an account without them are replayed and refused. Stopping serve must leave no
process behind. (A dead worker and a dead MLflow server: test_serve_crash.py.)
"""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import psutil
import pytest

from grpo.launch.runner import free_port
from infra.auth import credentials_path
from tests.helpers import by_stage
from tests.serve_harness import DEPLOYMENT, WAITING, Receiver, Served, alive

pytestmark = [pytest.mark.slow, pytest.mark.serve]


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
    from infra.postgres import pg_ctl_as_owner

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
        # and the flow run's own state message and log in Prefect (what its UI page shows)
        # the flow run's log lines reach the API in batches, possibly after its final state
        deadline = time.time() + 30
        while (said := s.why(bad["id"])).count("grpo.steps: Input should be greater than 0") < 2:
            assert time.time() < deadline, said
            time.sleep(1)
        assert "FAILED: Flow run encountered an exception: ConfigError" in said, said
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
        assert ended == ["COMPLETED"] * 4, "\n".join(
            s.why(r) for r, st in zip(runs, ended, strict=True) if st != "COMPLETED"
        )
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
        # `grpo compare` against the authenticated server, its credentials from the
        # environment: the first pipeline (with its control) against another (without)
        other = next(p for p in finished if p.info.run_id != parent.info.run_id)
        cmp = subprocess.run(
            [str(Path(sys.executable).with_name("grpo")), "compare", parent.info.run_id,
             other.info.run_id, "--format", "json"],
            capture_output=True, text=True, timeout=180, cwd=tmp_path,
        )  # fmt: skip
        assert cmp.returncode == 0, cmp.stderr[-2000:]
        got = json.loads(cmp.stdout)
        paired = {(r["model"], r["set"]): r for r in got["paired"]}
        acc = "grpo/eval/synthetic/accuracy"
        assert paired[("grpo", "synthetic")]["diff"] == pytest.approx(
            other.data.metrics[acc] - parent.data.metrics[acc])  # fmt: skip
        assert {"model": "sft_continued", "set": "*", "why": "not evaluated in B"} in (
            got["unpaired"])  # fmt: skip
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
        rc = s.stop(w2)
    assert rc == 0, s.out.read_text()[-2000:]
    time.sleep(1)
    assert not alive(below), alive(below)
    # nor its PostgreSQL, restarted under it or not
    pg = [p.pid for p in psutil.process_iter(["cmdline"])
          if f"-D {s.state / 'postgres'}" in " ".join(p.info["cmdline"] or [])]  # fmt: skip
    assert not pg, pg
    # after serve, a plain command in the same state directory resolves its own sqlite store,
    # not serve's (a plain pipeline's store: tests/integration/test_install.py)
    env = {k: v for k, v in os.environ.items() if k not in s.client_env()}
    code = ("from grpo.config import load_config; from tasks.tracking import tracking_uri; "
            "from infra.auth import apply_to_environment; apply_to_environment(); "
            f"print(tracking_uri(load_config({str(s.config)!r}, [])))")  # fmt: skip
    out = subprocess.run([sys.executable, "-c", code], cwd=s.state, env=env,
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == f"sqlite:///{s.state / 'mlflow.db'}"
