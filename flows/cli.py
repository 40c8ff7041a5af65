"""`grpo` command line: one subcommand per stage, plus the pipeline, promotion and serving."""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from pathlib import Path


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
    from grpo.launch.runner import run_grpo, run_sft

    cfg = _config(a)
    _preflight(cfg, model_dirs=(a.policy,))
    out = Path(a.out) if a.out else cfg.run_dir() / "grpo"
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


def cmd_evaluate(a: argparse.Namespace) -> None:
    from grpo.eval.metrics import markdown_table
    from grpo.eval.run import default_report_dir, evaluate_model

    cfg = _config(a)
    model = a.model
    if model.startswith("models:/"):
        from tasks.registry import download_model

        model = str(download_model(model, cfg))
    sets = a.sets.split(",") if a.sets else cfg.eval.sets
    _preflight(cfg.model_copy(update={"eval": cfg.eval.model_copy(update={"sets": sets})}),
               model_dirs=(model, a.baseline), train=False, base=a.base)  # fmt: skip
    out = a.out or str(default_report_dir(cfg, model))
    samples = a.samples or cfg.eval.samples
    report = evaluate_model(cfg, model, sets, out, samples=samples, limit=a.limit, base=a.base)
    print(markdown_table(report))
    print(f"report: {out}/report.json  samples: {out}/samples.jsonl")
    if a.baseline:
        from grpo.eval.metrics import format_paired, paired_difference

        base_out = f"{out}_baseline"
        evaluate_model(cfg, a.baseline, sets, base_out, samples=samples, limit=a.limit,
                       base=a.base)  # fmt: skip
        mine = [json.loads(x) for x in Path(out, "samples.jsonl").open()]
        theirs = [json.loads(x) for x in Path(base_out, "samples.jsonl").open()]
        print(f"\n{model} - {a.baseline} (same problems and samples, paired 95% CI):")
        for s in sets:
            d = paired_difference(
                [r for r in theirs if r["set"] == s], [r for r in mine if r["set"] == s]
            )
            print(f"  {s:16s} {format_paired(d)}")
    if os.environ.get("MLFLOW_RUN_ID"):  # inside an active MLflow run: log there too
        from tasks.tracking import log_evaluation

        log_evaluation(cfg, os.environ["MLFLOW_RUN_ID"], report, Path(out))


def cmd_pipeline(a: argparse.Namespace) -> None:
    from flows.pipeline import PipelineParams, grpo_pipeline
    from flows.prefect_db import pipeline_api

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


def cmd_import_gguf(a: argparse.Namespace) -> None:
    from grpo.launch.paths import gguf_model_dir

    cfg = _config(a)
    out = gguf_model_dir(a.gguf, Path(a.cache) if a.cache else Path(cfg.output_dir) / "base")
    print(out)


def cmd_serve(a: argparse.Namespace) -> None:
    from flows.serve import serve

    serve(a.config, prefect_port=a.prefect_port, mlflow_port=a.mlflow_port,
          state_dir=a.state_dir, pool=a.pool, stale_hours=a.alert_stale_hours,
          database=a.database, crashed_after_s=a.crashed_after_s)  # fmt: skip


