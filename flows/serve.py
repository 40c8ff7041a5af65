"""`grpo serve`: local Prefect and MLflow servers, the work pool, the deployment and a worker.

Everything listens on 127.0.0.1 unless GRPO_SERVE_HOST says otherwise, and both servers ask for
the credentials that tasks.server_auth keeps in the state directory (loopback is no boundary on
a shared machine). The deployment (with its cron schedule) is declared in prefect.yaml; the
worker runs scheduled pipeline runs with a job template that fixes the command and environment.
The servers' state (Prefect's home, the MLflow store and artifacts, the credentials, the logs)
lives in one state directory, the project directory by default; one serve at a time holds it.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from urllib.parse import urlsplit

import psutil

from flows import alerts, postgres
from flows.postgres import Stores
from flows.reaper import Reaper
from reward_fns.errors import UserError
from tasks import server_auth

PROJECT = Path(__file__).resolve().parents[1]
POOL = "grpo-process-pool"
DEPLOYMENT = "nightly-tiny"  # the deployment in prefect.yaml
REAP_EVERY_S = 10  # how often serve looks for crashed flow runs whose MLflow runs still run


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


class ServeError(UserError, RuntimeError):
    """A server or the worker died, a setup command failed, or another serve holds the state
    directory; the message names it."""


def locked_job_template() -> dict:
    """The process pool's base job template with nothing a flow run could use to run code.

    Prefect's default template lets each flow run set the worker's `command`, `env` and
    `working_dir`: whoever may create a flow run could run any command as the worker's user.
    Here they are fixed (command None: the worker's own `python -m prefect.engine`), and a flow
    run that names them, or any other variable, is refused by the server's validation.
    """
    optional_str = {"anyOf": [{"type": "string"}, {"type": "null"}], "default": None}
    return {
        "job_configuration": {
            "command": None, "env": {}, "working_dir": None, "labels": "{{ labels }}",
            "name": "{{ name }}", "stream_output": "{{ stream_output }}",
        },
        "variables": {
            "type": "object",
            "additionalProperties": False,
            "properties": {
                "name": {**optional_str, "title": "Name"},
                "labels": {"type": "object", "additionalProperties": {"type": "string"},
                           "title": "Labels"},
                "stream_output": {"type": "boolean", "default": True, "title": "Stream Output"},
            },
        },
    }  # fmt: skip


def _hold_state_dir(private: Path) -> object:
    """An exclusive lock on the state directory for as long as the returned file stays open;
    a second serve on the same directory is refused before it touches anything."""
    lock = (private / "serve.lock").open("a+")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.seek(0)
        holder = lock.read().strip() or "unknown"
        lock.close()
        raise ServeError(
            f"another grpo serve (pid {holder}) holds the state directory {private.parent}; "
            "stop it first, or give this one its own --state-dir"
        ) from None
    lock.seek(0)
    lock.truncate()
    lock.write(str(os.getpid()))
    lock.flush()
    return lock


def serve(
    config: str | None,
    prefect_port: int = 4200,
    mlflow_port: int = 5000,
    state_dir: str | Path | None = None,
    pool: str = POOL,
    stale_hours: float = alerts.STALE_HOURS,
    database: str | None = None,
    crashed_after_s: int = alerts.CRASHED_AFTER_S,
) -> None:
    """Start everything, deploy `config` as the scheduled pipeline, watch the children.

    The MLflow server has its own store (mlflow-serve.db, artifacts proxied to mlartifacts/):
    runs created through a server get mlflow-artifacts:/ locations, which a direct sqlite
    client cannot read, so the plain CLI's mlflow.db is never shared with it. Point the CLI at
    the server with MLFLOW_TRACKING_URI=http://127.0.0.1:5000 to use the served store.
    """
    host = os.environ.get("GRPO_SERVE_HOST", "127.0.0.1")
    alert_url = os.environ.get(alerts.URL_VAR)
    if alert_url is not None and urlsplit(alert_url).scheme not in ("http", "https"):
        raise ServeError(f"{alerts.URL_VAR} must be an http(s) URL, got {alert_url[:8]!r}...")
    if stale_hours * 3600 < 10:
        raise ServeError("--alert-stale-hours must be at least 10 seconds (Prefect's minimum)")
    state = Path(state_dir).resolve() if state_dir else PROJECT
    private = server_auth.credentials_path(state).parent
    private.mkdir(mode=0o700, parents=True, exist_ok=True)
    lock = _hold_state_dir(private)  # noqa: F841 (held until this function returns)
    api_url, tracking = f"http://{host}:{prefect_port}/api", f"http://{host}:{mlflow_port}"
    creds = server_auth.create_or_load(state, tracking, api_url)
    stores = _stores(database, state, creds)
    env = {k: v for k, v in os.environ.items() if not _credential_var(k)}
    env.update({
        "PREFECT_HOME": str(state / ".prefect"),
        "PREFECT_API_URL": api_url,
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "DO_NOT_TRACK": "true",
        "MLFLOW_TRACKING_URI": tracking,
        "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false",
        "HF_HUB_OFFLINE": "1",
        "GRPO_SERVE_STATE": str(state),
        # prefect.yaml's pull step is {{ $PWD }}: the project, wherever serve was started from
        "PWD": str(PROJECT),
        **creds.client_env(),
    })  # fmt: skip
    # the servers' own secrets go to the server that needs each, nowhere else
    server_env = {
        "prefect": {
            "PREFECT_SERVER_API_AUTH_STRING": creds.prefect_auth_string,
            **stores.server_env(),
            **(
                {"PREFECT_API_DATABASE_CONNECTION_URL": stores.prefect_url}
                if stores.prefect_url
                else {}
            ),
        },
        "mlflow": {
            **stores.server_env(),
            "MLFLOW_AUTH_CONFIG_PATH": str(_write_auth_ini(private, stores.mlflow_auth_uri)),
            "MLFLOW_AUTH_ADMIN_USERNAME": server_auth.USERNAME,
            "MLFLOW_AUTH_ADMIN_PASSWORD": creds.mlflow_password,
            "MLFLOW_FLASK_SERVER_SECRET_KEY": creds.flask_secret_key,
        },
    }
    logs = state / "runs" / "serve"
    logs.mkdir(parents=True, exist_ok=True)
    procs: dict[str, subprocess.Popen] = {}

    def start(cmd: list[str], name: str) -> None:
        f = (logs / f"{name}.log").open("w")
        # a session of its own: stopping it stops its children too (server workers, flow runs)
        procs[name] = subprocess.Popen(
            cmd, env={**env, **server_env.get(name, {})}, stdout=f, stderr=subprocess.STDOUT,
            start_new_session=True, cwd=PROJECT,
        )  # fmt: skip

    stop = {"signal": None}

    def on_signal(signum: int, frame: object) -> None:
        stop["signal"] = signum

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    db = stores.mlflow_uri
    start(
        [_bin("prefect"), "server", "start", "--host", host, "--port", str(prefect_port)], "prefect"
    )
    start([_bin("mlflow"), "server", "--app-name", "basic-auth", "--backend-store-uri", db,
           "--artifacts-destination", str(state / "mlartifacts"), "--host", host,
           "--port", str(mlflow_port), "-w", "1"], "mlflow")  # fmt: skip
    try:
        _wait(f"{api_url}/health", 120, "Prefect server")
        _wait(f"{tracking}/health", 120, "MLflow server")
        template = private / "pool-job-template.json"
        template.write_text(json.dumps(locked_job_template(), indent=1))
        _run([_bin("prefect"), "work-pool", "create", pool, "--type", "process", "--overwrite",
              "--base-job-template", str(template)], env, "creating the work pool")  # fmt: skip
        params = {"params": {"config": str(Path(config).resolve()) if config else None,
                             "overrides": [], "control": True}}  # fmt: skip
        _run([_bin("prefect"), "--no-prompt", "deploy", "--name", DEPLOYMENT, "--pool", pool,
              "--params", json.dumps(params)], env, "deploying prefect.yaml")  # fmt: skip
        # the URL goes to this one process only: it may hold a token
        _run([sys.executable, "-m", "flows.alerts", f"grpo-pipeline/{DEPLOYMENT}",
              str(stale_hours), str(crashed_after_s)],
             {**env, **({alerts.URL_VAR: alert_url} if alert_url else {})},
             "creating the automations")  # fmt: skip
        if alert_url:
            said = (f"alerts to {alerts.where(alert_url)}: a failed or crashed run, no "
                    f"completed run for {stale_hours:g} h")  # fmt: skip
        else:
            said = f"alerts off (set {alerts.URL_VAR} to a webhook URL to have them)"
        said += f"; a run with no heartbeat for {crashed_after_s} s is set Crashed"
        reaper = Reaper(api_url, tracking, creds.prefect_auth_string,
                        f"{server_auth.USERNAME}:{creds.mlflow_password}")  # fmt: skip
        # one flow run at a time on serve's machine (a pipeline uses every core); more
        # pipelines at once need more workers (`grpo worker`, on this machine or others)
        start([_bin("prefect"), "worker", "start", "--pool", pool, "--limit", "1"], "worker")
        print(f"Prefect UI: http://{host}:{prefect_port}")
        print(f"MLflow UI:  http://{host}:{mlflow_port}")
        print(f"deployment grpo-pipeline/{DEPLOYMENT} runs {config or 'the default config'}")
        print(said)
        print(f"stores: {stores.describe}")
        print(f"credentials (user {server_auth.USERNAME}): {server_auth.credentials_path(state)}")
        print(f"logs in {logs}; Ctrl-C stops everything", flush=True)
        last_sweep = 0.0
        while stop["signal"] is None:
            for name, p in procs.items():
                if p.poll() is not None:
                    raise ServeError(
                        f"the {name} process exited with {p.returncode}; see {logs / name}.log"
                    )
            if time.time() - last_sweep > REAP_EVERY_S:
                last_sweep = time.time()
                _sweep(reaper)
            time.sleep(1)
    finally:
        _stop_all(procs)
        stores.stop()


def _sweep(reaper: Reaper) -> None:
    """The MLflow runs of crashed flow runs, ended; a server that does not answer now is
    said in one line and tried again at the next sweep."""
    try:
        if ended := reaper.sweep():
            print(f"ended KILLED {len(ended)} MLflow run(s) of crashed flow runs: "
                  f"{', '.join(ended)}", flush=True)  # fmt: skip
    except (urllib.error.URLError, OSError, ValueError) as e:
        print(f"could not end the MLflow runs of crashed flow runs now: {e}", flush=True)


def worker(pool: str = POOL, name: str | None = None, limit: int = 1) -> None:
    """Another worker for a running serve's pool, on this machine or another: checks that the
    Prefect API (PREFECT_API_URL, credentials as for any client) answers, then becomes
    `prefect worker start`. Its flow runs need the project at the same path as serve's (the
    deployment's pull step) and MLflow's address and credentials in this environment."""
    api = os.environ.get("PREFECT_API_URL", "")
    if not api.startswith(("http://", "https://")):
        raise ServeError(
            "grpo worker: set PREFECT_API_URL to the serve's API (http://HOST:4200/api) and its "
            "credentials (README, For a team)"
        )
    needed = ("MLFLOW_TRACKING_URI", "PREFECT_API_AUTH_STRING")
    missing = [k for k in needed if not os.environ.get(k)]
    if missing:
        raise ServeError(f"grpo worker: {', '.join(missing)} not set: its flow runs could not "
                         "reach the servers (README, For a team)")  # fmt: skip
    import base64

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
    cmd = [_bin("prefect"), "worker", "start", "--pool", pool, "--limit", str(limit),
           *(["--name", name] if name else [])]  # fmt: skip
    os.execv(cmd[0], cmd)


def _credential_var(name: str) -> bool:
    """Credentials the caller's shell may hold for other servers: never passed on."""
    return name in ("PREFECT_API_KEY", "PREFECT_API_AUTH_STRING", "PREFECT_SERVER_API_AUTH_STRING",
                    "MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD",
                    "MLFLOW_TRACKING_TOKEN", "MLFLOW_AUTH_ADMIN_PASSWORD",
                    alerts.URL_VAR, "PGPASSWORD")  # fmt: skip


def _stores(database: str | None, state: Path, creds: server_auth.ServeCredentials) -> Stores:
    """The two servers' stores: SQLite files in the state directory (one person), the wheel's
    PostgreSQL there (`local`), or a team's PostgreSQL server (a URL)."""
    if database is None:
        return Stores(f"sqlite:///{state / 'mlflow-serve.db'}", "", None,
                      f"SQLite in {state}",
                      mlflow_auth_uri=f"sqlite:///{server_auth.credentials_path(state).parent}"
                      "/mlflow-auth.db")  # fmt: skip
    if database == "local":
        return postgres.local(state, creds.postgres_password)
    return postgres.external(database, os.environ.get("PGPASSWORD"))


def _write_auth_ini(private: Path, database_uri: str) -> Path:
    """MLflow's basic-auth settings: users in the state directory; the admin's password comes
    from the environment (MLFLOW_AUTH_ADMIN_PASSWORD), so this file holds no secret."""
    ini = private / "mlflow-auth.ini"
    ini.write_text(
        "[mlflow]\n"
        "default_permission = READ\n"
        f"database_uri = {database_uri}\n"
        f"admin_username = {server_auth.USERNAME}\n"
        "authorization_function = mlflow.server.auth:authenticate_request_basic_auth\n"
        # a password check is a slow key derivation (PBKDF2) on every request; one server
        # worker, so a cached success is never stale across workers
        "auth_cache_ttl_seconds = 300\n"
    )
    return ini


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
