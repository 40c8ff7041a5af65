"""MLflow glue: the tracking store, params, batched step metrics, plots, tables.

Runs are addressed by id (never the thread-local active run): Prefect may run tasks in threads.
"""

from __future__ import annotations

import functools
import json
import os
import re
import subprocess
import time
from pathlib import Path
from typing import Any

from grpo.config import Config
from grpo.launch.paths import file_lock
from reward_fns.errors import UserError

PROJECT = Path(__file__).resolve().parents[1]
SECRET_WORDS = ("token", "password", "secret", "key")


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


# settings that change which CPU kernels run, so the numbers a seed gives (README "Same
# numbers on any CPU")
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


def safe_params(cfg: Config) -> dict[str, str]:
    """Flattened config: keys that look like credentials left out, URL passwords masked."""
    return public_params(cfg.flat())


def section_params(cfg: Config, sections: tuple[str, ...]) -> dict[str, str]:
    """safe_params of the given top-level config sections, with the seed and run name that
    every stage depends on."""
    keep = tuple(f"{s}." for s in sections)
    return {k: v for k, v in safe_params(cfg).items()
            if k.startswith(keep) or k in ("seed", "run_name")}  # fmt: skip


def public_params(flat: dict[str, Any]) -> dict[str, str]:
    """Params without credentials: a key whose last part has a word of SECRET_WORDS is left
    out (a count of tokens is not a token), user:password@ in URLs masked, values cut to 500.

    >>> public_params({"eval.max_new_tokens": 8, "hub.hf_token": "t", "s3.Secret-Key": "k",
    ...                "tracking.uri": "http://me:pw@host:5000"})
    {'eval.max_new_tokens': '8', 'tracking.uri': 'http://***@host:5000'}
    """

    def secret(key: str) -> bool:
        words = re.split(r"[^a-z0-9]+", key.lower().rsplit(".", 1)[-1])
        return any(w in SECRET_WORDS for w in words)

    masked = {k: re.sub(r"://[^/@\s]+@", "://***@", str(v)) for k, v in flat.items()}
    return {k: v[:500] for k, v in masked.items() if not secret(k)}


def safe_key(name: str) -> str:
    """A metric, param or tag name MLflow accepts: "@" (pass@k) spelled "_at_", any other
    character outside letters, digits, _ - . / and space replaced by "_".

    >>> safe_key("grpo/eval/x/pass@2"), safe_key("a:b")
    ('grpo/eval/x/pass_at_2', 'a_b')
    """
    return re.sub(r"[^\w\-./ ]", "_", name.replace("@", "_at_"))


def log_params(c: Any, run_id: str, params: dict[str, str]) -> None:
    from mlflow.entities import Param

    items = [Param(k, v) for k, v in params.items()]
    for s in range(0, len(items), 100):
        c.log_batch(run_id, params=items[s : s + 100])


def log_step_metrics(c: Any, run_id: str, rows: list[dict[str, Any]], prefix: str = "") -> int:
    """Every numeric field of every row as a metric at its step, in batches of 1000."""
    import math

    from mlflow.entities import Metric

    now = int(time.time() * 1000)
    ms = [
        Metric(safe_key(f"{prefix}{k}"), float(v), now, int(r["step"]))
        for r in rows
        for k, v in r.items()
        if k != "step" and isinstance(v, (int, float)) and math.isfinite(float(v))
    ]
    for s in range(0, len(ms), 1000):
        c.log_batch(run_id, metrics=ms[s : s + 1000])
    return len(ms)


# what a user compares first between two pipelines, mirrored from the grpo stage run onto the
# parent: selecting two parents in the runs list then shows their curves side by side
MIRRORED = ("reward", "eval/inrun_subset_accuracy")


def mirror_to_parent(c: Any, parent_id: str, rows: list[dict[str, Any]], seconds: float) -> int:
    """The GRPO curves of MIRRORED as grpo/<name> on the parent, with grpo/steps and
    grpo/seconds; only steps the parent does not have yet (a retried or resumed stage re-reads
    the whole metrics file). Returns how many points it logged."""
    have = max((m.step for m in c.get_metric_history(parent_id, "grpo/reward")), default=-1)
    new = [{"step": r["step"], **{k: r[k] for k in MIRRORED if k in r}}
           for r in rows if r.get("step", -1) > have]  # fmt: skip
    n = log_step_metrics(c, parent_id, new, prefix="grpo/")
    last = max((r["step"] for r in rows if "step" in r), default=0)
    log_metrics(c, parent_id, {"grpo/steps": float(last), "grpo/seconds": float(seconds)})
    return n


def log_metrics(c: Any, run_id: str, metrics: dict[str, float]) -> None:
    """Named values at step 0, in batches (one request per 1000, not one each: a served store
    checks credentials on every request)."""
    log_step_metrics(c, run_id, [{"step": 0, **metrics}])


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()]


