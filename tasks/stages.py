"""The five pipeline stages as Prefect tasks, each logging to its own nested MLflow run."""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from prefect import get_run_logger, task

from grpo.config import Config
from grpo.eval.selection import last_dir
from grpo.launch.paths import model_digest
from tasks import tracking

# seconds between system-metric samples (a shorter stage still gets one: system_monitor)
SYSTEM_METRICS_S = 5

# the config sections each stage's run logs as its own params, so that two stage runs compare
# on their own in the MLflow UI (the parent keeps the whole config)
STAGE_SECTIONS = {
    "validate": ("data",), "sft": ("model", "sft", "data"), "grpo": ("grpo", "model", "deepspeed"),
    "sft_continued": ("sft", "model"), "evaluate": ("eval",), "rft": ("rft", "sft", "model"),
}  # fmt: skip


def child_run(cfg: Config, parent_id: str, name: str) -> str:
    """A stage's run under the pipeline's parent run, named `<parent name>/<stage>` (chart
    legends of two pipelines tell their runs apart), with its sections of the config."""
    c = tracking.client(cfg)
    parent = c.get_run(parent_id)
    run = c.create_run(
        parent.info.experiment_id,
        run_name=f"{parent.info.run_name}/{name}",
        tags={
            "mlflow.parentRunId": parent_id,
            "stage": name,
            "run_kind": "stage",
            **tracking.machine_tags(),
        },  # fmt: skip
    )
    params = tracking.section_params(cfg, STAGE_SECTIONS.get(name, ()))
    tracking.log_params(c, run.info.run_id, params)
    return run.info.run_id


@contextlib.contextmanager
def stage_run(cfg: Config, parent_id: str, name: str) -> Iterator[str]:
    """A nested MLflow run for one stage: FINISHED when the block ends, FAILED when it raises,
    KILLED when it was interrupted (never left RUNNING). The machine's CPU, memory, disk and
    network (GPUs where present) are sampled into it while the block runs: MLflow's system
    metrics, `system/<host>/...`, so that stages on several machines stay apart."""
    run_id = child_run(cfg, parent_id, name)
    monitor = tracking.system_monitor(run_id, tracking.tracking_uri(cfg), SYSTEM_METRICS_S)
    monitor.start()
    try:
        yield run_id
    except BaseException as e:
        monitor.finish()
        tracking.client(cfg).set_terminated(run_id, tracking.end_status(e))
        raise
    monitor.finish()
    tracking.client(cfg).set_terminated(run_id, "FINISHED")


@task(name="validate-data")
def validate_data(cfg: Config, parent_id: str, run_dir: Path) -> dict[str, Any]:
    """Great Expectations suites; a failure stops the flow before any training."""
    from prefect.artifacts import create_markdown_artifact

    from tasks.validation import DataValidationError, validate_datasets, validation_markdown

    with stage_run(cfg, parent_id, "validate") as run_id:
        c = tracking.client(cfg)
        docs = run_dir / "data_docs"
        try:
            results = validate_datasets(cfg, docs)
        except DataValidationError as e:
            c.log_text(run_id, str(e), "validation/errors.txt")
            if docs.exists():
                c.log_artifacts(run_id, str(docs), "validation/data_docs")
            raise
        c.log_dict(run_id, results, "validation/results.json")
        # a page that renders offline, beside the Data Docs (their CSS comes from CDNs)
        summary = validation_markdown(results)
        c.log_text(run_id, summary, "validation/summary.md")
        create_markdown_artifact(key="validation", markdown=summary,
                                 description="data validation (Great Expectations)")  # fmt: skip
        c.log_artifacts(run_id, str(docs), "validation/data_docs")
        inputs = dataset_inputs(cfg)
        c.log_inputs(run_id, datasets=inputs)
        c.log_inputs(parent_id, datasets=inputs)  # the runs list shows them on the parent
        for d in inputs:
            c.set_tag(parent_id, f"data.digest.{d.dataset.name}", d.dataset.digest)
    return results


