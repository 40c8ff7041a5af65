"""What each `grpo` subcommand does: load the config, check it, call the stage. The parser and
the error handling are in cli.main."""

from __future__ import annotations

import argparse
import json
import os
import signal
from pathlib import Path
from typing import TYPE_CHECKING

from cli.signals import Interrupted

if TYPE_CHECKING:  # the CLI imports its heavy modules when a command runs
    from grpo.config import Config
    from grpo.launch.runner import Node


def _config(a: argparse.Namespace):  # noqa: ANN202
    from grpo.config import load_config

    sets = list(a.set or [])
    if getattr(a, "nproc", None):
        sets.append(f"deepspeed.nproc={a.nproc}")
    if getattr(a, "hostfile", None):
        sets.append(f"deepspeed.hostfile={a.hostfile}")
    return load_config(a.config, sets)


def _preflight(
    cfg, *, model_dirs: tuple = (), train: bool = True, tracking: bool = False,  # noqa: ANN001
    base: str | None = None,
) -> None:  # fmt: skip
    from grpo.launch.preflight import preflight

    preflight(cfg, model_dirs=[d for d in model_dirs if d], train=train, base=base)
    if tracking:
        from tasks.tracking import check_reachable

        check_reachable(cfg)


def cmd_sft(a: argparse.Namespace) -> None:
    from grpo.launch.runner import run_sft

    cfg = _config(a)
    _preflight(cfg, train=False)
    out = run_sft(cfg, force=a.force)
    print(f"SFT reference: {out}")
    summary = out / "sft_summary.json"
    if summary.exists():
        s = json.loads(summary.read_text())
        print(f"best validation loss {s['best_val_loss']:.4f} after {s['steps']} steps")


def cmd_train(a: argparse.Namespace) -> None:
    from grpo.launch.run_dir import prepare_run_dir
    from grpo.launch.runner import run_grpo, run_sft, this_node

    cfg = _config(a)
    _preflight(cfg, model_dirs=(a.policy,))
    out = Path(a.out) if a.out else cfg.run_dir() / "grpo"
    node = this_node(cfg)
    if node is not None and node.rank > 0:
        _train_other_node(cfg, a, node, out)
        return
    prepare_run_dir(out, cfg, resume=a.resume, overwrite=a.overwrite)
    # run_sft reuses a cached reference, and returns model.path itself when SFT is off
    policy = Path(a.policy) if a.policy else run_sft(cfg)
    summary = run_grpo(cfg, policy, out, resume=a.resume)
    final = summary["final"]
    print(f"\nGRPO done in {summary['seconds']:.0f}s: {out / 'policy'}")
    if cfg.model.lora.enabled:
        n = summary.get("parameters", {})
        print(f"  LoRA: {n.get('trainable', 0):,} of {n.get('total', 0):,} parameters trained; "
              f"policy/ is merged, the adapter alone is in {out / 'adapter'}")  # fmt: skip
    keys = ("reward", "rewards/accuracy/mean", "kl", "completions/mean_length", "step_time")
    for k in keys:
        if k in final:
            print(f"  {k:28s} {final[k]:.4f}")


def _train_other_node(cfg: Config, a: argparse.Namespace, node: Node, out: Path) -> None:
    """A node other than node 0: it starts its own ranks into the run node 0 writes (the same
    --out, on a filesystem every node shares for checkpoints), from a starting policy it must
    already hold: building the SFT reference here too would race node 0's build."""
    from grpo.launch.paths import reference_dir
    from grpo.launch.runner import NodeError, run_grpo

    policy = Path(a.policy) if a.policy else reference_dir(cfg)
    if not (policy / "config.json").exists():
        raise NodeError(
            f"{node.describe()}: no starting policy at {policy}: pass --policy, or build the "
            "SFT reference first (grpo sft) where every node reads it"
        )
    run_grpo(cfg, policy, out, resume=a.resume)
    print(f"{node.describe()}: its ranks are done; node 0 writes the run to {out}")


def cmd_evaluate(a: argparse.Namespace) -> None:
    from grpo.eval.metrics import markdown_table
    from grpo.eval.run import default_report_dir, evaluate_against_baseline, evaluate_model

    cfg = _config(a)
    model = a.model
    if model.startswith("models:/"):
        from tasks.registry import download_model

        model = str(download_model(model, cfg))
    else:  # a directory, or a Hub id in the Hugging Face cache
        from grpo.launch.paths import model_path_dir

        model = str(model_path_dir(model))
    sets = a.sets.split(",") if a.sets else cfg.eval.sets
    _preflight(cfg.model_copy(update={"eval": cfg.eval.model_copy(update={"sets": sets})}),
               model_dirs=(model, a.baseline), train=False, base=a.base)  # fmt: skip
    out = a.out or str(default_report_dir(cfg, model))
    samples = a.samples or cfg.eval.samples
    if a.without_tools:
        from reward_fns.errors import UserError

        if a.baseline or not cfg.tools.active:
            raise UserError(
                "--without-tools compares a model with its configured tools (tools.*) against "
                "itself without them; give tools, and no --baseline"
            )
        bare = cfg.model_copy(update={"tools": type(cfg.tools)()})
        report, text = evaluate_against_baseline(
            cfg, model, model, sets, out, samples=samples, limit=a.limit, base=a.base,
            baseline_cfg=bare,
        )  # fmt: skip
        print(text.replace(f"{model} - {model}", f"{model}: with tools - without"))
    elif a.baseline:
        report, text = evaluate_against_baseline(
            cfg, model, a.baseline, sets, out, samples=samples, limit=a.limit, base=a.base
        )
        print(text)
    else:
        report = evaluate_model(cfg, model, sets, out, samples=samples, limit=a.limit,
                                base=a.base)  # fmt: skip
        print(markdown_table(report))
    print(f"report: {out}/report.json  samples: {out}/samples.jsonl")
    if os.environ.get("MLFLOW_RUN_ID"):  # inside an active MLflow run: log there too
        from tasks.tracking import log_evaluation

        log_evaluation(cfg, os.environ["MLFLOW_RUN_ID"], report, Path(out))


