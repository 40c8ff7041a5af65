"""A run's lifecycle: machine and owner tags, how it ends, orphaned runs closed, resume."""

from __future__ import annotations

import functools
import os
import subprocess
from pathlib import Path
from typing import Any

from grpo.config import Config
from reward_fns.errors import UserError
from tasks.tracking.client import PROJECT, client, tracking_uri

# settings that change which CPU kernels run, so the numbers a seed gives
# (benchmarks/NUMERICS.md)
NUMERICS_VARS = ("MKL_CBWR", "ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "OMP_NUM_THREADS")


@functools.cache
def _machine() -> tuple[tuple[str, str], ...]:
    return tuple(_machine_tags().items())


def machine_tags() -> dict[str, str]:
    """Run tags naming the machine behind the numbers: CPU model, the instruction set torch's
    kernels use, cores and threads, and any variable of NUMERICS_VARS that is set (read once a
    process: every stage run of a pipeline carries them)."""
    return dict(_machine())


def _machine_tags() -> dict[str, str]:
    import platform

    import torch

    cpuinfo = Path("/proc/cpuinfo")
    names = [ln.split(":", 1)[1].strip() for ln in cpuinfo.read_text().splitlines()
             if ln.startswith("model name")] if cpuinfo.exists() else []  # fmt: skip
    tags = {
        "host.cpu": names[0] if names else platform.processor() or platform.machine(),
        "host.cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "host.cpu_count": str(os.cpu_count()),
        "host.torch_threads": str(torch.get_num_threads()),
        "host.torch": torch.__version__,
    }
    tags.update({f"host.env.{k}": os.environ[k] for k in NUMERICS_VARS if k in os.environ})
    return tags


def git_commit() -> str:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=PROJECT, capture_output=True, text=True, timeout=5
        )
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return out.stdout.strip() or "unknown"


