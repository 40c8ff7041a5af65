"""Evaluation metrics, pure: computed from per-sample records alone.

Greedy pass@1 with a Wilson 95% interval; with n samples per problem also mean accuracy, maj@k
and the unbiased pass@k estimator (Chen et al. 2021); mean completion length, truncation; and
the paired difference of two models on the same problems.
"""

from __future__ import annotations

import math
from collections import Counter
from typing import Any

from grpo.config import set_label

Z95 = 1.959963984540054


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples with c correct: 1 - C(n-c, k) / C(n, k).

    >>> round(pass_at_k(4, 1, 2), 4)
    0.5
    """
    if k > n:
        raise ValueError(f"k: {k} exceeds the number of samples {n}")
    if n - c < k:
        return 1.0
    return 1.0 - math.prod((n - c - i) / (n - i) for i in range(k))


def majority_correct(answers: list[str], correct: list[bool]) -> bool:
    """maj@k: is the most frequent extracted answer correct? Ties go to the first seen."""
    if not answers:
        return False
    counts = Counter(answers)
    top = max(counts.values())
    winner = next(a for a in answers if counts[a] == top)
    return correct[answers.index(winner)]


def wilson_interval(successes: float, n: int, z: float = Z95) -> tuple[float, float]:
    """Wilson score interval for a proportion."""
    if n == 0:
        return (0.0, 0.0)
    p = successes / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return (max(0.0, centre - half), min(1.0, centre + half))


def summarize(records: list[dict[str, Any]]) -> dict[str, float]:
    """Metrics recomputable from the per-sample records alone."""
    by_id: dict[str, list[dict[str, Any]]] = {}
    for r in records:
        by_id.setdefault(r["id"], []).append(r)
    n_problems = len(by_id)
    n = min(len(v) for v in by_id.values()) if by_id else 0
    first = [v[0]["correct"] for v in by_id.values()]
    acc = sum(first) / max(1, n_problems)
    lo, hi = wilson_interval(sum(first), n_problems)
    out = {
        "accuracy": acc,
        "accuracy_ci_low": lo,
        "accuracy_ci_high": hi,
        # the last number in the text, whatever the format (first sample of each problem)
        "accuracy_lenient": sum(bool(v[0]["correct_lenient"]) for v in by_id.values())
        / max(1, n_problems),
        "num_problems": float(n_problems),
        "samples": float(n),
        "mean_length": sum(r["length"] for r in records) / max(1, len(records)),
        "truncation_rate": sum(r["truncated"] for r in records) / max(1, len(records)),
    }
    if records and "tool_calls" in records[0]:  # episodes with tools: how they used them
        m = max(1, len(records))
        out["tool_use_rate"] = sum(r["tool_calls"] > 0 for r in records) / m
        out["tool_calls_mean"] = sum(r["tool_calls"] for r in records) / m
        out["tool_errors_mean"] = sum(r["tool_errors"] for r in records) / m
        out["turns_mean"] = sum(r["turns"] for r in records) / m
    if n > 1:
        out["mean_accuracy"] = sum(r["correct"] for r in records) / len(records)
        k = 1
        while k <= n:
            out[f"pass@{k}"] = (
                sum(pass_at_k(n, sum(x["correct"] for x in v[:n]), k) for v in by_id.values())
                / n_problems
            )
            out[f"maj@{k}"] = (
                sum(
                    majority_correct([x["extracted"] for x in v[:k]], [x["correct"] for x in v[:k]])
                    for v in by_id.values()
                )
                / n_problems
            )
            k *= 2
    return out


def paired_difference(
    a: list[dict[str, Any]], b: list[dict[str, Any]], key: str = "correct"
) -> dict[str, float]:
    """b - a accuracy on the same problems (first sample each), with a 95% normal interval;
    key "correct_lenient" for the lenient reading."""
    ca = {r["id"]: r[key] for r in a if r["sample"] == 0}
    cb = {r["id"]: r[key] for r in b if r["sample"] == 0}
    ids = sorted(set(ca) & set(cb))
    d = [float(cb[i]) - float(ca[i]) for i in ids]
    n = len(d)
    mean = sum(d) / max(n, 1)
    var = sum((x - mean) ** 2 for x in d) / max(n - 1, 1)
    half = Z95 * math.sqrt(var / max(n, 1))
    return {"diff": mean, "ci_low": mean - half, "ci_high": mean + half, "n": float(n)}


def paired_strict_lenient(
    a: list[dict[str, Any]], b: list[dict[str, Any]]
) -> dict[str, dict[str, float]]:
    """b - a on the same problems, read strictly and leniently: {"strict": ..., "lenient": ...}
    (each as paired_difference)."""
    return {"strict": paired_difference(a, b),
            "lenient": paired_difference(a, b, key="correct_lenient")}  # fmt: skip


def markdown_table(report: dict[str, Any]) -> str:
    """One row per set: accuracy with its interval, and pass@k / maj@k when sampled."""
    ks = sorted(
        {k for m in report["sets"].values() for k in m if k.startswith(("pass@", "maj@"))},
        key=lambda k: (k.split("@")[0], int(k.split("@")[1])),
    )
    head = ["set", "problems", "accuracy", "95% CI", "lenient", *ks, "mean length", "truncated",
            "left out"]  # fmt: skip
    rows = []
    for name, m in report["sets"].items():
        cells = [
            name, str(int(m["num_problems"])), f"{m['accuracy']:.3f}",
            f"[{m['accuracy_ci_low']:.3f}, {m['accuracy_ci_high']:.3f}]",
            f"{m['accuracy_lenient']:.3f}",
            *(f"{m[k]:.3f}" if k in m else "" for k in ks),
            f"{m['mean_length']:.1f}", f"{m['truncation_rate']:.3f}",
            str(int(m.get("left_out", 0))),
        ]  # fmt: skip
        rows.append(dict(zip(head, cells)))
    # a task mix's sets: each generator's accuracy beside the whole's
    by_gen = [
        {"set": name, "generator": g, "accuracy": f"{a:.3f}"}
        for name, m in report["sets"].items()
        for g, a in m.get("by_generator", {}).items()
    ]
    extra = f"\n\n{markdown_rows(by_gen)}" if by_gen else ""
    return f"Model: `{report['model']}`\n\n" + markdown_rows(rows) + extra + "\n"


def markdown_rows(rows: list[dict[str, Any]]) -> str:
    """A markdown table with the first row's keys as its columns ("" for no rows)."""
    if not rows:
        return ""
    cols = list(rows[0])
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(str(r[k]) for k in cols) + " |" for r in rows]
    return "\n".join(lines)


