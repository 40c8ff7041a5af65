"""The MLflow client and store: where it is, whether it answers, the experiment."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from grpo.config import Config
from grpo.launch.paths import file_lock
from reward_fns.errors import UserError

PROJECT = Path(__file__).resolve().parents[2]


def tracking_uri(cfg: Config) -> str:
    """MLFLOW_TRACKING_URI, the config's, or sqlite mlflow.db in the working directory (beside
    runs/, the default output_dir)."""
    return (
        os.environ.get("MLFLOW_TRACKING_URI")
        or cfg.tracking.tracking_uri
        or f"sqlite:///{(Path.cwd() / 'mlflow.db').resolve()}"
    )


def artifact_location(uri: str) -> str | None:
    """Where a new experiment of store `uri` keeps its artifacts: for a sqlite file, mlruns/
    beside it, not MLflow's default of ./mlruns in whatever directory the process runs in (the
    tests' stores in temporary directories wrote into the project's); a server or another
    store chooses (None)."""
    if uri.startswith("sqlite:///"):
        return (Path(uri.removeprefix("sqlite:///")).parent / "mlruns").resolve().as_uri()
    return None


def experiment(c: Any, name: str, uri: str) -> tuple[str, dict[str, str]]:
    """The id and tags of experiment `name` of store `uri`, created (no tags) when missing. Two
    pipelines started at once on a new experiment (a deployment's first runs on two workers)
    both find none: the second's create is refused as a duplicate and it takes the first's,
    instead of failing its flow run (the likely cause of a serve test's failed run in CI)."""
    from mlflow.exceptions import MlflowException

    if (exp := c.get_experiment_by_name(name)) is not None:
        return exp.experiment_id, dict(exp.tags)
    try:
        return c.create_experiment(name, artifact_location=artifact_location(uri)), {}
    except MlflowException as e:
        if e.error_code != "RESOURCE_ALREADY_EXISTS" or (
            exp := c.get_experiment_by_name(name)) is None:  # fmt: skip
            raise
        return exp.experiment_id, dict(exp.tags)


_SCHEMA_READY: set[str] = set()  # sqlite stores this process has opened under the lock


class TrackingUnreachable(UserError, RuntimeError):
    """The tracking store or server cannot be used; the message names its URI."""


def check_reachable(cfg: Config, timeout_s: float = 5.0) -> None:
    """Before anything starts: an http(s) tracking server answers /health within timeout_s; a
    sqlite store's folder is writable. (MLflow's own client retries for minutes.)"""
    import urllib.error
    import urllib.request

    uri = tracking_uri(cfg)
    if uri.startswith(("http://", "https://")):
        try:
            with urllib.request.urlopen(f"{uri.rstrip('/')}/health", timeout=timeout_s):
                return
        except (urllib.error.URLError, OSError, ValueError) as e:
            reason = getattr(e, "reason", e)
            raise TrackingUnreachable(
                f"MLflow tracking server {uri} unreachable ({reason}); start it, or unset "
                "MLFLOW_TRACKING_URI / tracking.tracking_uri to use the local sqlite store"
            ) from e
    if uri.startswith("sqlite:///"):
        folder = Path(uri.removeprefix("sqlite:///")).parent
        if not folder.is_dir() or not os.access(folder, os.W_OK):
            raise TrackingUnreachable(f"{uri}: the store's folder {folder} is not writable")


def client(cfg: Config) -> Any:
    import mlflow
    from mlflow import MlflowClient

    uri = tracking_uri(cfg)
    mlflow.set_tracking_uri(uri)
    mlflow.set_registry_uri(uri)
    if uri.startswith("sqlite:///") and uri not in _SCHEMA_READY:
        # the first client of a store creates or migrates its schema, which is not safe from
        # two processes at once: one at a time (both stores: tracking, registry)
        db = Path(uri.removeprefix("sqlite:///"))
        with file_lock(db.with_name(db.name + ".lock")):
            c = MlflowClient(tracking_uri=uri, registry_uri=uri)
            c.search_registered_models(max_results=1)
        _SCHEMA_READY.add(uri)
        return c
    return MlflowClient(tracking_uri=uri, registry_uri=uri)
