"""Model registry: versions with evaluation tags, challenger/champion aliases, a promotion gate."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from grpo.config import Config
from tasks.tracking import client, safe_key


def register(cfg: Config, run_id: str, model_uri: str, metrics: dict[str, float]) -> dict[str, Any]:
    """A version of the logged model (tasks.serving) of run_id; alias challenger; the gate
    for champion. Safe to retry: a version of the same run is reused, not duplicated."""
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
    for k, v in metrics.items():
        c.set_model_version_tag(name, mv.version, safe_key(k), f"{v:.6f}")
    c.set_registered_model_alias(name, "challenger", mv.version)
    metric = safe_key(cfg.tracking.promotion_metric)
    candidate = {safe_key(k): v for k, v in metrics.items()}.get(metric)
    champion = _alias_version(c, name, "champion")
    promoted, reason = False, ""
    if champion is None:
        promoted, reason = True, "first model: champion"
    elif candidate is None:
        reason = f"candidate has no {metric}"
    else:
        current = float(champion.tags.get(metric, "nan"))
        margin = cfg.tracking.promotion_margin
        if current != current or candidate > current + margin:
            promoted = True
            reason = (
                f"{metric} {candidate:.4f} > champion v{champion.version} {current:.4f}+{margin}"
            )
        else:
            reason = (
                f"{metric} {candidate:.4f} <= champion v{champion.version} {current:.4f}+{margin}"
            )
    if promoted:
        c.set_registered_model_alias(name, "champion", mv.version)
    c.set_model_version_tag(name, mv.version, "promotion", reason)
    return {"name": name, "version": mv.version, "champion": promoted, "reason": reason}


def _alias_version(c: Any, name: str, alias: str) -> Any:
    from mlflow.exceptions import MlflowException

    try:
        return c.get_model_version_by_alias(name, alias)
    except MlflowException:
        return None


def promote(cfg: Config, version: str, alias: str = "champion") -> None:
    """Manual promotion or rollback: point alias at version."""
    c = client(cfg)
    c.get_model_version(cfg.tracking.registered_model, version)  # raises if it does not exist
    c.set_registered_model_alias(cfg.tracking.registered_model, alias, version)


def download_model(uri: str, cfg: Config, dst: str | None = None) -> Path:
    """A models:/NAME@ALIAS (or /VERSION) URI as a local Hugging Face model directory."""
    import mlflow

    from tasks.serving import policy_dir_of

    client(cfg)
    return policy_dir_of(Path(mlflow.artifacts.download_artifacts(artifact_uri=uri, dst_path=dst)))
