"""The pipeline flow: validate -> SFT reference -> GRPO -> evaluate -> register.

Parameters are a pydantic model, validated also when a run is started from the Prefect UI. One
MLflow parent run per pipeline run, a nested run per stage.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

from prefect import flow
from prefect.exceptions import TerminationSignal
from prefect.states import Cancelled
from pydantic import BaseModel, Field

from grpo.config import load_config
from grpo.eval.selection import last_dir
from grpo.launch.runner import refuse_node_by_node, stop_started


class PipelineParams(BaseModel):
    config: str | None = Field(
        None, description="YAML config path; none: the embedded default run (configs/tiny.yaml)"
    )
    overrides: list[str] = Field(default_factory=list, description="key=value overrides")
    control: bool = Field(True, description="also train the SFT-continued control")
    resume: str | None = Field(
        None,
        description="MLflow run id of a pipeline that did not finish: continue it (same parent "
        "run and run directory; GRPO from its last checkpoint)",
    )


@flow(name="grpo-pipeline", log_prints=True)
def grpo_pipeline(params: PipelineParams = PipelineParams()) -> Any:  # noqa: B008
    from tasks import approval, registry, stages, tracking

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    cfg = load_config(params.config, params.overrides)
    refuse_node_by_node(cfg)
    approval.check_reachable(cfg)
    c = tracking.client(cfg)
    exp_id, tags = tracking.experiment(c, cfg.tracking.experiment, tracking.tracking_uri(cfg))
    if tracking.EXPERIMENT_KIND[0] not in tags:
        # the experiment declares itself a model-training one; MLflow 3.17's UI still needs
        # MODEL_TRAINING_VIEW in the address to open the runs list in a fresh browser
        c.set_experiment_tag(exp_id, *tracking.EXPERIMENT_KIND)
    if closed := tracking.close_orphaned_runs(c, exp_id):
        print(
            f"ended KILLED {len(closed)} MLflow run(s) left RUNNING by a pipeline on this host "
            f"that was killed: {', '.join(closed)}"
        )
    if params.resume:
        pid = tracking.reopen_parent(c, exp_id, params.resume, cfg)
        run_dir = Path(cfg.output_dir) / cfg.run_name / pid
        print(f"resuming pipeline run {pid} in {run_dir}")
    else:
        pid = tracking.start_pipeline_run(c, exp_id, cfg, "flows/pipeline.py:grpo_pipeline")
        run_dir = Path(cfg.output_dir) / cfg.run_name / pid
        run_dir.mkdir(parents=True, exist_ok=True)
        print(f"pipeline run {pid} in {run_dir}")
    _link_mlflow_run(tracking.tracking_uri(cfg), exp_id, pid)
    t0 = time.time()
    try:
        stages.validate_data(cfg, pid, run_dir)
        ref = stages.build_reference(cfg, pid)
        candidate, trained, models = _train(cfg, pid, ref, run_dir, params.control)
        # the current champion, evaluated on the same problems: the gate's paired evidence
        champ = registry.champion(cfg, run_dir / "champion")
        if champ["path"]:
            models["champion"] = champ["path"]
        ev = stages.evaluate(cfg, pid, models, run_dir, candidate)
        reg = stages.register_model(cfg, trained, ref, ev, champ, candidate)
        if reg["awaiting_approval"]:
            reg = _await_approval(cfg, reg, ev["markdown"])
    except (KeyboardInterrupt, TerminationSignal) as e:
        # Ctrl-C, or SIGTERM (which Prefect's engine turns into TerminationSignal while a flow
        # runs): every stage's processes stop, and the flow run ends Cancelled, not Crashed,
        # as a person stopped it
        stop_started()
        c.set_terminated(pid, "KILLED")
        name = signal.Signals(getattr(e, "signal", signal.SIGINT)).name
        return Cancelled(message=f"stopped by {name}; its stages stopped and its MLflow runs "
                         f"ended KILLED; `grpo pipeline --resume {pid}` (same config) continues "
                         "it, GRPO from its last checkpoint")  # fmt: skip
    except BaseException:
        c.set_terminated(pid, "FAILED")
        raise
    # what the run cost, for `grpo compare` and the runs list: this process's wall time and the
    # peak resident memory of the largest process it or its stages ran
    tracking.log_metrics(c, pid, {"pipeline/seconds": time.time() - t0,
                                  "pipeline/peak_rss_mb": tracking.peak_rss_mb()})  # fmt: skip
    c.set_tag(pid, "registered_version", reg["version"])
    tracking.record_decision(c, pid, reg)
    c.set_terminated(pid, "FINISHED")
    result = {"parent_run_id": pid, "experiment_id": exp_id, "table": ev["table"],
              "registered": reg,
              "seconds": time.time() - t0, "tracking_uri": tracking.tracking_uri(cfg)}  # fmt: skip
    _print_summary(result)
    return result


def _await_approval(cfg: Any, reg: dict[str, Any], evidence_md: str) -> dict[str, Any]:
    """tracking.promotion: approve: the flow run pauses until a person decides in the Prefect
    UI (or the timeout rejects); the decision goes on the model version and the flow run."""
    from prefect.artifacts import create_markdown_artifact

    from tasks import approval, registry

    reg = registry.apply_approval(cfg, reg, approval.ask(cfg, reg, evidence_md))
    print(f"approval: {reg['reason']}")
    create_markdown_artifact(key="promotion", markdown=reg["decision"],
                             description="the approved or rejected promotion")  # fmt: skip
    return reg


def _train(
    cfg: Any, pid: str, ref: str, run_dir: Path, control: bool
) -> tuple[str, dict[str, Any], dict[str, str]]:
    """The training stages of config's method: GRPO with its controls (SFT continued for the
    same wall time, RFT for the same sampled completions, as configured), or RFT alone. Returns
    the candidate's label (what is registered), its stage result and every model to evaluate
    by label; with a selection split the last steps' weights beside the selected."""
    from tasks import stages

    if cfg.method == "rft":
        rft = stages.rft_stage(cfg, pid, ref, run_dir, stages.rft_budget(cfg, run_dir))
        models = {"reference": ref, "rft": rft["policy"]}
        if rft.get("selection"):
            models["rft_last"] = rft["last_policy"]
        return "rft", rft, models
    trained, sft_control = _train_with_control(cfg, pid, ref, run_dir, control)
    models = {"reference": ref, "grpo": trained["policy"]}
    if sft_control:
        models["sft_continued"] = sft_control
    if trained.get("last_policy"):
        models["grpo_last"] = trained["last_policy"]
    if sft_control and last_dir(Path(sft_control)).is_dir():
        models["sft_continued_last"] = str(last_dir(Path(sft_control)))
    if cfg.rft.enabled:
        rft = stages.rft_stage(cfg, pid, ref, run_dir, stages.rft_budget(cfg, run_dir))
        models["rft"] = rft["policy"]
        if rft.get("selection"):
            models["rft_last"] = rft["last_policy"]
    return "grpo", trained, models


