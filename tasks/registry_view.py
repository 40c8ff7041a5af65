"""`grpo models`: the registry from a terminal. Which models exist, their versions, where the
aliases point, what the gate decided and who moved @champion, without the MLflow UI."""

from __future__ import annotations

from typing import Any

from tasks.terminal import print_rows


def _who_promoted(tags: dict[str, str]) -> str:
    """How a version became champion, from the tags the gate, the approval and `grpo promote`
    write (and a served MLflow's `promoted_by`, the account it authenticated)."""
    parts = []
    if tags.get("gate/decision") == "promoted":
        parts.append("the gate")
    if tags.get("approval/decision") == "approved":
        parts.append(f"approved by {tags.get('approval/by', '?')}")
    if "manual/champion" in tags:
        parts.append("grpo promote: " + tags["manual/champion"].partition(":")[0])
    if "promoted_by" in tags:
        parts.append(f"account {tags['promoted_by']}")
    return "; ".join(parts) or "-"


def _metric_key(tags: list[dict[str, str]], metric: str) -> str:
    """The promotion metric when a version has it as a tag, else the newest version's first
    eval accuracy (a model registered by another config)."""
    if not tags or any(metric in t for t in tags):
        return metric
    acc = sorted(k for k in tags[0] if k.startswith("eval/") and k.endswith("/accuracy"))
    return acc[0] if acc else metric


def registry_listing(c: Any, name: str | None, metric: str, limit: int) -> dict[str, Any]:
    """Every registered model (its version count and aliases), and the newest `limit` versions
    of `name` (all models when None) with aliases, run, metric, gate and approval decisions
    and who promoted; plain data, as `grpo models --format json` prints it.

    Args:
        c: an MlflowClient of the tracking store.
        name: one registered model, or None for all of them.
        metric: the promotion metric, a version tag such as eval/synthetic/accuracy.
        limit: the newest versions shown per model.
    """
    import datetime as dt

    models = []
    for rm in sorted(c.search_registered_models(), key=lambda m: m.name):
        if name is not None and rm.name != name:
            continue
        aliases = dict(sorted((getattr(rm, "aliases", None) or {}).items()))
        by_version: dict[str, list[str]] = {}
        for alias, v in aliases.items():
            by_version.setdefault(str(v), []).append("@" + alias)
        versions = sorted(c.search_model_versions(f"name='{rm.name}'"),
                          key=lambda v: int(v.version), reverse=True)  # fmt: skip
        shown = [(mv, dict(mv.tags or {})) for mv in versions[:limit]]
        key = _metric_key([t for _, t in shown], metric)
        rows = []
        for mv, tags in shown:
            created = dt.datetime.fromtimestamp(mv.creation_timestamp / 1000, dt.UTC)
            v = str(mv.version)
            rows.append({
                "version": v, "aliases": " ".join(by_version.get(v, [])),
                "created": created.strftime("%Y-%m-%d %H:%M UTC"), "run_id": mv.run_id or "-",
                "metric": key, "value": tags.get(key, "-"), "gate": tags.get("gate/decision", "-"),
                "approval": tags.get("approval/decision", "-"), "promoted": _who_promoted(tags),
            })  # fmt: skip
        models.append({"name": rm.name, "versions": len(versions), "aliases": aliases,
                       "shown": rows})  # fmt: skip
    return {"models": models}


def print_listing(listing: dict[str, Any], console: Any = None) -> None:
    """The listing as tables that fit the terminal (run ids whole)."""
    from rich.console import Console

    console = console or Console()
    models = listing["models"]
    if not models:
        console.print("no registered models in this tracking store")
        return
    summary = [{"model": m["name"], "versions": str(m["versions"]),
                "aliases": ", ".join(f"@{a} -> v{v}" for a, v in m["aliases"].items()) or "-"}
               for m in models]  # fmt: skip
    print_rows(console, "registered models", summary, whole=("model",))
    for m in models:
        rows = [{"version": r["version"], "aliases": r["aliases"] or "-", r["metric"]: r["value"],
                 "gate": r["gate"], "approval": r["approval"], "promoted": r["promoted"],
                 "created": r["created"], "run_id": r["run_id"]} for r in m["shown"]]  # fmt: skip
        more = m["versions"] - len(rows)
        title = f"{m['name']}: newest {len(rows)} of {m['versions']} versions" if more else (
            f"{m['name']}: {m['versions']} version{'s' if m['versions'] != 1 else ''}")  # fmt: skip
        if rows:
            print_rows(console, title, rows, whole=("run_id", "created", "version"),
                       key="version")  # fmt: skip
