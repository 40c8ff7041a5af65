"""Credentials of `grpo serve`'s two servers: made once per state directory, read by clients.

Both servers ask for credentials on every request, loopback included: any account on a shared
machine can reach 127.0.0.1, and an unauthenticated Prefect API lets it start flow runs as the
user who runs the worker, an unauthenticated MLflow lets it move @champion. The secrets live in
`<state>/.grpo-serve/credentials.json` (folder 0700, file 0600) and travel to processes only
through their environment, never on a command line, in a parameter or in a log.

A `grpo` command finds them by itself when MLFLOW_TRACKING_URI or PREFECT_API_URL names the
server recorded in the file of GRPO_SERVE_STATE (default: the project directory). Other clients
set MLflow's MLFLOW_TRACKING_USERNAME / MLFLOW_TRACKING_PASSWORD and Prefect's
PREFECT_API_AUTH_STRING from the file.
"""

from __future__ import annotations

import json
import os
import secrets
import stat
from collections.abc import MutableMapping
from dataclasses import asdict, dataclass
from pathlib import Path

from reward_fns.errors import UserError

PROJECT = Path(__file__).resolve().parents[1]
FOLDER = ".grpo-serve"
USERNAME = "admin"  # MLflow's basic-auth admin, and Prefect's single API user


class CredentialsError(UserError, RuntimeError):
    """The credentials file is unreadable, malformed or readable by others; the message names
    it."""


@dataclass(frozen=True)
class ServeCredentials:
    """The secrets of one state directory, and where its servers last listened."""

    mlflow_password: str
    prefect_password: str
    flask_secret_key: str  # MLflow's auth app signs its CSRF tokens with it
    mlflow_uri: str = ""
    prefect_api_url: str = ""
    postgres_password: str = ""  # serve --database local's server (files from before: made now)

    @property
    def prefect_auth_string(self) -> str:
        return f"{USERNAME}:{self.prefect_password}"

    def client_env(self) -> dict[str, str]:
        """What a client process (worker, flow run, CLI) needs in its environment."""
        return {
            "MLFLOW_TRACKING_USERNAME": USERNAME,
            "MLFLOW_TRACKING_PASSWORD": self.mlflow_password,
            "PREFECT_API_AUTH_STRING": self.prefect_auth_string,
        }

    def secrets(self) -> tuple[str, ...]:
        return (self.mlflow_password, self.prefect_password, self.flask_secret_key,
                self.postgres_password)  # fmt: skip


def credentials_path(state: Path) -> Path:
    return Path(state) / FOLDER / "credentials.json"


def load(state: Path) -> ServeCredentials | None:
    """The state directory's credentials, None if serve never started there."""
    path = credentials_path(state)
    try:
        mode = path.stat().st_mode
    except FileNotFoundError:
        return None
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise CredentialsError(
            f"{path}: readable by other accounts (mode {stat.S_IMODE(mode):o}); "
            f"run chmod 600 {path}, and consider the secrets in it disclosed"
        )
    try:
        return ServeCredentials(**json.loads(path.read_text()))
    except (ValueError, TypeError) as e:
        raise CredentialsError(f"{path}: not a grpo serve credentials file ({e})") from e


def create_or_load(state: Path, mlflow_uri: str, prefect_api_url: str) -> ServeCredentials:
    """The existing credentials with the servers' current addresses, or new random ones.

    The secrets never change once made: MLflow sets its admin password only when its user
    database is created, so a new password would lock the pipeline out of its own store.
    """
    old = load(state)
    creds = ServeCredentials(
        mlflow_password=old.mlflow_password if old else secrets.token_urlsafe(24),
        prefect_password=old.prefect_password if old else secrets.token_urlsafe(24),
        flask_secret_key=old.flask_secret_key if old else secrets.token_hex(32),
        postgres_password=(old.postgres_password if old else "") or secrets.token_urlsafe(24),
        mlflow_uri=mlflow_uri,
        prefect_api_url=prefect_api_url,
    )
    path = credentials_path(state)
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(path.parent, 0o700)
    tmp = path.with_suffix(".tmp")
    tmp.unlink(missing_ok=True)
    # created 0600 from the first byte (never chmod after writing: a reader could open it first)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(asdict(creds), f, indent=1)
    os.replace(tmp, path)
    return creds


def _same_server(a: str, b: str) -> bool:
    return bool(a) and a.rstrip("/") == b.rstrip("/")


def apply_to_environment(environ: MutableMapping[str, str] | None = None) -> list[str]:
    """Give this process the credentials of the served state directory whose servers
    MLFLOW_TRACKING_URI / PREFECT_API_URL name; returns the variables it set.

    Credentials go only to the server recorded beside them, and a variable the user set wins.
    """
    env = os.environ if environ is None else environ
    tracking, api = env.get("MLFLOW_TRACKING_URI", ""), env.get("PREFECT_API_URL", "")
    if not tracking.startswith("http") and not api.startswith("http"):
        return []
    creds = load(Path(env.get("GRPO_SERVE_STATE") or PROJECT))
    if creds is None:
        return []
    wanted = creds.client_env()
    keys = []
    if _same_server(creds.mlflow_uri, tracking):
        keys += ["MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD"]
    if _same_server(creds.prefect_api_url, api):
        keys.append("PREFECT_API_AUTH_STRING")
    set_now = [k for k in keys if not env.get(k)]
    for k in set_now:
        env[k] = wanted[k]
    return set_now
