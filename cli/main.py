"""`grpo` command line: one subcommand per stage, plus the pipeline, promotion and serving.
This module parses and dispatches; what each subcommand does is in cli.commands."""

from __future__ import annotations

import argparse
import os
import signal
import sys

from cli import commands
from cli.signals import Interrupted


def build_parser() -> argparse.ArgumentParser:
    """The `grpo` parser: one subcommand per stage, each with --config and --set."""
    p = argparse.ArgumentParser(
        prog="grpo",
        description="GRPO pipeline: one subcommand per stage, the pipeline, promotion, serving",
    )
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

    s = add("sft", commands.cmd_sft, "build the SFT reference policy")
    s.add_argument("--force", action="store_true", help="rebuild even if cached")
    t = add("train", commands.cmd_train, "GRPO training (DeepSpeed)")
    t.add_argument("--nproc", type=int, help="ranks on this node (GPUs or CPU processes)")
    t.add_argument("--hostfile", help="DeepSpeed hostfile for several nodes")
    t.add_argument("--policy", help="start from this model directory instead of the SFT ref")
    t.add_argument("--out", help="run directory (default runs/<run_name>/grpo)")
    t.add_argument("--resume", action="store_true", help="continue from the last checkpoint")
    t.add_argument("--overwrite", action="store_true",
                   help="delete the run already in --out and start again")  # fmt: skip
    e = add("evaluate", commands.cmd_evaluate, "evaluate a model on held-out sets")
    e.add_argument("--model", required=True,
                   help="model directory, LoRA adapter, Hub id (owner/name, from the "
                   "Hugging Face cache) or models:/NAME@ALIAS")  # fmt: skip
    e.add_argument("--base", help="the base model of a LoRA adapter directory (default: the "
                   "one its adapter_config.json names)")  # fmt: skip
    e.add_argument("--sets", help="comma-separated: synthetic,synthetic_ood,gsm8k,math500,PATH")
    e.add_argument("--samples", type=int)
    e.add_argument("--limit", type=int)
    e.add_argument("--out")
    e.add_argument("--baseline", help="second model evaluated on the same problems and samples")
    e.add_argument(
        "--without-tools", action="store_true",
        help="with tools configured: the same model also without them, paired",
    )  # fmt: skip
    pl = add("pipeline", commands.cmd_pipeline, "the whole Prefect pipeline")
    pl.add_argument("--no-control", action="store_true",
                    help="skip the SFT-continued control (GRPO is then compared with its "
                    "reference only)")  # fmt: skip
    pl.add_argument("--resume", metavar="RUN_ID",
                    help="continue a pipeline that did not finish (its MLflow run id, printed "
                    "when it stopped): same config, GRPO from its last checkpoint")  # fmt: skip
    pr = add(
        "promote", commands.cmd_promote, "point an alias (default champion) at a model version"
    )
    pr.add_argument("--version", required=True)
    pr.add_argument("--alias", default="champion")
    pr.add_argument("--reason", help="why (recorded on the version with who and when)")
    cp = add(
        "compare",
        commands.cmd_compare,
        "two pipeline runs side by side: params, held-out metrics, paired differences",
    )
    for side, what in (("a", "the first run"), ("b", "the second, read against the first (B - A)")):
        cp.add_argument(side, metavar=side.upper(),
                        help=f"{what}: an MLflow run id, a run name (its latest pipeline run) "
                        "or models:/NAME/VERSION, models:/NAME@ALIAS")  # fmt: skip
    cp.add_argument(
        "--format",
        choices=("table", "markdown", "json"),
        default="table",
        help="rich tables (default), markdown for notes and PR comments, json for CI",
    )
    md = add("models", commands.cmd_models, "the registry: models, versions, aliases, the "
             "gate's decisions and who promoted")  # fmt: skip
    md.add_argument("--name", help="one registered model (default: tracking.registered_model; "
                    "--all for every one)")  # fmt: skip
    md.add_argument("--all", action="store_true", help="every registered model in the store")
    md.add_argument("--limit", type=int, default=10, help="newest versions shown a model")
    md.add_argument("--format", choices=("table", "json"), default="table")
    ig = add(
        "import-gguf", commands.cmd_import_gguf, "turn a GGUF file into a Hugging Face directory"
    )
    ig.add_argument("gguf", help="a .gguf path, or package:path inside an installed package")
    ig.add_argument("--cache", help="where converted models live (default <output_dir>/base)")
    sv = add("serve", commands.cmd_serve, "local Prefect + MLflow servers, deployment and worker")
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
    sv.add_argument("--tls-cert", help="PEM certificate (chain) both servers present on https; "
                    "clients trust its CA through SSL_CERT_FILE / REQUESTS_CA_BUNDLE")  # fmt: skip
    sv.add_argument("--tls-key", help="the private key of --tls-cert (PEM)")
    sv.add_argument("--tls-self-signed", action="store_true",
                    help="https with a certificate made (and kept) in the state directory, for "
                    "trying it out; clients trust STATE/.grpo-serve/tls/ca-bundle.pem")  # fmt: skip
    sv.add_argument("--insecure-http", action="store_true",
                    help="allow plain HTTP on a non-loopback GRPO_SERVE_HOST (passwords cross "
                    "the network in clear)")  # fmt: skip
    wk = add("worker", commands.cmd_worker, "another worker for a running serve's work pool (this "
             "machine or another)")  # fmt: skip
    wk.add_argument("--pool", default="grpo-process-pool", help="the work pool to serve")
    wk.add_argument("--name", help="the worker's name in the Prefect UI (default: generated)")
    wk.add_argument("--limit", type=int, default=1,
                    help="flow runs at once here (a pipeline uses every core)")  # fmt: skip
    us = add("users", commands.cmd_users, "accounts with a role on the served MLflow (admin only):"
             " reader, trainer (logs, registers), approver (also moves @champion)")  # fmt: skip
    us.add_argument("action", choices=["add", "remove", "list"])
    us.add_argument("name", nargs="?", help="the account (add, remove)")
    us.add_argument("--role", choices=["reader", "trainer", "approver"], help="add: its role")
    us.add_argument("--out", help="add: where its settings file goes (default: "
                    "STATE/.grpo-serve/users/NAME.env)")  # fmt: skip
    sv.add_argument("--alert-stale-hours", type=float, default=26.0,
                    help="with GRPO_ALERT_WEBHOOK_URL set: alert when the nightly deployment has "
                    "had no completed run for this long")  # fmt: skip
    return p


def main(argv: list[str] | None = None) -> None:
    """Parse, then run the subcommand: a user's error in one line (exit 2), a signal as
    `interrupted (SIGINT): what to do next` (exit 128 + the signal)."""
    a = build_parser().parse_args(argv)
    from grpo.launch.environment import quiet_environment

    quiet_environment()  # quiet offline operation, before anything imports torch

    def run() -> None:
        if a.command != "serve":
            from infra.auth import apply_to_environment

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
    "compare": "stopped; nothing was changed",
    "models": "stopped; nothing was changed",
    "import-gguf": "stopped; the next run converts the file again",
    "worker": "the worker stopped; a flow run it had started ends Crashed",
    "users": "stopped; `grpo users list` shows what exists",
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
