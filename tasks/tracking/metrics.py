"""Step metrics, batched and streamed while a stage runs; the system monitor; evaluation tables."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from grpo.config import Config
from grpo.eval.selection import INRUN_KEY, SELECT_KEY
from tasks.tracking.client import client
from tasks.tracking.params import safe_key


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
MIRRORED = ("reward", SELECT_KEY, INRUN_KEY)


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


def peak_rss_mb() -> float:
    """The peak resident memory, in MB, of the largest of this process and every descendant
    that has ended (ranks, the control, evaluation): getrusage's maxima, in KB on Linux."""
    import resource

    own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    children = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    return max(own, children) / 1024


def log_metrics(c: Any, run_id: str, metrics: dict[str, float]) -> None:
    """Named values at step 0, in batches (one request per 1000, not one each: a served store
    checks credentials on every request)."""
    log_step_metrics(c, run_id, [{"step": 0, **metrics}])


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()]


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


def log_grpo_files(client: Any, run_id: str, out: Path, rows: list[dict[str, Any]],
                   title: str) -> None:  # fmt: skip
    """A GRPO run directory's files on its MLflow run: the step curves as a plot, the filled
    DeepSpeed and run configs, and the sampled completions as a table."""
    import pandas as pd

    from tasks.tracking.plots import plot_curves

    plot = plot_curves(rows, out / "curves.png", title)
    client.log_artifact(run_id, str(plot), "plots")
    client.log_artifact(run_id, str(out / "deepspeed_config.json"), "config")
    client.log_artifact(run_id, str(out / "config.yaml"), "config")
    samples = read_jsonl(out / "completions.jsonl")
    if samples:
        client.log_table(run_id, data=pd.DataFrame(samples), artifact_file="completions.json")


def log_grpo_summary(
    client: Any, run_id: str, summary: dict[str, Any], threads: int | None
) -> None:
    """What the ranks reported at the end: parameter counts, the engine that sampled ("auto" in
    the config), the threads it ran on, the size of the in-run evaluation subset."""
    for k, v in summary.get("parameters", {}).items():
        client.log_param(run_id, f"parameters.{k}", v)
    client.set_tag(run_id, "generation_engine", summary.get("generation_engine", "unknown"))
    if threads:
        client.set_tag(run_id, "threads", str(threads))
    # the in-run curve's problems: a subset (or the selection split), not the evaluate stage's
    client.set_tag(run_id, "eval.inrun_subset_size", str(summary.get("inrun_subset_size", 0)))