def dataset_inputs(cfg: Config) -> list[Any]:
    """Every dataset of the run as an MLflow dataset input: its rows' digest, its source (the
    file, or the synthetic generator and seed), training or evaluation context."""
    import warnings

    import mlflow.data
    import pandas as pd
    from mlflow.data.code_dataset_source import CodeDatasetSource
    from mlflow.entities import Dataset, DatasetInput, InputTag

    from grpo.config import set_label
    from grpo.data.sets import eval_set, eval_set_file, training_sets

    def source(path: str | Path | None, what: str) -> Any:
        if path:  # MLflow resolves a file URI to its local-file source
            return Path(path).resolve().as_uri()
        if cfg.data.task == "reasoning_gym" or what.startswith("rg:"):
            from grpo.data import reasoning_gym

            about = reasoning_gym.inputs_description(cfg.data)
            return CodeDatasetSource({
                "generator": "reasoning-gym", "version": about["version"], "set": what,
                "generators": json.dumps(about["generators"], sort_keys=True),
            })  # fmt: skip
        return CodeDatasetSource({"generator": "grpo.data.synthetic", "set": what,
                                  "seed": str(cfg.data.seed)})  # fmt: skip

    files = {"train": cfg.data.train_path, "sft": cfg.data.sft_path, "sft_val": cfg.data.sft_path}
    # the selection split chooses checkpoints: MLflow's "validation" context, not training
    named = {k: (rows, source(files.get(k) if cfg.data.task == "files" else None, k),
                 "validation" if k == "select" else "training")
             for k, rows in training_sets(cfg).items() if rows}  # fmt: skip
    for n in cfg.eval.sets:
        path = eval_set_file(n)
        named[f"heldout_{set_label(n)}"] = (eval_set(n, cfg), source(path, n), "evaluation")
    out = []
    for name, (rows, src, context) in named.items():
        # schema hints, two equivalent local-file sources; the schema is inferred in to_dict()
        # (lazily), so it is inside too: outside, five hints a run reached the log
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            # a reasoning-gym entry is a nested dict (its source tags say how it was drawn)
            frame = pd.DataFrame([{k: v for k, v in r.items() if k != "rg_entry"} for r in rows])
            ds = mlflow.data.from_pandas(frame, source=src, name=name)
            dataset = Dataset(**ds.to_dict())
        tag = InputTag(key="mlflow.data.context", value=context)
        out.append(DatasetInput(dataset=dataset, tags=[tag]))
    return out


@task(name="build-reference")
def build_reference(cfg: Config, parent_id: str) -> str:
    """SFT reference, cached by a hash of its config and data (a re-run reuses it)."""
    from grpo.launch.runner import run_sft

    log = get_run_logger()
    with stage_run(cfg, parent_id, "sft") as run_id:
        c = tracking.client(cfg)
        out = run_sft(cfg, log=log.info)
        summary_path = out / "sft_summary.json"
        summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
        c.set_tag(run_id, "cache_key", out.name)
        rows = tracking.read_jsonl(out.with_name(out.name + "_metrics.jsonl"))
        tracking.log_step_metrics(c, run_id, rows, prefix="sft/")
        for k in ("best_val_loss", "steps", "epochs", "seconds"):
            if k in summary:
                c.log_metric(run_id, f"sft/{k}", float(summary[k]))
        _log_reference_once(c, run_id, out)
    return str(out)


def _log_reference_once(c: Any, run_id: str, ref: Path) -> None:
    """Upload the reference model only the first time its digest is seen in the experiment;
    later runs tag a link to that run (a real model's base is gigabytes, every night)."""
    from grpo.launch.paths import file_digest
    from grpo.launch.runner import MANIFEST

    files = sorted(p for p in ref.iterdir() if p.is_file())
    # the cache hit just checked every file against its manifest: its hashes, not a second read
    known = json.loads((ref / MANIFEST).read_text()) if (ref / MANIFEST).is_file() else {}
    digest = hashlib.sha256("".join(
        f"{p.name}:{known[p.name]['sha256'] if p.name in known else file_digest(p)}" for p in files
    ).encode())  # fmt: skip
    key = digest.hexdigest()[:16]
    exp_id = c.get_run(run_id).info.experiment_id
    found = c.search_runs(
        [exp_id], f"tags.reference_digest = '{key}' and tags.reference_logged = 'true'",
        max_results=1,
    )  # fmt: skip
    c.set_tag(run_id, "reference_digest", key)
    if found:
        c.set_tag(run_id, "reference_run_id", found[0].info.run_id)
        return
    c.log_artifacts(run_id, str(ref), "reference")
    c.set_tag(run_id, "reference_logged", "true")


