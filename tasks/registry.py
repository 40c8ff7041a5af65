"""Model registry: versions with evaluation tags, challenger/champion aliases, the gate."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from grpo.config import Config
from tasks.alias_lock import alias_move
from tasks.gate import decide, decision_markdown, evidence_tags, tidy
from tasks.tracking import client, safe_key, tracking_uri


def register(
    cfg: Config,
    run_id: str,
    model_uri: str,
    metrics: dict[str, float],
    *,
    vs_reference: dict[str, float] | None,
    vs_champion: dict[str, float] | None,
    champion_version: str | None,
    description: str = "",
) -> dict[str, Any]:
    """A version of the logged model (tasks.serving) of run_id, tagged with its metrics; alias
    challenger; @champion through the paired gate (tasks.gate), whose decision and evidence are
    recorded on the version. Safe to retry: the version of the same run is reused."""
    from mlflow.exceptions import MlflowException

    c = client(cfg)
    name = cfg.tracking.registered_model
    try:
        c.create_registered_model(name, description="GRPO policies from grpo-pipeline")
    except MlflowException as e:
        # it exists already (perhaps created a moment ago by a concurrent pipeline)
        if e.error_code != "RESOURCE_ALREADY_EXISTS":
            raise
    # a Prefect retry must not create a second version of the same run
    existing = c.search_model_versions(f"name='{name}' and run_id='{run_id}'")
    logged = model_uri.removeprefix("models:/") if model_uri.startswith("models:/m-") else None
    mv = existing[0] if existing else c.create_model_version(
        name, source=model_uri, run_id=run_id, model_id=logged
    )  # fmt: skip
    if logged and not existing:
        # the logged model names its version, as mlflow.register_model does (the client call
        # above does not): the experiment's Models tab then shows where it was registered
        import json

        c.set_logged_model_tags(logged, {"mlflow.modelVersions": json.dumps(
            [{"name": name, "version": int(mv.version)}])})  # fmt: skip
    tags = {safe_key(k): tidy(v) for k, v in metrics.items()}
    tags.update(evidence_tags(vs_reference, vs_champion))
    if logged:
        # the SQL stores keep no model id on a version (a server's answer has it): a tag does
        tags["logged_model_id"] = logged
    passed, reason = decide(
        vs_reference, vs_champion, champion_version, cfg.tracking.promotion_margin,
        cfg.tracking.promotion_metric,
    )  # fmt: skip
    awaiting = cfg.tracking.promotion == "approve"
    # compare-and-set: the champion is checked again and moved under one lock
    with alias_move(tracking_uri(cfg), name, "champion"):
        if passed:
            passed, reason = _champion_unchanged(c, name, champion_version, reason)
        verdict = ("recommended" if passed else "not recommended") if awaiting else (
            "promoted" if passed else "not promoted")  # fmt: skip
        tags.update({"gate/decision": verdict, "promotion": reason,
                     "gate/champion_version": str(champion_version or "none"),
                     "eval_settings": cfg.digest("eval", "data")})  # fmt: skip
        if awaiting:
            tags["approval/decision"] = "awaiting"
        for k, v in tags.items():
            c.set_model_version_tag(name, mv.version, k, v)
        c.set_registered_model_alias(name, "challenger", mv.version)
        promoted = passed and not awaiting
        if promoted and (refused := _move_champion(c, name, str(mv.version))):
            promoted, reason = False, f"{reason}; {refused}"
            c.set_model_version_tag(name, mv.version, "promotion", reason)
            c.set_model_version_tag(name, mv.version, "gate/decision", "recommended")
    decision = decision_markdown(
        name, str(mv.version), promoted, reason, vs_reference, vs_champion, champion_version,
        cfg.tracking.promotion_margin, advice=passed if awaiting else None,
    )  # fmt: skip
    about = description.strip()
    c.update_model_version(name, mv.version, description=f"{decision}\n\n{about}".strip())
    return {"name": name, "version": mv.version, "champion": promoted, "reason": reason,
            "decision": decision, "gate_passed": passed, "awaiting_approval": awaiting,
            "champion_version": champion_version, "about": about}  # fmt: skip


def _champion_unchanged(c: Any, name: str, compared: str | None, reason: str) -> tuple[bool, str]:
    """The gate's evidence is against the champion of the run's start: when another pipeline
    moved @champion since (two finishing at once, or a decision that waited for a person), that
    evidence no longer says anything, and the candidate is not promoted over a model it never
    met. Called inside tasks.alias_lock.alias_move, with the move that follows it."""
    now = _alias_version(c, name, "champion")
    now_v = str(now.version) if now is not None else None
    if now_v == (str(compared) if compared is not None else None):
        return True, reason
    was = f"v{compared}" if compared else "none"
    return False, (
        f"{reason.split(':', 1)[0]}: @champion moved from {was} to v{now_v} during this run; "
        "the evidence is against a model that is no longer champion: refused (grpo promote "
        "overrides)"
    )


def apply_approval(cfg: Config, reg: dict[str, Any], approval: dict[str, Any]) -> dict[str, Any]:
    """A person's decision on a version that awaited approval (tasks.approval): @champion when
    approved and the champion the evidence was against is still champion; the decision, who,
    when and why as tags and in the description. A rejection leaves @champion where it was."""
    c = client(cfg)
    name, version = reg["name"], str(reg["version"])
    promote = bool(approval["promote"])
    why = f"{'approved' if promote else 'rejected'} by {approval['by']}: {approval['reason']}"
    with alias_move(tracking_uri(cfg), name, "champion"):
        if promote:
            promote, reason = _champion_unchanged(c, name, reg["champion_version"], why)
        else:
            reason = why
        if promote and not reg["gate_passed"]:
            reason += " (against the gate's advice)"
        tags = {"approval/decision": "approved" if approval["promote"] else "rejected",
                "approval/by": approval["by"], "approval/at": approval["at"],
                "approval/reason": approval["reason"], "promotion": reason}  # fmt: skip
        if promote and (refused := _move_champion(c, name, version)):
            promote, reason = False, f"{reason}; {refused}"
            tags["promotion"] = reason
        for k, v in tags.items():
            c.set_model_version_tag(name, version, k, v)
    aliases = "@champion and @challenger" if promote else "@challenger"
    heading = (f"**{name} version {version}: {'promoted' if promote else 'not promoted'}** "
               f"({aliases}). {reason}")  # fmt: skip
    decision = f"{heading}\n\nThe gate's evidence, as the approver saw it:\n\n{reg['decision']}"
    c.update_model_version(name, version, description=f"{decision}\n\n{reg['about']}".strip())
    return {**reg, "champion": promote, "reason": reason, "decision": decision,
            "awaiting_approval": False}  # fmt: skip


def _move_champion(c: Any, name: str, version: str) -> str | None:
    """Point @champion at version; on a server with roles (infra.roles) an account that may
    not (a worker's trainer account) is refused: returns what to do then, for the version's
    record, instead of failing a pipeline whose every result is already logged."""
    from mlflow.exceptions import MlflowException

    try:
        c.set_registered_model_alias(name, "champion", version)
    except MlflowException as e:
        if e.error_code != "PERMISSION_DENIED":
            raise
        return (f"not moved: the server refused this account ({e.message}); an approver "
                f"runs `grpo promote --version {version}`")  # fmt: skip
    return None


def champion(cfg: Config, dst: Path) -> dict[str, Any]:
    """The current @champion: its version and its Hugging Face directory downloaded to dst
    (path None when it cannot be fetched: the gate then refuses, naming the reason)."""
    from mlflow.exceptions import MlflowException

    mv = _alias_version(client(cfg), cfg.tracking.registered_model, "champion")
    if mv is None:
        return {"version": None, "path": None}
    uri = f"models:/{cfg.tracking.registered_model}/{mv.version}"
    try:
        return {"version": str(mv.version), "path": str(download_model(uri, cfg, str(dst)))}
    except (MlflowException, OSError) as e:
        return {"version": str(mv.version), "path": None, "error": str(e)}


def _alias_version(c: Any, name: str, alias: str) -> Any:
    from mlflow.exceptions import MlflowException

    try:
        return c.get_model_version_by_alias(name, alias)
    except MlflowException:
        return None


def promote(cfg: Config, version: str, alias: str = "champion", reason: str = "") -> None:
    """Manual promotion or rollback, past the gate: point alias at version and record who did
    it and why on the version.

    Args:
        cfg: the config naming the tracking store and the registered model.
        version: the model version to point the alias at (it must exist).
        alias: champion by default; any alias name.
        reason: why, recorded on the version with who and when.
    """
    import getpass
    import os
    import time

    c = client(cfg)
    name = cfg.tracking.registered_model
    c.get_model_version(name, version)  # raises if it does not exist
    with alias_move(tracking_uri(cfg), name, alias):
        c.set_registered_model_alias(name, alias, version)
    # a served MLflow also records the account on the version itself (promoted_by)
    account = os.environ.get("MLFLOW_TRACKING_USERNAME")
    who = (f"{getpass.getuser()}{f' (account {account})' if account else ''} at "
           f"{time.strftime('%Y-%m-%d %H:%M:%S')}")  # fmt: skip
    c.set_model_version_tag(
        name, version, f"manual/{alias}", f"{who}: {reason or 'no reason given'}"
    )


def download_model(uri: str, cfg: Config, dst: str | None = None) -> Path:
    """A models:/NAME@ALIAS (or /VERSION) URI as a local Hugging Face model directory."""
    import mlflow

    from tasks.serving import policy_dir_of

    client(cfg)
    return policy_dir_of(Path(mlflow.artifacts.download_artifacts(artifact_uri=uri, dst_path=dst)))
