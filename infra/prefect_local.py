"""A pipeline run without a Prefect server: its local database and its temporary API."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

from grpo.launch.paths import file_lock
from infra.supervision import wait_http


@contextlib.contextmanager
def _local_database_lock() -> Iterator[None]:
    """Held while this process starts a server on Prefect's local sqlite database; holds
    nothing when another database is configured."""
    from prefect.settings import get_current_settings

    settings = get_current_settings()
    url = settings.server.database.connection_url
    if not (url.get_secret_value() if url is not None else "").startswith("sqlite"):
        yield
        return
    with file_lock(Path(settings.home) / "grpo-server-start.lock"):
        yield


@contextlib.contextmanager
def pipeline_api(startup_s: float = 120) -> Iterator[None]:
    """Prefect's API for one pipeline run: the configured server (PREFECT_API_URL), or else a
    temporary one started here, like the one Prefect itself starts (the same app, no UI, no
    background services), but in its own session.

    Prefect's own temporary server is a child in the pipeline's process group, so Ctrl-C in the
    terminal stops it too, first; the flow then cannot record its end, and Prefect's client
    retried the dead server for 2-4 minutes before exiting. In its own session it outlives the
    interrupt, the flow records it, and the server is stopped last.
    """
    from prefect.settings import PREFECT_API_URL, get_current_settings, temporary_settings

    if get_current_settings().api.url:
        yield
        return
    import prefect

    from grpo.launch.runner import free_port, stop_processes

    port = free_port()
    env = {**os.environ, "PREFECT_UI_ENABLED": "0", "PREFECT__SERVER_EPHEMERAL": "1",
           "PREFECT__SERVER_FINAL": "1"}  # fmt: skip
    cmd = [sys.executable, "-m", "uvicorn", "--app-dir", str(Path(prefect.__file__).parents[1]),
           "--factory", "prefect.server.api.server:create_app", "--host", "127.0.0.1",
           "--port", str(port), "--log-level", "error", "--lifespan", "on"]  # fmt: skip
    url = f"http://127.0.0.1:{port}/api"
    # one server starting at a time on a shared local database: as it starts, the app migrates
    # the database and registers Prefect's block types, and two pipelines started at once on a
    # fresh PREFECT_HOME collided in both (alembic's "No such index ...", then "UNIQUE
    # constraint failed: block_type.slug", the second server exiting with 3; seen in CI). The
    # second waits here, then finds the schema current.
    with _local_database_lock():
        proc = subprocess.Popen(cmd, env=env, start_new_session=True)
        try:
            _wait_healthy(url, proc, startup_s)
        except BaseException:
            stop_processes([proc])
            raise
    try:
        with temporary_settings({PREFECT_API_URL: url}):
            try:
                yield
            finally:
                _drain_to_server()
    finally:
        stop_processes([proc])


def _drain_to_server(timeout_s: float = 10) -> None:
    """Send Prefect's queued logs and events while the server still answers: left for exit,
    they would retry a stopped server for half a minute."""
    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker

    for service in (APILogWorker, EventsWorker):
        service.drain_all(timeout=timeout_s, at_exit=False)


def _wait_healthy(url: str, proc: subprocess.Popen, seconds: float) -> None:
    wait_http(f"{url}/health", seconds, "the temporary Prefect server", proc=proc, interval=0.1)
