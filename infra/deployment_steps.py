"""Prefect deployment steps of prefect.yaml, run by each flow run on its worker's machine.

A flow run starts in its worker's working directory and must find the project there: the
deployment's entrypoint (flows/pipeline.py) and configs are paths relative to it. Resolving the
project at deploy time would pin every worker to serve's path; here each flow run resolves it
on its own worker, so a worker may run from any checkout at any path.
"""

from __future__ import annotations

import os
from pathlib import Path

from reward_fns.errors import UserError

PROJECT_VAR = "GRPO_PROJECT_DIR"


class ProjectDirError(UserError, RuntimeError):
    """The worker's project directory does not hold the pipeline; the message names it."""


def enter_project() -> dict[str, str]:
    """Change into this worker's project: GRPO_PROJECT_DIR if set, else the checkout (or
    installed copy) this module was imported from. Returns {"directory": the path}."""
    here = Path(__file__).resolve().parents[1]
    project = Path(os.environ.get(PROJECT_VAR) or here).expanduser().resolve()
    if not (project / "flows" / "pipeline.py").is_file():
        raise ProjectDirError(
            f"{project}: no flows/pipeline.py here; set {PROJECT_VAR} to the worker's checkout "
            "of grpo-pipeline"
        )
    os.chdir(project)
    # the worker's log shows it; one write, line and newline together, so that another
    # process writing to the same log cannot land between them
    print(f"flow run in the project at {project}\n", end="", flush=True)
    return {"directory": str(project)}