def _train_with_control(
    cfg: Any, pid: str, ref: str, run_dir: Path, control: bool
) -> tuple[dict[str, Any], str | None]:
    """GRPO, and the SFT control for the same wall time: beside it, each on half the cores,
    following its pace file, or after it for its seconds (sft.control); or after it for
    sft.control_steps steps."""
    from grpo.engine.pace import PACE_FILE, mark_done
    from tasks import stages
    from tasks.tracking import read_jsonl

    # the control needs worked solutions to continue SFT on, not an SFT-built reference: from
    # an instruct model used as is (sft.enabled false) it is SFT started at that model
    if not (control and cfg.has_worked_solutions):
        return stages.train_policy(cfg, pid, ref, run_dir), None
    ctl_dir = run_dir / "sft_continued"
    steps = cfg.sft.control_steps  # a step budget: the same weights every run, after GRPO
    if steps or (run_dir / "grpo" / "checkpoints" / "latest").exists():
        # after GRPO: with a step budget, or in a resumed pipeline (GRPO continues from its
        # checkpoint; a control that finished is kept, one that did not trains after GRPO for
        # all of GRPO's training time)
        trained = stages.train_policy(cfg, pid, ref, run_dir)
        if (ctl_dir / "control_summary.json").exists():
            return trained, str(ctl_dir)
        if steps:
            return trained, stages.sft_control(cfg, pid, ref, run_dir, steps=steps)
        seconds = sum(
            r.get("step_time", 0.0) for r in read_jsonl(run_dir / "grpo" / "metrics.jsonl")
        )
        return trained, stages.sft_control(cfg, pid, ref, run_dir, seconds=seconds)
    threads = stages.control_threads(cfg)
    if threads is None:
        trained = stages.train_policy(cfg, pid, ref, run_dir)
        return trained, stages.sft_control(cfg, pid, ref, run_dir, seconds=trained["seconds"])
    pace = run_dir / "grpo" / PACE_FILE  # run_dir is new for every flow run
    future = stages.sft_control.submit(cfg, pid, ref, run_dir, follow=pace, threads=threads)
    try:
        trained = stages.train_policy(cfg, pid, ref, run_dir, threads=threads,
                                      pace_file=pace)  # fmt: skip
    except (KeyboardInterrupt, TerminationSignal):
        stop_started()  # a person stopped the pipeline: the control too, not at its pace
        raise
    finally:
        mark_done(pace)  # also when GRPO failed: the control must not outlive it
        future.wait()
    return trained, future.result()


