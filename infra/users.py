"""`grpo users`: accounts with a role on a served MLflow (infra.roles), managed by its admin.

The admin's credentials come as for any client (GRPO_SERVE_STATE's credentials file, or
MLFLOW_TRACKING_USERNAME/PASSWORD). A new account's password is made here and written to a
0600 file for the person or worker it is for, never printed, put on a command line or logged.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path
from typing import Any

from infra.roles import GRANT_TYPES, GRANTS, ROLES, WORKSPACE, role_from
from reward_fns.errors import UserError


class UsersError(UserError, RuntimeError):
    """A user command that cannot be done; the message says why."""


def _client() -> Any:
    import warnings

    with warnings.catch_warnings():  # MLflow's server module imports a deprecated Starlette one
        warnings.simplefilter("ignore", DeprecationWarning)
        from mlflow.server.auth.client import AuthServiceClient

    uri = os.environ.get("MLFLOW_TRACKING_URI", "")
    if not uri.startswith(("http://", "https://")):
        raise UsersError("grpo users: set MLFLOW_TRACKING_URI to the served MLflow "
                         "(http(s)://HOST:5000) and GRPO_SERVE_STATE to serve's state "
                         "directory")  # fmt: skip
    return AuthServiceClient(uri)


def ensure_roles(client: Any) -> dict[str, Any]:
    """The three roles in MLflow's auth database, each with its grant on every experiment and
    registered model; made the first time, found after. Returns {name: Role}."""
    have = {r.name: r for r in client.list_roles(WORKSPACE)}
    for name in ROLES:
        if name not in have:
            role = client.create_role(WORKSPACE, name, description=f"grpo-pipeline {name}")
            for kind in GRANT_TYPES:
                client.add_role_permission(role.id, kind, "*", GRANTS[name])
            have[name] = role
    return have


def add_user(name: str, role: str, out: Path | None = None) -> Path:
    """Create account `name` with `role` on the served MLflow; its password goes to a 0600 file.

    Args:
        name: the account's user name (what the server records as `registered_by` and
            `promoted_by`).
        role: reader, trainer or approver (infra.roles).
        out: where to write the account's client settings (default:
            <GRPO_SERVE_STATE or project>/.grpo-serve/users/<name>.env); refused if it exists.
    Returns the file written: MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD lines, for
    the account's holder to load into their environment.
    """
    from infra.auth import FOLDER, PROJECT, USERNAME

    if role not in ROLES:
        raise UsersError(f"--role {role!r}: expected one of {', '.join(ROLES)}")
    if name == USERNAME or not name.replace("-", "").replace("_", "").isalnum():
        raise UsersError(f"user name {name!r}: letters, digits, - and _ only, and not {USERNAME}")
    state = Path(os.environ.get("GRPO_SERVE_STATE") or PROJECT)
    path = Path(out) if out else state / FOLDER / "users" / f"{name}.env"
    if path.exists():
        raise UsersError(f"{path} exists: remove the account first (grpo users remove {name})")
    client = _client()
    roles = ensure_roles(client)
    password = secrets.token_urlsafe(24)
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    # created 0600 before the secret is written; the account exists only once the file does
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(f"MLFLOW_TRACKING_USERNAME={name}\nMLFLOW_TRACKING_PASSWORD={password}\n")
    try:
        client.create_user(name, password)
        client.assign_role(name, roles[role].id)
    except BaseException:
        path.unlink()
        raise
    return path


def remove_user(name: str) -> None:
    """Delete account `name` (its roles go with it) and its settings file under the state
    directory, if there.

    Args:
        name: the account's user name.
    """
    from infra.auth import FOLDER, PROJECT

    _client().delete_user(name)
    state = Path(os.environ.get("GRPO_SERVE_STATE") or PROJECT)
    (state / FOLDER / "users" / f"{name}.env").unlink(missing_ok=True)


def list_users() -> list[tuple[str, str]]:
    """Every account and its role (admin for MLflow admins), sorted by name."""
    client = _client()
    from mlflow.server.auth.routes import LIST_USERS  # imported by _client, warnings and all

    users = client._request(LIST_USERS, "GET")["users"]
    return sorted((u["username"], role_from(u["is_admin"], {r["name"] for r in u["roles"]}))
                  for u in users)  # fmt: skip