def cmd_pipeline(a: argparse.Namespace) -> None:
    from flows.pipeline import PipelineParams, grpo_pipeline
    from infra.prefect_local import pipeline_api

    cfg = _config(a)
    _preflight(cfg, tracking=True)
    if a.resume:
        from tasks.tracking import check_resumable

        check_resumable(cfg, a.resume)
    params = PipelineParams(config=a.config, overrides=list(a.set or []), control=not a.no_control,
                            resume=a.resume)  # fmt: skip
    with pipeline_api():
        state = grpo_pipeline(params, return_state=True)
    if state.is_cancelled():  # interrupted: the flow ended its runs and recorded it
        message = state.message or ""
        sig = signal.SIGTERM if message.startswith("stopped by SIGTERM") else signal.SIGINT
        raise Interrupted(sig, message.partition("; ")[2])
    state.result()  # a failed pipeline raises its error here


def cmd_promote(a: argparse.Namespace) -> None:
    from tasks.registry import promote

    cfg = _config(a)
    promote(cfg, a.version, alias=a.alias, reason=a.reason or "")
    print(f"{cfg.tracking.registered_model} version {a.version} is now @{a.alias}")


def cmd_compare(a: argparse.Namespace) -> None:
    from tasks import tracking
    from tasks.compare import compare_runs, print_tables, to_markdown

    cfg = _config(a)
    tracking.check_reachable(cfg)
    # the per-problem files are small: no download bars between the tables
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    result = compare_runs(tracking.client(cfg), a.a, a.b)
    if a.format == "json":
        print(json.dumps(result, indent=1))
    elif a.format == "markdown":
        print(to_markdown(result))
    else:
        print_tables(result)


def cmd_models(a: argparse.Namespace) -> None:
    from reward_fns.errors import UserError
    from tasks import tracking
    from tasks.registry_view import print_listing, registry_listing

    cfg = _config(a)
    if a.all and a.name:
        raise UserError("give --name or --all, not both")
    tracking.check_reachable(cfg)
    name = None if a.all else (a.name or cfg.tracking.registered_model)
    listing = registry_listing(tracking.client(cfg), name, cfg.tracking.promotion_metric,
                               a.limit)  # fmt: skip
    if name is not None and not listing["models"]:
        raise UserError(f"no registered model {name} in {tracking.tracking_uri(cfg)} "
                     "(grpo models --all lists every one)")  # fmt: skip
    if a.format == "json":
        print(json.dumps(listing, indent=1))
    else:
        print_listing(listing)


def cmd_import_gguf(a: argparse.Namespace) -> None:
    from grpo.launch.paths import gguf_model_dir

    cfg = _config(a)
    out = gguf_model_dir(a.gguf, Path(a.cache) if a.cache else Path(cfg.output_dir) / "base")
    print(out)


def cmd_serve(a: argparse.Namespace) -> None:
    from infra.serve import serve

    serve(a.config, prefect_port=a.prefect_port, mlflow_port=a.mlflow_port,
          state_dir=a.state_dir, pool=a.pool, stale_hours=a.alert_stale_hours,
          database=a.database, crashed_after_s=a.crashed_after_s, tls_cert=a.tls_cert,
          tls_key=a.tls_key, tls_self_signed=a.tls_self_signed,
          insecure_http=a.insecure_http)  # fmt: skip


def cmd_worker(a: argparse.Namespace) -> None:
    from infra.worker import worker

    worker(a.pool, a.name, a.limit)


def cmd_users(a: argparse.Namespace) -> None:
    from mlflow.exceptions import MlflowException

    from infra import users

    if a.action != "list" and not a.name:
        raise users.UsersError(f"grpo users {a.action} NAME: the account's name is missing")
    try:
        _users(a, users)
    except MlflowException as e:  # the server's refusal (not admin, no such user): one line
        raise users.UsersError(f"grpo users {a.action}: {e.message}") from None


def _users(a: argparse.Namespace, users) -> None:  # noqa: ANN001
    if a.action == "add":
        if not a.role:
            raise users.UsersError("grpo users add NAME --role reader|trainer|approver")
        path = users.add_user(a.name, a.role, Path(a.out) if a.out else None)
        print(f"{a.name}: {a.role}; its client settings (password inside, mode 600): {path}")
    elif a.action == "remove":
        users.remove_user(a.name)
        print(f"{a.name}: removed")
    else:
        for name, role in users.list_users():
            print(f"{name}\t{role}")