def package_version() -> str:
    """The installed grpo-pipeline version (package metadata, not a literal in the code)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("grpo-pipeline")
    except PackageNotFoundError:
        return "unknown (not installed)"


def end_status(e: BaseException) -> str:
    """The MLflow status of a run that ended with `e`: KILLED when a person stopped it (Ctrl-C:
    KeyboardInterrupt; SIGTERM: KeyboardInterrupt from the CLI, TerminationSignal from Prefect's
    engine while a flow runs), FAILED otherwise."""
    from prefect.exceptions import TerminationSignal

    return "KILLED" if isinstance(e, (KeyboardInterrupt, TerminationSignal)) else "FAILED"


# the experiment tag by which MLflow's UI picks its view: model training (the runs list)
EXPERIMENT_KIND = ("mlflow.experimentKind", "custom_model_development")


# tags on a pipeline's parent run that say which process owns it while it is RUNNING
OWNER_TAGS = ("pipeline.host", "pipeline.pid", "pipeline.pid_started")


FLOW_RUN_TAG = "prefect.flow_run_id"


def owner_tags() -> dict[str, str]:
    """This process as the owner of a RUNNING parent run: host, pid and the pid's start time
    (a pid alone may have been reused by the time anyone looks)."""
    import socket

    import psutil
    from prefect.runtime import flow_run

    me = psutil.Process()
    tags = dict(zip(OWNER_TAGS, (socket.gethostname(), str(me.pid), f"{me.create_time():.3f}")))
    if flow_run.id:  # grpo serve ends this run KILLED when that flow run is marked Crashed
        tags[FLOW_RUN_TAG] = str(flow_run.id)
    return tags


def _owner_alive(tags: dict[str, str]) -> bool:
    import psutil

    try:
        p = psutil.Process(int(tags["pipeline.pid"]))
        return f"{p.create_time():.3f}" == tags["pipeline.pid_started"]
    except (psutil.NoSuchProcess, psutil.AccessDenied, ValueError):
        return False


def start_pipeline_run(client: Any, experiment_id: str, cfg: Config, source: str) -> str:
    """A pipeline's parent run: tagged with the commit, config and data digests, machine and
    owner (so a killed one can be recognised), its params and resolved config logged; returns
    its run id."""
    import time

    from tasks.tracking.params import log_params, safe_params

    parent = client.create_run(
        experiment_id,
        run_name=f"{cfg.run_name}-{time.strftime('%Y%m%d-%H%M%S')}",
        tags={"mlflow.source.git.commit": git_commit(), "mlflow.source.type": "JOB",
              "mlflow.source.name": source, "config_digest": cfg.digest(),
              "data_hash": cfg.digest("data"), "pipeline_version": package_version(),
              "run_kind": "pipeline", **machine_tags(), **owner_tags()},
    )  # fmt: skip
    pid = parent.info.run_id
    log_params(client, pid, safe_params(cfg))
    client.log_dict(pid, cfg.model_dump(mode="json"), "config/resolved.json")
    return pid


KILLED_BY_TAG = "killed_by"


def end_killed(
    client: Any, experiment_ids: list[str], parent_ids: list[str], why: str
) -> list[str]:
    """The one way a pipeline's runs that cannot end themselves are ended: each parent's
    RUNNING stage runs, then the parent, tagged `killed_by: why` and ended KILLED. Stages go
    first: whoever sees a parent ended (the UI, a script polling it) never finds one of its
    stages still RUNNING. Returns the run ids ended."""
    ended: list[str] = []
    for pid in parent_ids:
        stages = client.search_runs(
            experiment_ids, f"attributes.status = 'RUNNING' and tags.mlflow.parentRunId = '{pid}'"
        )
        for rid in [r.info.run_id for r in stages] + [pid]:
            client.set_tag(rid, KILLED_BY_TAG, why)
            client.set_terminated(rid, "KILLED")
            ended.append(rid)
    return ended


def close_orphaned_runs(client: Any, experiment_id: str) -> list[str]:
    """End KILLED the parent runs (and their stage runs) that a pipeline on this host left
    RUNNING when it was killed outright (SIGKILL, a lost machine): their owner process is gone.
    Runs of other hosts are left alone (their owners cannot be checked from here); a Prefect
    flow run that crashed on any host is `grpo serve`'s to end (infra.reaper). Returns the
    names of the parent runs closed."""
    import socket

    host = socket.gethostname().replace("'", "")
    running = client.search_runs(
        [experiment_id],
        f"attributes.status = 'RUNNING' and tags.`pipeline.host` = '{host}'",
    )
    orphans = [run for run in running if not _owner_alive(run.data.tags)]
    for run in orphans:
        why = f"its pipeline process {run.data.tags.get('pipeline.pid')} on {host} is gone"
        end_killed(client, [experiment_id], [run.info.run_id], why)
    return [run.info.run_name for run in orphans]


def end_runs_of_flow_run(client: Any, flow_run_id: str, why: str) -> list[str]:
    """End KILLED the pipeline runs (and their stage runs) of a Prefect flow run that crashed,
    in every experiment of the store; returns the run ids ended."""
    ids = [e.experiment_id for e in client.search_experiments()]
    if not ids:
        return []
    parents = client.search_runs(
        ids, f"tags.`{FLOW_RUN_TAG}` = '{flow_run_id}' and attributes.status = 'RUNNING'"
    )
    return end_killed(client, ids, [p.info.run_id for p in parents], why)


class ResumeError(UserError, ValueError):
    """A pipeline run that cannot be resumed; the message says why."""


def check_resumable(cfg: Config, run_id: str) -> None:
    """Refuse (ResumeError) a --resume of anything but an unfinished pipeline of this
    experiment, made with this config, whose run directory is still there and whose owner is
    gone: checked before a server or a stage starts."""
    c = client(cfg)
    exp = c.get_experiment_by_name(cfg.tracking.experiment)
    if exp is None:
        raise ResumeError(f"--resume {run_id}: no experiment {cfg.tracking.experiment!r} in "
                          f"{tracking_uri(cfg)}")  # fmt: skip
    _resumable(c, exp.experiment_id, run_id, cfg)


def reopen_parent(client: Any, experiment_id: str, run_id: str, cfg: Config) -> str:
    """check_resumable, then mark the run RUNNING again, owned by this process. Returns the
    run id."""
    tags = _resumable(client, experiment_id, run_id, cfg)
    client.update_run(run_id, status="RUNNING")
    for k, v in owner_tags().items():
        client.set_tag(run_id, k, v)
    client.set_tag(run_id, "resumed", str(int(tags.get("resumed", "0")) + 1))
    return run_id


def _resumable(client: Any, experiment_id: str, run_id: str, cfg: Config) -> dict[str, str]:
    from mlflow.exceptions import MlflowException

    try:
        run = client.get_run(run_id)
    except MlflowException as e:
        raise ResumeError(f"--resume {run_id}: no such MLflow run in {tracking_uri(cfg)}") from e
    tags, status = run.data.tags, run.info.status
    if run.info.experiment_id != experiment_id or "mlflow.parentRunId" in tags:
        raise ResumeError(f"--resume {run_id}: not a pipeline run of {cfg.tracking.experiment!r}")
    if status == "FINISHED":
        raise ResumeError(f"--resume {run_id}: that pipeline finished; start a new one")
    if status == "RUNNING" and _owner_alive(tags):
        raise ResumeError(f"--resume {run_id}: still running (pid {tags.get('pipeline.pid')})")
    if tags.get("config_digest") != cfg.digest():
        raise ResumeError(
            f"--resume {run_id}: it ran with another config (digest {tags.get('config_digest')}, "
            f"this one {cfg.digest()}): give the same --config and --set as it had"
        )
    run_dir = Path(cfg.output_dir) / cfg.run_name / run_id
    if not run_dir.is_dir():
        raise ResumeError(f"--resume {run_id}: its run directory {run_dir} is gone")
    return tags


def record_decision(client: Any, parent_id: str, reg: dict[str, Any]) -> None:
    """The promotion decision on the pipeline's parent run, where a user comparing runs looks:
    tags (version, aliases, decision, reason) and the run's description (MLflow's note)."""
    aliases = "champion,challenger" if reg["champion"] else "challenger"
    tags = {
        "promotion.version": str(reg["version"]), "promotion.aliases": aliases,
        "promotion.decision": "promoted" if reg["champion"] else "not promoted",
        "promotion.reason": reg["reason"], "mlflow.note.content": reg["decision"],
    }  # fmt: skip
    for k, v in tags.items():
        client.set_tag(parent_id, k, v)