def plot_curves(rows: list[dict[str, Any]], out: Path, title: str) -> Path:
    """Reward, held-out accuracy, KL and completion length per step, one PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [
        ("reward", "reward"),
        ("eval/inrun_subset_accuracy", "in-run held-out subset accuracy (greedy)"),
        ("kl", "KL to reference"),
        ("completions/mean_length", "completion length"),
    ]
    fig, axes = plt.subplots(1, 4, figsize=(16, 3.2))
    for ax, (key, label) in zip(axes, panels):
        pts = [(r["step"], r[key]) for r in rows if key in r]
        if not pts:
            note = "beta = 0: no reference, no KL" if key == "kl" else "not logged"
            ax.text(0.5, 0.5, note, ha="center", va="center", transform=ax.transAxes)
        elif len(pts) < 20:
            ax.plot(*zip(*pts), marker="o")
        else:  # noisy per-step values: faint raw curve, moving average on top
            xs, ys = zip(*pts)
            w = max(1, len(ys) // 20)
            avg = [sum(ys[max(0, i - w + 1) : i + 1]) / len(ys[max(0, i - w + 1) : i + 1])
                   for i in range(len(ys))]  # fmt: skip
            ax.plot(xs, ys, alpha=0.3)
            ax.plot(xs, avg, label=f"mean of {w}")
            ax.legend(loc="lower right", fontsize=8)
        ax.set_title(label)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def system_monitor(run_id: str, uri: str, interval_s: float) -> Any:
    """MLflow's system-metrics monitor for one run (CPU, memory, disk, network; GPUs where
    present) under `system/<host>/`, that logs at least one sample however short the run:
    MLflow's own drops the sample it took when it is stopped within its first interval."""
    import socket

    from mlflow.exceptions import MlflowException
    from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

    class AtLeastOnce(SystemMetricsMonitor):
        published = False

        def publish_metrics(self, metrics: dict[str, float]) -> None:
            self.published = True
            super().publish_metrics(metrics)

        def finish(self) -> None:
            super().finish()  # MLflow's own logs a failure to flush, and goes on
            if self.published:
                return
            try:
                self.collect_metrics()
                self.publish_metrics(self.aggregate_metrics())
                self.mlflow_logger.flush()
            except (MlflowException, OSError) as e:  # the stage's own outcome must not be masked
                print(f"warning: system metrics of MLflow run {run_id} not logged: {e}")

    return AtLeastOnce(run_id, sampling_interval=interval_s, node_id=socket.gethostname(),
                       tracking_uri=uri)  # fmt: skip


class MetricsStreamer:
    """Uploads new lines of a metrics JSONL file to an MLflow run while training runs.

    The file is the source of truth: a line is marked sent only after MLflow accepted it, so a
    tracking server that is unreachable for a while delays the upload and loses nothing.
    """

    def __init__(self, cfg: Config, run_id: str, path: Path, interval_s: float = 10.0) -> None:
        import threading

        self.cfg, self.run_id, self.path, self.interval = cfg, run_id, path, interval_s
        self.offset = 0
        self.sent = 0
        self.failures = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True, name="metrics-streamer")

    def __enter__(self) -> MetricsStreamer:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            self.flush(raise_errors=False)

    def flush(self, raise_errors: bool = True) -> int:
        """Send what is new; returns the number of rows sent."""
        from mlflow.exceptions import MlflowException

        if not self.path.exists():
            return 0
        with self.path.open("rb") as f:
            f.seek(self.offset)
            chunk = f.read()
        end = chunk.rfind(b"\n") + 1  # only whole lines
        if end == 0:
            return 0
        rows = [json.loads(x) for x in chunk[:end].decode().splitlines() if x.strip()]
        try:
            log_step_metrics(client(self.cfg), self.run_id, rows)
        except (MlflowException, OSError) as e:
            self.failures += 1
            if raise_errors:
                raise
            print(f"MLflow upload failed ({type(e).__name__}); {len(rows)} rows kept for later")
            return 0
        self.offset += end
        self.sent += len(rows)
        return len(rows)

    def drain(self, attempts: int = 5, delay_s: float = 5.0) -> int:
        """Final upload with retries: the server may still be coming back."""
        from mlflow.exceptions import MlflowException

        for i in range(attempts):
            try:
                self.flush(raise_errors=True)
                return self.sent
            except (MlflowException, OSError):
                if i == attempts - 1:
                    raise
                time.sleep(delay_s * (i + 1))
        return self.sent


def log_evaluation(
    cfg: Config, run_id: str, report: dict[str, Any], out_dir: Path, prefix: str = "",
    metrics: bool = True,
) -> None:  # fmt: skip
    """eval/<set>/<metric> metrics (unless `metrics` is false: the pipeline logs them once, on
    its parent run), the per-sample table and the report files."""
    import pandas as pd

    c = client(cfg)
    if metrics:
        log_metrics(c, run_id, {f"{prefix}eval/{s}/{k}": v for s, m in report["sets"].items()
                                for k, v in m.items() if isinstance(v, float)})  # fmt: skip
    samples = read_jsonl(out_dir / "samples.jsonl")
    if samples:
        c.log_table(run_id, data=pd.DataFrame(samples), artifact_file=f"{prefix}eval/samples.json")
    c.log_artifacts(run_id, str(out_dir), f"{prefix}eval")


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


def close_orphaned_runs(client: Any, experiment_id: str) -> list[str]:
    """End KILLED the parent runs (and their stage runs) that a pipeline on this host left
    RUNNING when it was killed outright (SIGKILL, a lost machine): their owner process is gone.
    Runs of other hosts are left alone (their owners cannot be checked from here). Returns the
    names of the parent runs closed."""
    import socket

    host = socket.gethostname().replace("'", "")
    running = client.search_runs(
        [experiment_id],
        f"attributes.status = 'RUNNING' and tags.`pipeline.host` = '{host}'",
    )
    closed = []
    for run in running:
        if _owner_alive(run.data.tags):
            continue  # another pipeline on this machine, still at work
        stages = client.search_runs(
            [experiment_id],
            f"attributes.status = 'RUNNING' and tags.mlflow.parentRunId = '{run.info.run_id}'",
        )
        for r in [*stages, run]:
            client.set_terminated(r.info.run_id, "KILLED")
        closed.append(run.info.run_name)
    return closed


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
