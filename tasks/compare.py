"""Two pipeline runs side by side, from the tracking store alone: what differs in their
configs and code, their held-out numbers per set and model, paired differences where both
evaluated the same problems, and what each cost (wall time, peak memory, steps).

`grpo compare A B` prints it; B is read against A (B - A), as `git diff A B` reads."""

from __future__ import annotations

import json
import re
import tempfile
from pathlib import Path
from typing import Any

from reward_fns.errors import UserError

# a pipeline's held-out metrics on its parent run: <model>/eval/<set>/<metric>
_EVAL_METRIC = re.compile(r"(?P<model>[^/]+)/eval/(?P<set>[^/]+)/(?P<metric>[^/]+)")
# the per-set numbers compared, in this order (sampled pass@k / maj@k when the run sampled them)
_SHOWN = ("accuracy", "accuracy_lenient", "sampled_mean_accuracy", "mean_length",
          "truncation_rate")  # fmt: skip
_SAMPLED = re.compile(r"sampled_(pass|maj)(@|_at_)\d+")  # MLflow keys spell @ as _at_
# tags that say which code, data and machine produced a run, compared beside the params
_IDENTITY_TAGS = ("mlflow.source.git.commit", "pipeline_version", "config_digest", "data_hash",
                  "host.cpu", "host.cpu_count")  # fmt: skip
# what a run cost: a label, then where to read it (parent metric, or stage: metric)
_COSTS = (
    ("wall time (min)", None),
    ("peak RSS of its largest process (GB)", "pipeline/peak_rss_mb"),
    ("GRPO steps", "grpo/steps"),
    ("GRPO time (min)", "grpo/seconds"),
    ("SFT reference steps", "sft:sft/steps"),
    ("control steps", "sft_continued:sft_continued/steps"),
    ("RFT sampled completions", "rft:rft/total_sampled"),
    ("RFT fine-tuning steps", "rft:rft/total_sft_steps"),
)


class CompareError(UserError, ValueError):
    """A run to compare cannot be found, or is not a pipeline run; the message names it."""


def resolve_run(c: Any, ref: str) -> Any:
    """The pipeline parent run that `ref` names: a run id, a run name (the latest pipeline run
    of that name), or a registered version `models:/NAME/VERSION` / `models:/NAME@ALIAS` (the
    pipeline that registered it).

    Args:
        c: an MlflowClient.
        ref: what the user typed.
    """
    from mlflow.exceptions import MlflowException

    if ref.startswith("models:/"):
        name, _, which = ref.removeprefix("models:/").partition("@")
        try:
            if which:
                mv = c.get_model_version_by_alias(name, which)
            else:
                name, _, version = name.rpartition("/")
                mv = c.get_model_version(name, version)
        except MlflowException as e:
            raise CompareError(f"{ref}: no such registered model version ({e.error_code})") from e
        run = c.get_run(mv.run_id)
        parent = run.data.tags.get("mlflow.parentRunId")
        if not parent:
            raise CompareError(f"{ref}: registered from run {mv.run_id}, not by a pipeline")
        return _pipeline_run(c, parent, ref)
    if re.fullmatch(r"[0-9a-f]{32}", ref):
        return _pipeline_run(c, ref, ref)
    if "'" in ref:  # it would end the filter's string early
        raise CompareError(f"{ref}: a run name here cannot hold a single quote; give its run id")
    exps = [e.experiment_id for e in c.search_experiments()]
    found = c.search_runs(
        exps, f"tags.mlflow.runName = '{ref}' and tags.run_kind = 'pipeline'",
        order_by=["attributes.start_time DESC"], max_results=1,
    )  # fmt: skip
    if not found:
        raise CompareError(f"{ref}: no pipeline run with this id or name in the tracking store")
    return found[0]


def _pipeline_run(c: Any, run_id: str, ref: str) -> Any:
    from mlflow.exceptions import MlflowException

    try:
        run = c.get_run(run_id)
    except MlflowException as e:
        raise CompareError(f"{ref}: no such run in the tracking store ({e.error_code})") from e
    tags = run.data.tags
    if tags.get("run_kind") != "pipeline":
        parent = tags.get("mlflow.parentRunId")
        hint = f"; its pipeline run is {parent}" if parent else ""
        raise CompareError(f"{ref}: run {run_id} is not a pipeline run{hint}")
    return run


def _stages(c: Any, run: Any) -> dict[str, Any]:
    kids = c.search_runs([run.info.experiment_id],
                         f"tags.mlflow.parentRunId = '{run.info.run_id}'")  # fmt: skip
    return {r.data.tags["stage"]: r for r in kids if "stage" in r.data.tags}


def _describe(run: Any) -> dict[str, Any]:
    import datetime as dt

    start = dt.datetime.fromtimestamp(run.info.start_time / 1000, dt.UTC)
    return {
        "run_id": run.info.run_id, "name": run.info.run_name, "status": run.info.status,
        "started": start.strftime("%Y-%m-%d %H:%M UTC"),
        "registered_version": run.data.tags.get("registered_version"),
    }  # fmt: skip