def served_model_config(cfg: Config) -> dict[str, Any]:
    """How a logged policy is served: its prompt format and completion length."""
    from grpo.models.prompts import SYSTEM_PROMPT

    served = {
        "chat_template": cfg.model.chat_template,
        "system_prompt": cfg.model.system_prompt or SYSTEM_PROMPT,
        "max_new_tokens": cfg.eval.max_new_tokens or cfg.grpo.max_completion_length,
    }
    if cfg.tools.active:  # what the policy was trained to call, with the tools' schemas,
        # and the config that lays out its episodes when it is served
        from grpo.models.episodes import tool_metadata

        served["tools"] = tool_metadata(cfg)
        served["run_config"] = cfg.model_dump(mode="json")
    return served


@task(name="train-grpo", retries=1, retry_delay_seconds=5)
def train_policy(
    cfg: Config, parent_id: str, reference: str, run_dir: Path, threads: int | None = None,
    pace_file: Path | None = None,
) -> dict[str, Any]:  # fmt: skip
    """GRPO ranks as a subprocess (DeepSpeed launcher when distributed), logs streamed.

    A retry resumes from the last checkpoint of the same run directory. `threads` limits its
    CPU threads (the control runs beside it on the others, paced by `pace_file`).
    """

    from grpo.engine.deepspeed_setup import ADAPTER_DIR
    from grpo.engine.run_files import trim_jsonl
    from grpo.launch.run_dir import checkpoint_step
    from grpo.launch.runner import run_grpo
    from tasks.serving import log_checkpoint_models, log_policy

    log = get_run_logger()
    out = run_dir / "grpo"
    with stage_run(cfg, parent_id, "grpo") as run_id:
        c = tracking.client(cfg)
        # a resumed or retried stage: its rank 0 rewrites these files to end at its checkpoint
        # (step 0 without one: a retry of an attempt killed before its first checkpoint), some
        # seconds after starting; the streamer below must not read them first (it sent a
        # discarded step, then lost its place in the rewritten file and failed the stage)
        step = checkpoint_step(out) or 0
        for name in ("metrics.jsonl", "completions.jsonl"):
            if (out / name).exists():
                trim_jsonl(out / name, step)
        # metrics reach MLflow while the ranks train; the JSONL file is the buffer
        with tracking.MetricsStreamer(cfg, run_id, out / "metrics.jsonl") as streamer:
            summary = run_grpo(cfg, Path(reference), out, resume=True, log=log.info,
                               env=_thread_env(threads), pace_file=pace_file)  # fmt: skip
        n = streamer.drain()
        log.info(f"{n} step metric rows in MLflow run {run_id} ({streamer.failures} failed)")
        rows = tracking.read_jsonl(out / "metrics.jsonl")
        tracking.mirror_to_parent(c, parent_id, rows, summary["seconds"])
        tracking.log_grpo_files(c, run_id, out, rows, f"GRPO {cfg.run_name}")
        model_config = served_model_config(cfg)
        selection = summary.get("selection")
        # with a selection split, policy/ holds the selected step (grpo.eval.selection)
        step = selection["selected_step"] if selection else cfg.grpo.steps
        model_uri = log_policy(run_id, out / "policy", model_config, step=step)
        if selection:
            c.set_tag(run_id, "selection.step", str(selection["selected_step"]))
            c.set_tag(run_id, "selection.rule", selection["rule"])
            c.log_dict(run_id, selection, "selection/grpo.json")
        # the curve checkpoints are linked to: the selection split when there is one
        inrun = f"select[:{summary.get('inrun_subset_size', 0)}]" if selection else (
            f"{cfg.eval.sets[0]}[:{summary.get('inrun_subset_size', 0)}]" if cfg.eval.sets
            else "none")  # fmt: skip
        checkpoints = log_checkpoint_models(
            c,
            run_id,
            out,
            rows,
            model_config,
            final=(step, model_uri),
            dataset=(inrun, cfg.digest("eval", "data")),
        )
        # the registered model is policy/: the step selected on the selection split when there
        # is one (never on a test set, which would bias the gate's paired test), else the last
        c.set_tag(run_id, "checkpoint_models", ", ".join(
            f"step {m['step']}: {m['model_uri']}" for m in checkpoints))  # fmt: skip
        if (out / ADAPTER_DIR).is_dir():  # LoRA: the model above is merged; keep the adapter
            c.log_artifacts(run_id, str(out / ADAPTER_DIR), ADAPTER_DIR)
        tracking.log_grpo_summary(c, run_id, summary, threads)
    return {"policy": str(out / "policy"), "run_id": run_id, "seconds": summary["seconds"],
            "model_uri": model_uri, "selection": selection,
            "last_policy": str(last_dir(out / "policy")) if selection else None}  # fmt: skip