def format_paired(d: dict[str, float]) -> str:
    """A paired difference as the tables print it: +0.012 [-0.014, +0.038]."""
    return f"{d['diff']:+.3f} [{d['ci_low']:+.3f}, {d['ci_high']:+.3f}]"


def comparison(
    sets: list[str],
    labels: list[str],
    reports: dict[str, dict],
    samples: dict[str, list[dict]],
    candidate: str = "grpo",
) -> tuple[list[dict[str, Any]], dict[str, float], dict[str, dict[str, dict]]]:
    """The table (one row per set: each model's accuracy, each model minus the reference with
    a paired interval; GRPO minus the control and minus the champion when they were evaluated),
    the flat metrics behind it, and the paired differences by model and set (with
    "grpo_vs_sft_continued", "grpo_vs_rft" and "<candidate>_vs_champion"; candidate: the model
    the pipeline registers, grpo or rft)."""
    table, metrics, paired = [], {}, {}

    def diff(base: str, label: str, s: str) -> dict[str, float]:
        return paired_difference(
            [r for r in samples[base] if r["set"] == s],
            [r for r in samples[label] if r["set"] == s],
        )

    for s in sets:
        row: dict[str, Any] = {"set": s}
        # metric keys and the gate use the set's label (rg:mix -> rg_mix, a path -> its stem)
        lab = set_label(s)
        left_out = max(int(reports[label]["sets"][s].get("left_out", 0)) for label in labels)
        if left_out:  # prompts longer than evaluation can hold: never silently dropped
            row["left out"] = left_out
        for label in labels:
            m = reports[label]["sets"][s]
            lo, hi = m["accuracy_ci_low"], m["accuracy_ci_high"]
            row[label] = f"{m['accuracy']:.3f} [{lo:.3f}, {hi:.3f}]"
            for k, v in m.items():
                if isinstance(v, float):
                    metrics[f"{label}/eval/{lab}/{k}"] = v
        for label in labels:
            if label == "reference":
                continue
            d = diff("reference", label, s)
            row[f"{label} - ref"] = format_paired(d)
            metrics[f"{label}/eval/{lab}/diff_vs_reference"] = d["diff"]
            paired.setdefault(label, {})[lab] = d
        # GRPO against its controls for the same compute (the honest comparisons) and the
        # candidate against the champion; the last steps against each other when a selection
        # split chose the others
        pairs = (
            ("sft_continued", "grpo"),
            ("rft", "grpo"),
            ("champion", candidate),
            ("sft_continued_last", "grpo_last"),
            ("rft_last", "grpo_last"),
            # what the tools add to the trained model (eval.untooled)
            (f"{candidate}_untooled", candidate),
        )
        for base, model in pairs:
            if base not in labels or model not in labels:
                continue
            d = diff(base, model, s)
            row[f"{model} - {base}"] = format_paired(d)
            metrics[f"{model}/eval/{lab}/diff_vs_{base}"] = d["diff"]
            paired.setdefault(f"{model}_vs_{base}", {})[lab] = d
        table.append(row)
    return table, metrics, paired