def differing_params(a: Any, b: Any) -> list[dict[str, Any]]:
    """The params and identity tags (commit, data and config digests, machine) whose values
    differ, "-" where a run has none; sorted by key."""
    rows = []
    for where in ("params", "tags"):
        pa, pb = getattr(a.data, where), getattr(b.data, where)
        keys = sorted(set(pa) | set(pb)) if where == "params" else _IDENTITY_TAGS
        for k in keys:
            va, vb = pa.get(k, "-"), pb.get(k, "-")
            if va != vb:
                rows.append({"key": k, "A": va, "B": vb})
    return rows


def metric_rows(a: Any, b: Any) -> list[dict[str, Any]]:
    """Held-out metrics side by side, one row per model, set and metric either run logged."""
    found: dict[tuple[str, str, str], dict[str, float | None]] = {}
    for side, run in (("A", a), ("B", b)):
        for key, v in run.data.metrics.items():
            m = _EVAL_METRIC.fullmatch(key)
            if m and (m["metric"] in _SHOWN or _SAMPLED.fullmatch(m["metric"])):
                found.setdefault((m["model"], m["set"], m["metric"]), {"A": None, "B": None})
                found[(m["model"], m["set"], m["metric"])][side] = v
    order = {k: i for i, k in enumerate(_SHOWN)}

    def sort_key(k: tuple[str, str, str]) -> tuple:
        return (_model_order(k[0]), k[1], order.get(k[2], len(order)), k[2])

    rows = []
    for k in sorted(found, key=sort_key):
        va, vb = found[k]["A"], found[k]["B"]
        diff = vb - va if va is not None and vb is not None else None
        rows.append({"model": k[0], "set": k[1], "metric": k[2], "A": va, "B": vb,
                     "B - A": diff})  # fmt: skip
    return rows


def _model_order(label: str) -> tuple[int, str]:
    known = (
        "reference",
        "grpo",
        "sft_continued",
        "rft",
        "grpo_last",
        "sft_continued_last",
        "rft_last",
        "champion",
    )
    return (known.index(label), "") if label in known else (len(known), label)


def _samples(c: Any, evaluate_run: Any, label: str, tmp: Path) -> list[dict[str, Any]] | None:
    # tmp: a directory of this side's own (a run compared with itself downloads twice)
    """A model's per-problem greedy records from the evaluate stage's artifacts (None when the
    run logged none for it)."""
    from mlflow.exceptions import MlflowException

    names = {f.path for f in c.list_artifacts(evaluate_run.info.run_id, f"{label}/eval")}
    path = f"{label}/eval/samples.jsonl"
    if path not in names:
        return None
    try:
        dst = tmp / label
        dst.mkdir(parents=True)
        local = c.download_artifacts(evaluate_run.info.run_id, path, str(dst))
    except MlflowException as e:
        raise CompareError(f"run {evaluate_run.info.run_id}: {path} cannot be read: {e}") from e
    return [json.loads(x) for x in Path(local).read_text().splitlines() if x.strip()]


def _problems(records: list[dict[str, Any]]) -> dict[str, tuple[str, str]]:
    return {str(r["id"]): (r["prompt"], str(r["gold"])) for r in records if r["sample"] == 0}


def paired_rows(
    c: Any, a: Any, b: Any, stages: dict[str, dict[str, Any]]
) -> tuple[list[dict[str, Any]], list[dict[str, str]]]:
    """B - A on the same problems for every model and set both runs evaluated (first sample
    of each problem, 95% normal interval, strict and lenient), and the pairs that could not be
    paired with why (a model one run lacks, or different problems under the same set name)."""
    from grpo.eval.metrics import paired_strict_lenient

    ev_a, ev_b = stages["A"].get("evaluate"), stages["B"].get("evaluate")
    if ev_a is None or ev_b is None:
        missing = "A" if ev_a is None else "B"
        return [], [{"model": "*", "set": "*", "why": f"{missing} has no evaluate stage"}]
    labels_a = {m["model"] for m in map(_EVAL_METRIC.fullmatch, a.data.metrics) if m}
    labels_b = {m["model"] for m in map(_EVAL_METRIC.fullmatch, b.data.metrics) if m}
    rows, skipped = [], []
    with tempfile.TemporaryDirectory(prefix="grpo-compare-") as tmp:
        for label in sorted(labels_a | labels_b, key=_model_order):
            if label not in labels_a or label not in labels_b:
                side = "A" if label not in labels_a else "B"
                skipped.append({"model": label, "set": "*", "why": f"not evaluated in {side}"})
                continue
            ra = _samples(c, ev_a, label, Path(tmp) / "A")
            rb = _samples(c, ev_b, label, Path(tmp) / "B")
            if ra is None or rb is None:
                skipped.append({"model": label, "set": "*", "why": "no per-problem records"})
                continue
            for s in sorted({r["set"] for r in ra} | {r["set"] for r in rb}):
                sa = [r for r in ra if r["set"] == s]
                sb = [r for r in rb if r["set"] == s]
                if not sa or not sb or _problems(sa) != _problems(sb):
                    skipped.append({"model": label, "set": s, "why": "not the same problems"})
                    continue
                pair = paired_strict_lenient(sa, sb)
                strict, lenient = pair["strict"], pair["lenient"]
                rows.append({"model": label, "set": s, "n": int(strict["n"]),
                             "diff": strict["diff"], "ci_low": strict["ci_low"],
                             "ci_high": strict["ci_high"], "lenient_diff": lenient["diff"],
                             "lenient_ci_low": lenient["ci_low"],
                             "lenient_ci_high": lenient["ci_high"]})  # fmt: skip
    return rows, skipped