def _thread_env(threads: int | None) -> dict[str, str] | None:
    """The environment that limits a stage's process to `threads` CPU threads (None: all)."""
    return {"OMP_NUM_THREADS": str(threads)} if threads else None


def control_threads(cfg: Config) -> int | None:
    """Threads for each of GRPO and the control when they run side by side (half the cores
    each), or None when the control runs after GRPO (sft.control)."""
    import torch

    from grpo.models.loading import device_for

    mode = cfg.sft.control
    if mode == "auto":
        single = cfg.deepspeed.nproc == 1 and cfg.deepspeed.hostfile is None
        mode = "concurrent" if single and device_for(cfg).type == "cpu" else "sequential"
    return max(1, torch.get_num_threads() // 2) if mode == "concurrent" else None


@task(name="sft-continued")
def sft_control(
    cfg: Config,
    parent_id: str,
    reference: str,
    run_dir: Path,
    *,
    seconds: float | None = None,
    follow: Path | None = None,
    steps: int | None = None,
    threads: int | None = None,
) -> str:
    """The honest control: the SFT reference trained on for the GRPO stage's wall time, after
    it (seconds) or beside it until its pace file says done (follow); or, to reproduce a
    control exactly, for a fixed number of steps (sft.control_steps)."""
    import torch

    from grpo.launch.runner import run_control

    log = get_run_logger()
    out = run_dir / "sft_continued"
    # beside GRPO on part of the cores, all of them once GRPO is done
    after = torch.get_num_threads() if follow and threads else None
    with stage_run(cfg, parent_id, "sft_continued") as run_id:
        summary = run_control(cfg, Path(reference), out, seconds=seconds, follow=follow,
                              steps=steps, log=log.info, env=_thread_env(threads),
                              threads_after=after)  # fmt: skip
        c = tracking.client(cfg)
        rows = tracking.read_jsonl(out.with_name(out.name + "_metrics.jsonl"))
        tracking.log_step_metrics(c, run_id, rows, prefix="sft_continued/")
        c.log_metric(run_id, "sft_continued/seconds", float(summary["seconds"]))
        c.log_metric(run_id, "sft_continued/steps", float(summary["steps"]))
        c.set_tag(run_id, "control_mode", "concurrent" if follow else "sequential")
        # what ended it: GRPO's wall time (moves between runs of one seed) or a step count
        c.set_tag(run_id, "control_budget", "steps" if steps else "wall_time")
        if selection := summary.get("selection"):
            c.set_tag(run_id, "selection.step", str(selection["selected_step"]))
            c.set_tag(run_id, "selection.rule", selection["rule"])
            c.log_dict(run_id, selection, "selection/sft_continued.json")
        if threads:
            c.set_tag(run_id, "threads", str(threads))
    return str(out)


@task(name="rft")
def rft_stage(
    cfg: Config, parent_id: str, reference: str, run_dir: Path, completions: int
) -> dict[str, Any]:
    """Rejection-sampling fine-tuning from the reference (grpo.engine.rft), sampling as many
    completions as GRPO did: a control beside GRPO, or the method (method: rft), then its
    model is logged for registration."""
    from grpo.launch.runner import run_rft

    log = get_run_logger()
    out = run_dir / "rft"
    with stage_run(cfg, parent_id, "rft") as run_id:
        summary = run_rft(cfg, Path(reference), out, completions, log=log.info)
        c = tracking.client(cfg)
        rounds = tracking.read_jsonl(out.with_name(out.name + "_metrics.jsonl"))
        rows = [{**r, "step": r["round"]} for r in rounds]
        tracking.log_step_metrics(c, run_id, rows, prefix="rft/")
        # totals apart from the per-round curves of the same names
        for k in ("sampled", "kept", "sft_steps"):
            c.log_metric(run_id, f"rft/total_{k}", float(summary[k]))
        for k in ("budget", "rounds", "seconds"):
            c.log_metric(run_id, f"rft/{k}", float(summary[k]))
        # what matches GRPO's compute: the completions sampled (grpo.engine.rft says why)
        c.set_tag(run_id, "compute_match", f"{completions} sampled completions, as GRPO's")
        model_uri, selection = None, summary.get("selection")
        if selection:
            c.set_tag(run_id, "selection.round", str(selection["selected_step"]))
            c.set_tag(run_id, "selection.rule", selection["rule"])
            c.log_dict(run_id, selection, "selection/rft.json")
        if cfg.method == "rft":  # the model registered: logged as GRPO's is
            from tasks.serving import log_policy

            step = selection["selected_step"] if selection else summary["rounds"]
            model_uri = log_policy(run_id, out, served_model_config(cfg), step=step)
    return {"policy": str(out), "run_id": run_id, "seconds": summary["seconds"],
            "model_uri": model_uri, "selection": selection,
            "last_policy": str(last_dir(out))}  # fmt: skip


def rft_budget(cfg: Config, run_dir: Path) -> int:
    """The completions RFT may sample: what GRPO's metrics say it sampled (dynamic sampling's
    extra rounds counted), else GRPO's configured steps x prompts x group."""
    from grpo.engine.rft import completion_budget

    g = cfg.grpo
    rows = tracking.read_jsonl(run_dir / "grpo" / "metrics.jsonl")
    per_step = [r.get("sampling/rounds", 1.0) * g.prompts_per_step * g.num_generations
                for r in rows if r.get("step", 0) > 0 and "reward" in r]  # fmt: skip
    return completion_budget(cfg, per_step or None)


# the models the pipeline compares, evaluated with sampled pass@k beside greedy decoding: the
# trained ones and the reference they start from (whether a method widened or narrowed what
# sampling finds is read against it)
PASS_K_MODELS = ("grpo", "sft_continued", "rft", "reference")


def _reuse_evaluation(src: Path, out: Path, model: str, same: str) -> dict[str, Any]:
    """Copy the evaluation of a model with the same weights (greedy decoding and the seeded
    sampling give the same completions), its report naming this model and which it reused."""
    import shutil

    shutil.copytree(src, out, dirs_exist_ok=True)
    report = json.loads((out / "report.json").read_text())
    report.update(model=str(model), same_weights_as=same)
    (out / "report.json").write_text(json.dumps(report, indent=2))
    return report


def plan_evaluations(digests: dict[str, str], sampled: tuple[str, ...]) -> dict[str, str | None]:
    """Which models to evaluate and which reuse another's evaluation: label -> None (evaluate
    it) or the label whose evaluation it copies (the same weights: greedy decoding and the
    seeded sampling give the same completions). The `sampled` models (with pass@k) come first,
    so a model with the same weights as one of them reuses its evaluation, pass@k included; a
    sampled model never reuses an evaluation without pass@k. Evaluated labels keep this order:
    the sampled, longest, first."""
    plan: dict[str, str | None] = {}
    first: dict[str, str] = {}  # digest -> the label evaluated for it
    for label in sorted(digests, key=lambda m: m not in sampled):
        same = first.get(digests[label])
        if same is not None and (same in sampled or label not in sampled):
            plan[label] = same
        else:
            plan[label] = None
            first.setdefault(digests[label], label)
    return plan


@task(name="evaluate")
def evaluate(
    cfg: Config, parent_id: str, models: dict[str, str], run_dir: Path, candidate: str = "grpo"
) -> dict:
    """Every model on the same held-out problems; paired differences against the reference,
    GRPO against its controls, and the candidate (grpo or rft) against the champion; with
    eval.untooled, the reference and the candidate also without their tools."""
    import pandas as pd
    from prefect.artifacts import create_markdown_artifact, create_table_artifact

    from grpo.eval.metrics import comparison, markdown_rows
    from grpo.eval.run import evaluate_models

    untooled = {f"{m}_untooled": m for m in ("reference", candidate)} if cfg.eval.untooled else {}
    models = models | {label: models[m] for label, m in untooled.items()}
    with stage_run(cfg, parent_id, "evaluate") as run_id:
        c = tracking.client(cfg)
        # the same weights without tools answer otherwise: never a copy of the tooled evaluation
        digests = {m: model_digest(p) + ("/untooled" if m in untooled else "")
                   for m, p in models.items()}  # fmt: skip
        plan = plan_evaluations(digests, PASS_K_MODELS)
        jobs = {
            # sampled pass@k for the compared models (k samples cost k greedy evaluations):
            # not for the last steps or the champion
            label: dict(model_dir=models[label], sets=cfg.eval.sets,
                        out_dir=str(run_dir / "eval" / label), samples=cfg.eval.samples,
                        limit=cfg.eval.limit, progress=True,
                        pass_k=None if label in PASS_K_MODELS else 0,
                        without_tools=label in untooled)
            for label, same in plan.items() if same is None
        }  # fmt: skip
        print(f"evaluating {', '.join(jobs)}"
              + (f", {cfg.eval.workers} at a time" if cfg.eval.workers > 1 else "")
              + (f" (pass@{cfg.eval.pass_k} for {', '.join(m for m in jobs if m in PASS_K_MODELS)})"
                 if cfg.eval.pass_k and cfg.eval.samples == 1 else ""), flush=True)  # fmt: skip
        reports = evaluate_models(cfg, jobs, cfg.eval.workers)
        samples = {}
        for label, same in plan.items():
            out = run_dir / "eval" / label
            if same is not None:
                reports[label] = _reuse_evaluation(run_dir / "eval" / same, out, models[label],
                                                   same)  # fmt: skip
                print(f"{label}: the same weights as {same}, its evaluation reused")
        for label in models:  # logged in the caller's order
            out = run_dir / "eval" / label
            samples[label] = tracking.read_jsonl(out / "samples.jsonl")
            tracking.log_evaluation(cfg, run_id, reports[label], out, prefix=f"{label}/",
                                    metrics=False)  # fmt: skip
        table, metrics, paired = comparison(cfg.eval.sets, list(models), reports, samples,
                                            candidate)  # fmt: skip
        # the held-out numbers once, on the parent run, where the runs list and a comparison of
        # two pipelines show them; this run keeps the tables and per-sample files
        tracking.log_metrics(c, parent_id, metrics)
        c.log_table(run_id, data=pd.DataFrame(table), artifact_file="comparison.json")
        create_table_artifact(key="evaluation", table=table, description="held-out accuracy")
        markdown = markdown_rows(table)
        create_markdown_artifact(key="evaluation-summary", markdown=markdown)
    return {"table": table, "metrics": metrics, "reports": reports, "paired": paired,
            "markdown": markdown}  # fmt: skip


@task(name="register-model", retries=2, retry_delay_seconds=5)
def register_model(
    cfg: Config,
    trained: dict[str, Any],
    reference: str,
    ev: dict,
    champ: dict[str, Any],
    candidate: str = "grpo",
) -> dict[str, Any]:
    """Registry version of the candidate (grpo, or rft with method: rft) with evaluation
    tags; challenger always, champion through the gate."""
    from tasks.gate import describe, promotion_set
    from tasks.registry import register

    metrics = ev["metrics"]
    own = {k.removeprefix(f"{candidate}/"): v for k, v in metrics.items()
           if k.startswith(f"{candidate}/")}  # fmt: skip
    s = promotion_set(cfg.tracking.promotion_metric)
    vs_champion = ev["paired"].get(f"{candidate}_vs_champion", {}).get(s)
    g = cfg.grpo
    summary = {
        "run_name": cfg.run_name, "method": candidate,
        "reference": str(Path(reference).resolve()),  # absolute: read from anywhere
        "data": f"{cfg.data.task} (digest {cfg.digest('data')})",
    }  # fmt: skip
    if candidate == "grpo":
        summary |= {"steps": g.steps, "prompts": g.prompts_per_step, "group": g.num_generations,
                    "loss": g.loss_type, "lr": g.lr, "beta": g.beta}  # fmt: skip
    else:
        summary |= {"rounds": cfg.rft.rounds, "max_per_prompt": cfg.rft.max_per_prompt}
    reg = register(
        cfg, trained["run_id"], trained["model_uri"], own,
        vs_reference=ev["paired"].get(candidate, {}).get(s), vs_champion=vs_champion,
        champion_version=champ["version"],
        description=describe(summary, ev["markdown"]),
    )  # fmt: skip
    # which checkpoint became the version, and by which rule
    c = tracking.client(cfg)
    tag = functools.partial(c.set_model_version_tag, reg["name"], reg["version"])
    if selection := trained.get("selection"):
        tag("checkpoint/step", str(selection["selected_step"]))
        tag("checkpoint/selection", selection["rule"])
        tag("checkpoint/last_step", str(selection["last_step"]))
        # the last step's held-out numbers beside the selected step's
        for k, v in metrics.items():
            if k.startswith(f"{candidate}_last/") and "/accuracy" in k:
                tag(f"last_step/{k.removeprefix(f'{candidate}_last/')}", f"{v:.4f}")
    else:
        tag("checkpoint/step", str(g.steps if candidate == "grpo" else cfg.rft.rounds))
        tag("checkpoint/selection",
            "the last step: no selection split (data.num_select); a choice by accuracy on the "
            "held-out problems would bias the gate's paired test on them")  # fmt: skip
    # the decision on the flow run too, where a scheduled run's user looks first
    from prefect.artifacts import create_markdown_artifact

    create_markdown_artifact(key="promotion", markdown=reg["decision"],
                             description="the promotion gate's decision")  # fmt: skip
    return reg
