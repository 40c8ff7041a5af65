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

Reserved version tags, so that the record a promotion is judged by cannot be forged:
- `registered_by`, `promoted_by`: the server's word; no account but the admin sets or
  deletes them, on any version or in a version's create request.
- `gate/*`, `approval/*`, `promotion`: the word of the pipeline that registered the version
  (its gate, then its approval flow): set only by the account the server recorded as
  `registered_by`, so no other trainer can rewrite another's evidence or decision.
- `manual/<protected alias>` (what `grpo promote` writes): only accounts that may move it.
- none is deleted by anyone but the admin.
The pipeline relies on no run tag for promotion (the gate re-reads metrics it paired itself).

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
SERVER_TAGS = ("registered_by", "promoted_by")
PIPELINE_TAG_PREFIXES = ("gate/", "approval/")
PIPELINE_TAGS = ("promotion",)
VERSION_TAG_PATHS = ("model-versions/set-tag", "model-versions/delete-tag")


def reserved_tag(key: str) -> str | None:
    """Which reserved kind a model-version tag key is: "server", "pipeline", "manual" (a
    protected alias's manual record) or None for a tag any editor may write."""
    if key in SERVER_TAGS:
        return "server"
    if key in PIPELINE_TAGS or key.startswith(PIPELINE_TAG_PREFIXES):
        return "pipeline"
    if key in {f"manual/{a}" for a in PROTECTED_ALIASES}:
        return "manual"
    return None


def _tag_refusal(
    role: str, user: str, key: str, delete: bool, registrant: str | None
) -> str | None:
    kind = reserved_tag(key)
    if kind is None:
        return None
    if delete:
        return f"tag {key!r} is reserved: only the server's admin deletes it"
    if kind == "server":
        return f"tag {key!r} is reserved: only the server writes it"
    if kind == "manual":
        if role == "approver":
            return None
        return f"tag {key!r} is reserved for approver accounts (it records moving @champion)"
    if registrant is None or registrant != user:
        return (
            f"tag {key!r} is reserved for the account that registered this version "
            f"({registrant or 'unknown'}), whose pipeline's gate and approval write it"
        )
    return None


def refusal(
    role: str,
    method: str,
    path: str,
    args: dict[str, Any],
    *,
    user: str = "",
    registrant: str | None = None,
) -> str | None:
    """Why `role` may not make this request (None: it may, as far as roles go; MLflow's own
    permission check has already passed). Pure, so that the whole matrix is unit-tested
    without a server.

    Args:
        role: the account's role (role_from).
        method: the HTTP method.
        path: the request path.
        args: its JSON body or query arguments.
        user: the authenticated account name.
        registrant: the `registered_by` tag of the version a set-tag names (None: none).
    """
    if role == "admin":
        return None
    m = _API.match(path)
    if path == "/graphql" or m is None:
        return None  # the UI's pages and GraphQL queries read
    endpoint = m.group(1)
    if role != "reader" and endpoint in VERSION_TAG_PATHS:
        delete = endpoint.endswith("delete-tag")
        if why := _tag_refusal(role, user, str(args.get("key", "")), delete, registrant):
            return why
    if role != "reader" and endpoint == "model-versions/create":
        for tag in args.get("tags") or []:
            key = str(tag.get("key", "")) if isinstance(tag, dict) else ""
            if reserved_tag(key) == "server":
                return f"tag {key!r} is reserved: only the server writes it"
    if role == "approver":
        return None
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
    args = _request_args()
    registrant = None
    if request.path.endswith(VERSION_TAG_PATHS) and reserved_tag(str(args.get("key", ""))):
        registrant = _registrant(args.get("name"), args.get("version"))
    why = refusal(role_of(auth.username), request.method, request.path, args,
                  user=auth.username, registrant=registrant)  # fmt: skip
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


def _registrant(name: Any, version: Any) -> str | None:
    """The account the server recorded as having registered a version (None: no such
    version, or registered with no server recording it)."""
    from mlflow.exceptions import MlflowException
    from mlflow.server.handlers import _get_model_registry_store

    if not name or not version:
        return None
    try:
        mv = _get_model_registry_store().get_model_version(str(name), str(version))
    except MlflowException:
        return None
    return mv.tags.get("registered_by")


def _tag(name: str | None, version: str | None, key: str, value: str) -> None:
    from mlflow.entities.model_registry import ModelVersionTag
    from mlflow.server.handlers import _get_model_registry_store

    if name and version:
        _get_model_registry_store().set_model_version_tag(
            name, str(version), ModelVersionTag(key, value)
        )