def cmd_worker(a: argparse.Namespace) -> None:
    from flows.serve import worker

    worker(a.pool, a.name, a.limit)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="grpo", description=__doc__)
    p.add_argument("--debug", action="store_true", help="tracebacks instead of one-line errors")
    sub = p.add_subparsers(dest="command", required=True)

    def add(name: str, fn, help_: str) -> argparse.ArgumentParser:  # noqa: ANN001
        sp = sub.add_parser(name, help=help_)
        sp.add_argument(
            "--config", help="YAML config (default: the embedded default run, configs/tiny.yaml)"
        )
        sp.add_argument("--set", action="append", metavar="KEY=VALUE", help="config override")
        sp.set_defaults(fn=fn)
        return sp

    s = add("sft", cmd_sft, "build the SFT reference policy")
    s.add_argument("--force", action="store_true", help="rebuild even if cached")
    t = add("train", cmd_train, "GRPO training (DeepSpeed)")
    t.add_argument("--nproc", type=int, help="ranks on this node (GPUs or CPU processes)")
    t.add_argument("--hostfile", help="DeepSpeed hostfile for several nodes")
    t.add_argument("--policy", help="start from this model directory instead of the SFT ref")
    t.add_argument("--out", help="run directory (default runs/<run_name>/grpo)")
    t.add_argument("--resume", action="store_true", help="continue from the last checkpoint")
    t.add_argument("--overwrite", action="store_true",
                   help="delete the run already in --out and start again")  # fmt: skip
    e = add("evaluate", cmd_evaluate, "evaluate a model on held-out sets")
    e.add_argument("--model", required=True,
                   help="model directory, LoRA adapter or models:/NAME@ALIAS")  # fmt: skip
    e.add_argument("--base", help="the base model of a LoRA adapter directory (default: the "
                   "one its adapter_config.json names)")  # fmt: skip
    e.add_argument("--sets", help="comma-separated: synthetic,synthetic_ood,gsm8k,math500,PATH")
    e.add_argument("--samples", type=int)
    e.add_argument("--limit", type=int)
    e.add_argument("--out")
    e.add_argument("--baseline", help="second model evaluated on the same problems and samples")
    pl = add("pipeline", cmd_pipeline, "the whole Prefect pipeline")
    pl.add_argument("--no-control", action="store_true",
                    help="skip the SFT-continued control (GRPO is then compared with its "
                    "reference only)")  # fmt: skip
    pl.add_argument("--resume", metavar="RUN_ID",
                    help="continue a pipeline that did not finish (its MLflow run id, printed "
                    "when it stopped): same config, GRPO from its last checkpoint")  # fmt: skip
    pr = add("promote", cmd_promote, "point an alias (default champion) at a model version")
    pr.add_argument("--version", required=True)
    pr.add_argument("--alias", default="champion")
    pr.add_argument("--reason", help="why (recorded on the version with who and when)")
    ig = add("import-gguf", cmd_import_gguf, "turn a GGUF file into a Hugging Face directory")
    ig.add_argument("gguf", help="a .gguf path, or package:path inside an installed package")
    ig.add_argument("--cache", help="where converted models live (default <output_dir>/base)")
    sv = add("serve", cmd_serve, "local Prefect + MLflow servers, deployment and worker")
    sv.add_argument("--prefect-port", type=int, default=4200)
    sv.add_argument("--mlflow-port", type=int, default=5000)
    sv.add_argument("--state-dir", help="servers' stores and logs (default: the project)")
    sv.add_argument("--pool", default="grpo-process-pool", help="work pool the worker serves")
    sv.add_argument("--database", metavar="local|URL",
                    help="the servers' stores in PostgreSQL: `local` starts one in the state "
                    "directory (from a wheel); postgresql://user@host[:port] is a team's server "
                    "(password in PGPASSWORD or ~/.pgpass). Default: SQLite files")  # fmt: skip
    sv.add_argument("--crashed-after-s", type=int, default=600,
                    help="a flow run that sent no heartbeat for this long (its worker or machine "
                    "died) is set Crashed and its MLflow runs KILLED; keep it above 3 x "
                    "PREFECT_FLOWS_HEARTBEAT_FREQUENCY (180 s)")  # fmt: skip
    wk = add("worker", cmd_worker, "another worker for a running serve's work pool (this "
             "machine or another)")  # fmt: skip
    wk.add_argument("--pool", default="grpo-process-pool", help="the work pool to serve")
    wk.add_argument("--name", help="the worker's name in the Prefect UI (default: generated)")
    wk.add_argument("--limit", type=int, default=1,
                    help="flow runs at once here (a pipeline uses every core)")  # fmt: skip
    sv.add_argument("--alert-stale-hours", type=float, default=26.0,
                    help="with GRPO_ALERT_WEBHOOK_URL set: alert when the nightly deployment has "
                    "had no completed run for this long")  # fmt: skip
    a = p.parse_args(argv)
    from grpo.launch.environment import quiet_environment

    quiet_environment()  # quiet offline operation, before anything imports torch

    def run() -> None:
        if a.command != "serve":
            from tasks.server_auth import apply_to_environment

            apply_to_environment()  # a served state directory's credentials, for its servers
        a.fn(a)

    signals: list[int] = []
    if a.command != "serve":  # serve stops its servers and worker itself
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, _interrupt_handler(signals))
    if a.debug:
        os.environ["GRPO_DEBUG"] = "1"  # ranks print their tracebacks too
    try:
        run()
    except KeyboardInterrupt as e:
        detail = RESUME[a.command]
        if isinstance(e, Interrupted):  # the pipeline's flow caught the signal and ended
            if not signals:  # Prefect's engine, not our handler, took it: the flow names it
                signals.append(e.signum)
            detail = e.detail or detail
        if not signals:  # raised by something else than our handler: still one line
            signals.append(signal.SIGINT)
        print(f"interrupted ({signal.Signals(signals[0]).name}): {detail}", file=sys.stderr)
        if a.debug:
            raise
        sys.exit(128 + signals[0])
    except _user_errors() as e:
        if a.debug:
            raise
        print(f"error: {_one_line(e)}", file=sys.stderr)
        sys.exit(2)


class Interrupted(KeyboardInterrupt):
    """A command stopped by a signal that someone else handled first (the pipeline's flow)."""

    def __init__(self, signum: int, detail: str = "") -> None:
        super().__init__()
        self.signum, self.detail = signum, detail


# what a user does after stopping a command (Ctrl-C, SIGTERM): printed as its last line
RESUME = {
    "sft": "every process stopped; an unfinished reference is never cached, `grpo sft` "
    "builds it again",
    "train": "every rank stopped; the same command with --resume continues from the last "
    "checkpoint",
    "evaluate": "every process stopped; run the same command again",
    "pipeline": "every stage stopped, its MLflow runs ended KILLED; `grpo pipeline --resume "
    "RUN_ID` (the MLflow run printed above) continues it, GRPO from its last checkpoint",
    "promote": "nothing was changed unless the alias line was printed",
    "import-gguf": "stopped; the next run converts the file again",
    "worker": "the worker stopped; a flow run it had started ends Crashed",
}


def _interrupt_handler(signals: list[int]):  # noqa: ANN202
    """SIGINT and SIGTERM alike: stop every process this command started (ranks, workers)
    within seconds, then unwind as KeyboardInterrupt, so that MLflow runs and the Prefect flow
    run are ended on the way out. Children are stopped first because a stage running in
    another thread (the control beside GRPO) does not see this thread's exception."""

    def handler(signum: int, frame: object) -> None:  # noqa: ARG001
        signals.append(signum)
        runner = sys.modules.get("grpo.launch.runner")
        if runner is not None:  # not imported: nothing was started
            runner.stop_started()
        raise KeyboardInterrupt

    return handler


def _user_errors() -> tuple[type[BaseException], ...]:
    """Failures a user can act on: one line each, no traceback (--debug shows it). Every layer's
    own errors derive from UserError; OSError is a file or a port."""
    from reward_fns.errors import UserError

    return (UserError, OSError)


def _one_line(e: BaseException) -> str:
    """The message, and the file an OSError is about."""
    if isinstance(e, OSError) and e.filename:
        return f"{e.filename}: {e.strerror or e}"
    return str(e)


if __name__ == "__main__":
    main()