# MLflow 3's UI opens in its GenAI view in a browser that has not chosen otherwise, whatever the
# experiment's kind tag says; this query picks the model-training view (runs, metrics, models)
MODEL_TRAINING_VIEW = "workflowType=machine_learning"


def _link_mlflow_run(uri: str, exp_id: str, run_id: str) -> None:
    """A link artifact on the Prefect flow run to its MLflow run, when MLflow is a server
    (a sqlite store has no address a browser could open)."""
    if uri.startswith(("http://", "https://")):
        from prefect.artifacts import create_link_artifact

        url = f"{uri.rstrip('/')}/#/experiments/{exp_id}/runs/{run_id}?{MODEL_TRAINING_VIEW}"
        create_link_artifact(key="mlflow-run", link=url, link_text=f"MLflow run {run_id}")


def _print_summary(r: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    # a log file or a Prefect log is no terminal: rich would cut cells at 80 columns there
    con = Console() if sys.stdout.isatty() else Console(width=240)
    table = Table(title="Held-out accuracy (greedy pass@1, 95% Wilson CI)")
    cols = list(r["table"][0].keys()) if r["table"] else []
    for col in cols:
        table.add_column(col)
    for row in r["table"]:
        table.add_row(*(str(row[k]) for k in cols))
    con.print(table)
    reg = r["registered"]
    alias = "champion + challenger" if reg["champion"] else "challenger"
    con.print(f"Registered [bold]{reg['name']}[/] version {reg['version']} as @{alias}")
    con.print(f"  gate: {reg['reason']}")
    con.print(f"Pipeline finished in {r['seconds']:.0f}s; MLflow run {r['parent_run_id']}")
    uri, exp = r["tracking_uri"], r["experiment_id"]
    where = f"/#/experiments/{exp}/runs?{MODEL_TRAINING_VIEW}"
    if uri.startswith(("http://", "https://")):
        con.print(f"  MLflow UI:  {uri.rstrip('/')}{where}")
    else:
        con.print(f"  MLflow UI:  .venv/bin/mlflow ui --backend-store-uri {uri}")
        con.print(f"              then http://127.0.0.1:5000{where}")
    con.print("  Prefect UI: .venv/bin/prefect server start  (then http://127.0.0.1:4200)")
