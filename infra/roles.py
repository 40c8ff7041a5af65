"""Per-user roles on `grpo serve`'s MLflow server: reader, trainer, approver (and the admin).

MLflow's basic auth knows users and per-resource permissions, and since 3.x roles with
wildcard grants; what it cannot say is "may register versions but not move @champion",
because setting any alias is checked as an edit of the registered model. This module is the
server's app (`mlflow server --app-name grpo-roles`): MLflow's basic-auth app, then one check
after MLflow's own, on who the already-authenticated user is:

- reader: reads only. Every write is refused, including the ones MLflow lets any
  authenticated user make (creating an experiment or a registered model).
- trainer: logs runs and artifacts, registers versions, sets any alias but the protected
  ones (@champion); cannot delete or rename a registered model or a version (each would move
  @champion as surely as setting it).
- approver: what a trainer may, and moves @champion, deletes and renames.
- admin (serve's own account): everything, as in MLflow.

The server, not the client, records who did it: a version gets `registered_by` when created
and `promoted_by` when a protected alias is set on it, from the authenticated user name.

Roles live in MLflow's own auth database (roles `reader`, `trainer`, `approver` with grants on
every experiment and registered model), so MLflow's permission checks and this one agree.
"""

from __future__ import annotations

import json
import re
from typing import Any

ROLES = ("reader", "trainer", "approver")
PROTECTED_ALIASES = ("champion",)
# MLflow's grants per role, on every ("*") resource of each type; MLflow checks these itself
GRANTS = {"reader": "READ", "trainer": "EDIT", "approver": "EDIT"}
GRANT_TYPES = ("experiment", "registered_model")
WORKSPACE = "default"  # where MLflow keeps roles when workspaces are off

_API = re.compile(r"^/(?:ajax-)?api/[0-9.]+/mlflow(?:-artifacts)?/(.*)$")
# POST endpoints that only read (searches) and the UI's GraphQL queries
_READ_POSTS = re.compile(r"(^|/)[a-z-]*search[a-z-]*$")
_SELF_SERVICE = ("users/update-password",)
_APPROVER_ONLY = {
    ("registered-models/delete", "DELETE"), ("model-versions/delete", "DELETE"),
    ("registered-models/rename", "POST"), ("model-versions/transition-stage", "POST"),
}  # fmt: skip
ALIAS_PATH = "registered-models/alias"


def refusal(role: str, method: str, path: str, args: dict[str, Any]) -> str | None:
    """Why `role` may not make this request (None: it may, as far as roles go; MLflow's own
    permission check has already passed). `path` is the request path, `args` its JSON body or
    query arguments. Pure, so that the whole matrix is unit-tested without a server."""
    if role in ("admin", "approver"):
        return None
    m = _API.match(path)
    if path == "/graphql" or m is None:
        return None  # the UI's pages and GraphQL queries read
    endpoint = m.group(1)
    write = method in ("PUT", "PATCH", "DELETE") or (
        method == "POST" and not _READ_POSTS.search(endpoint)
    )
    if role == "reader":
        if write and endpoint not in _SELF_SERVICE:
            return "a reader account only reads"
        return None
    if (endpoint, method) in _APPROVER_ONLY:
        return f"{endpoint} is for approver accounts (it would move @champion)"
    if endpoint == ALIAS_PATH and method in ("POST", "DELETE"):
        alias = str(args.get("alias", ""))
        if alias in PROTECTED_ALIASES:
            return f"a trainer account cannot move @{alias}: an approver runs `grpo promote`"
    return None


def create_app(app: Any = None) -> Any:
    """The MLflow server app with basic auth and these roles (entry point mlflow.app
    `grpo-roles`): MLflow's checks run first, so every request seen here is authenticated and
    allowed by MLflow's grants."""
    from mlflow.server import app as flask_app
    from mlflow.server.auth import create_app as basic_auth_app

    flask = app if app is not None else flask_app
    served = basic_auth_app(flask)
    flask.before_request(_check_role)
    flask.after_request(_record_identity)
    return served


def _request_args() -> dict[str, Any]:
    from flask import request

    body = request.get_json(silent=True) if request.is_json else None
    return {**request.args.to_dict(), **(body if isinstance(body, dict) else {})}


def role_from(is_admin: bool, role_names: set[str]) -> str:
    """An account's role: admin, the highest of its assigned roles, or reader (an account
    with no role reads, as MLflow's default permission says)."""
    if is_admin:
        return "admin"
    held = [r for r in ROLES if r in role_names]
    return held[-1] if held else "reader"


def role_of(username: str) -> str:
    """The role of an account of this server's auth database."""
    from mlflow.server.auth import store

    user = store.get_user(username)
    return role_from(user.is_admin, {r.name for r in store.list_user_roles(user.id)})


def _check_role() -> Any:
    from flask import jsonify, request

    auth = request.authorization
    if auth is None or not auth.username:
        return None  # MLflow answered already (401) or the route is unauthenticated
    why = refusal(role_of(auth.username), request.method, request.path, _request_args())
    if why is None:
        return None
    resp = jsonify(error_code="PERMISSION_DENIED", message=f"{auth.username}: {why}")
    resp.status_code = 403
    return resp


def _record_identity(response: Any) -> Any:
    """After a version is created, or a protected alias set, tag the version with the
    authenticated user who did it (the server's word, not the client's)."""
    from flask import request

    auth = request.authorization
    m = _API.match(request.path)
    if response.status_code != 200 or auth is None or m is None or request.method != "POST":
        return response
    endpoint = m.group(1)
    if endpoint == "model-versions/create":
        mv = json.loads(response.get_data(as_text=True)).get("model_version", {})
        _tag(mv.get("name"), mv.get("version"), "registered_by", auth.username)
    elif endpoint == ALIAS_PATH:
        args = _request_args()
        if args.get("alias") in PROTECTED_ALIASES:
            _tag(args.get("name"), args.get("version"), "promoted_by", auth.username)
    return response


def _tag(name: str | None, version: str | None, key: str, value: str) -> None:
    from mlflow.entities.model_registry import ModelVersionTag
    from mlflow.server.handlers import _get_model_registry_store

    if name and version:
        _get_model_registry_store().set_model_version_tag(
            name, str(version), ModelVersionTag(key, value)
        )
