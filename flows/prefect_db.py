"""The local Prefect database of a pipeline run without a Prefect server."""

from __future__ import annotations

import asyncio
from pathlib import Path

from grpo.launch.paths import file_lock


def migrate_local_database() -> None:
    """Create or migrate Prefect's sqlite database under PREFECT_HOME, one process at a time.

    Without PREFECT_API_URL each pipeline starts a temporary Prefect server, which migrates the
    database as it starts. Two pipelines started at once on a fresh PREFECT_HOME race in that
    migration (alembic: "No such index ..."), and one fails; here the first migrates under a
    file lock and the second finds the schema current (about 50 ms).
    """
    from prefect.settings import get_current_settings

    settings = get_current_settings()
    url = settings.server.database.connection_url
    url = url.get_secret_value() if url is not None else ""
    if settings.api.url or not url.startswith("sqlite"):
        return
    from prefect.server.database import provide_database_interface

    home = Path(settings.home)
    home.mkdir(parents=True, exist_ok=True)
    with file_lock(home / "grpo-migrate.lock"):
        asyncio.run(provide_database_interface().create_db())