def cost_rows(a: Any, b: Any, stages: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """Wall time, peak memory and steps of each run (None where a run did not log it); stages:
    each side's stage runs by stage."""
    rows = []
    for what, source in _COSTS:
        row: dict[str, Any] = {"what": what}
        for side, run in (("A", a), ("B", b)):
            if source is None:
                end = run.info.end_time
                row[side] = (end - run.info.start_time) / 60_000 if end else None
                continue
            stage, _, key = source.rpartition(":")
            holder = stages[side].get(stage) if stage else run
            v = holder.data.metrics.get(key) if holder is not None else None
            if v is not None and key.endswith("seconds"):
                v = v / 60
            if v is not None and key.endswith("_mb"):
                v = v / 1024
            row[side] = v
        rows.append(row)
    return rows


def compare_runs(c: Any, ref_a: str, ref_b: str) -> dict[str, Any]:
    """Everything `grpo compare` shows, as plain data (its json format).

    Args:
        c: an MlflowClient of the store both runs are in.
        ref_a: the first run (id, name or models:/ URI); differences read B - A.
        ref_b: the second run.
    """
    a, b = resolve_run(c, ref_a), resolve_run(c, ref_b)
    stages = {"A": _stages(c, a), "B": _stages(c, b)}  # one search per run, for both tables
    paired, unpaired = paired_rows(c, a, b, stages)
    return {
        "A": _describe(a), "B": _describe(b), "params": differing_params(a, b),
        "metrics": metric_rows(a, b), "paired": paired, "unpaired": unpaired,
        "costs": cost_rows(a, b, stages),
    }  # fmt: skip


def _num(v: Any, digits: int = 3, sign: bool = False) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:+.{digits}f}" if sign else f"{v:.{digits}f}"
    return str(v)


def _interval(d: float, lo: float, hi: float) -> str:
    return f"{d:+.3f} [{lo:+.3f}, {hi:+.3f}]"


def sections(result: dict[str, Any]) -> list[tuple[str, list[dict[str, str]]]]:
    """The comparison as titled tables of strings (what the table and markdown formats print)."""
    runs = [{"": side, **{k: _num(v) for k, v in result[side].items()}} for side in ("A", "B")]
    params = [{"key": r["key"], "A": r["A"], "B": r["B"]} for r in result["params"]]
    metrics = [{"model": r["model"], "set": r["set"], "metric": r["metric"], "A": _num(r["A"]),
                "B": _num(r["B"]), "B - A": _num(r["B - A"], sign=True)}
               for r in result["metrics"]]  # fmt: skip
    paired = [{"model": r["model"], "set": r["set"], "problems": str(r["n"]),
               "B - A strict (95% CI)": _interval(r["diff"], r["ci_low"], r["ci_high"]),
               "lenient": _interval(r["lenient_diff"], r["lenient_ci_low"],
                                    r["lenient_ci_high"])}
              for r in result["paired"]]  # fmt: skip

    def cost(r: dict[str, Any], side: str) -> str:
        v = r[side]
        return _num(int(v) if "steps" in r["what"] and v is not None else v, 1)

    costs = [{"what": r["what"], "A": cost(r, "A"), "B": cost(r, "B")} for r in result["costs"]]
    out = [("runs", runs),
           ("params that differ" if params else "params: the same", params),
           ("held-out metrics", metrics),
           ("paired differences, B - A on the same problems", paired)]  # fmt: skip
    if result["unpaired"]:
        out.append(("not paired", [dict(r) for r in result["unpaired"]]))
    out.append(("cost", costs))
    return out


def to_markdown(result: dict[str, Any]) -> str:
    """The comparison as markdown (a PR comment, a note)."""
    from grpo.eval.metrics import markdown_rows

    parts = []
    for title, rows in sections(result):
        parts.append(f"### {title}\n")
        if rows:
            parts.append(markdown_rows([{k: v.replace("|", "\\|") for k, v in r.items()}
                                        for r in rows]) + "\n")  # fmt: skip
    return "\n".join(parts)


def print_tables(result: dict[str, Any], console: Any = None) -> None:
    """The comparison as rich tables that fit the terminal (tasks.terminal): run ids whole."""
    from rich.console import Console

    from tasks.terminal import print_rows

    console = console or Console()
    for title, rows in sections(result):
        if not rows:
            console.print(f"[bold]{title}[/bold]" + ("" if ":" in title else ": none logged"))
            continue
        numeric = ("A", "B", "B - A", "problems") if title != "params that differ" else ()
        print_rows(console, title, rows, right=numeric, key="" if title == "runs" else None,
                   whole=("run_id", "name", "started", ""))  # fmt: skip
