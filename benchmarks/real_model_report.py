"""The measured part of benchmarks/REAL_MODEL.md, from a finished
`grpo pipeline --config configs/smollm2-135m.yaml` (one run directory per seed).

Reads each run's eval/<model>/samples.jsonl (greedy) and samples_sampled.jsonl (pass@k at the
training temperature), grpo/metrics.jsonl, the control's metrics and both selection summaries,
and writes: the held-out table (strict: the training reward's reading; lenient: the last number
in the text), the paired differences with 95% intervals (`grpo - sft_continued` first), the
selection, accuracy per reasoning-gym generator, the out-of-format check (a set beside its
reworded twin), with tools their use and errors and each tooled model against itself without
them (eval.untooled), the curves, and the same problems before and after. Several --run-dir give
GRPO - RFT, GRPO - continued SFT, RFT - reference and GRPO - reference per seed and set, with
the seeds' spread.

    python benchmarks/real_model_report.py --run-dir runs/smollm2-135m/<parent run id> \
        --wall "71 min" --peak-rss "9.8 GB" --out benchmarks/REAL_MODEL_RESULT.md
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# the untooled pair: a run with tools (eval.untooled), the reference and GRPO without them
LABELS = ("reference", "grpo", "sft_continued", "rft", "grpo_last", "sft_continued_last",
          "rft_last", "reference_untooled", "grpo_untooled")  # fmt: skip
PAIRS = (  # (minus, model): model - minus
    ("sft_continued", "grpo"),
    ("rft", "grpo"),
    ("reference", "grpo"),
    ("reference", "sft_continued"),
    ("reference", "rft"),
    ("sft_continued_last", "grpo_last"),
    ("grpo_last", "grpo"),
    ("reference_untooled", "reference"),
    ("grpo_untooled", "grpo"),
)


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.open()] if path.exists() else []


def _by_set(recs: list[dict], s: str) -> list[dict]:
    return [r for r in recs if r["set"] == s]


def _sets(run_dir: Path) -> list[str]:
    """The run's evaluation sets, in the order evaluated (the reference's records)."""
    recs = _jsonl(run_dir / "eval" / "reference" / "samples.jsonl")
    return list(dict.fromkeys(r["set"] for r in recs))


def _curves(rows: list[dict], control: list[dict], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in rows if "reward" in r]
    fig, ax = plt.subplots(1, 4, figsize=(17, 3.4))
    panels = (
        ("reward", "training reward (the config's weighted sum)"),
        ("completions/mean_length", "completion tokens (mean)"),
        ("completions/clipped_ratio", "share hitting the token limit"),
    )
    for a, (key, title) in zip(ax, panels, strict=False):
        a.plot(steps, [r[key] for r in rows if "reward" in r], marker=".")
        a.set_title(title, fontsize=10)
        a.set_xlabel("GRPO step")
        a.grid(alpha=0.3)
    sel = [(r["step"], r["select/accuracy"]) for r in rows if "select/accuracy" in r]
    ax[3].plot(*zip(*sel, strict=True), marker="o", label="GRPO (x: GRPO step)")
    ctl = [(r["step"], r["select_accuracy"]) for r in control if "select_accuracy" in r]
    if ctl:
        ax[3].plot(*zip(*ctl, strict=True), marker="s", label="control (x: SFT step)")
    ax[3].set_title("selection-split accuracy (greedy)", fontsize=10)
    ax[3].legend(fontsize=8)
    ax[3].grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def _model_rows(run_dir: Path) -> list[str]:
    from grpo.eval.metrics import summarize

    lines = [
        "| set | model | problems | greedy strict | greedy lenient | sampled pass@1 | pass@8 "
        "| maj@8 | mean length | truncated |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for s in _sets(run_dir):
        for label in LABELS:
            recs = _by_set(_jsonl(run_dir / "eval" / label / "samples.jsonl"), s)
            if not recs:
                continue
            m = summarize(recs)
            sampled = _by_set(_jsonl(run_dir / "eval" / label / "samples_sampled.jsonl"), s)
            k = summarize(sampled) if sampled else {}
            fmt = lambda key, k=k: f"{k[key]:.3f}" if key in k else "-"  # noqa: E731
            # pass@8 may be sampled on the first eval.pass_k_limit problems only
            fewer = k and k["num_problems"] != m["num_problems"]
            n = f" (n={int(k['num_problems'])})" if fewer else ""
            lines.append(
                f"| {s} | {label} | {int(m['num_problems'])} | {m['accuracy']:.3f} "
                f"[{m['accuracy_ci_low']:.3f}, {m['accuracy_ci_high']:.3f}] | "
                f"{m['accuracy_lenient']:.3f} | {fmt('mean_accuracy')} | {fmt('pass@8')}{n} | "
                f"{fmt('maj@8')} | {m['mean_length']:.1f} | {m['truncation_rate']:.3f} |"
            )
    return lines


def _paired_rows(run_dir: Path) -> list[str]:
    from grpo.eval.metrics import format_paired, paired_difference

    samples = {label: _jsonl(run_dir / "eval" / label / "samples.jsonl") for label in LABELS}
    sets = _sets(run_dir)
    head = "| comparison | " + " | ".join(f"{s} strict | {s} lenient" for s in sets) + " |"
    lines = [head, "|---|" + "---|" * (2 * len(sets))]
    for minus, model in PAIRS:
        if not (samples[minus] and samples[model]):
            continue
        cells = []
        for s in sets:
            a, b = _by_set(samples[minus], s), _by_set(samples[model], s)
            cells.append(format_paired(paired_difference(a, b)))
            cells.append(format_paired(paired_difference(a, b, key="correct_lenient")))
        lines.append(f"| {model} - {minus} | " + " | ".join(cells) + " |")
    return lines


SEED_PAIRS = (("rft", "grpo"), ("sft_continued", "grpo"), ("reference", "rft"),
              ("reference", "grpo"), ("reference_untooled", "reference"),
              ("grpo_untooled", "grpo"))  # fmt: skip


def _seed(run_dir: Path) -> str:
    cfg = (run_dir / "grpo" / "config.yaml").read_text()
    return next((ln.split(":")[1].strip() for ln in cfg.splitlines() if ln.startswith("seed:")),
                "?")  # fmt: skip


def _seed_rows(run_dirs: list[Path]) -> list[str]:
    """Per comparison, one row per seed and one column per set (strict), then the seeds' mean
    and range: the seed spread beside each seed's paired interval."""
    from grpo.eval.metrics import format_paired, paired_difference

    sets = list(dict.fromkeys(s for rd in run_dirs for s in _sets(rd)))
    lines: list[str] = []
    for minus, model in SEED_PAIRS:
        rows, diffs = [], {s: [] for s in sets}
        for rd in run_dirs:
            a = _jsonl(rd / "eval" / minus / "samples.jsonl")
            b = _jsonl(rd / "eval" / model / "samples.jsonl")
            if not (a and b):  # a model this run did not train, or an unfinished evaluation
                continue
            cells = []
            for s in sets:
                sa, sb = _by_set(a, s), _by_set(b, s)
                if not (sa and sb):
                    cells.append("-")
                    continue
                d = paired_difference(sa, sb)
                diffs[s].append(d["diff"])
                cells.append(format_paired(d))
            rows.append(f"| {_seed(rd)} | `{rd.name}` | " + " | ".join(cells) + " |")
        if not rows:
            continue
        lines += [f"**{model} - {minus}** (strict)", "",
                  "| seed | run | " + " | ".join(sets) + " |", "|---|---|" + "---|" * len(sets),
                  *rows]  # fmt: skip
        if len(rows) > 1:
            spread = [f"mean {statistics.mean(v):+.3f}, {min(v):+.3f} to {max(v):+.3f}"
                      if v else "-" for v in diffs.values()]  # fmt: skip
            lines.append("| seeds | | " + " | ".join(spread) + " |")
        lines.append("")
    return lines


def _generator_rows(run_dir: Path) -> list[str]:
    """Accuracy per reasoning-gym generator (each set's report.json `by_generator`)."""
    reports = {label: json.loads(p.read_text()) for label in LABELS
               if (p := run_dir / "eval" / label / "report.json").exists()}  # fmt: skip
    lines = []
    for s in _sets(run_dir):
        gens = sorted(
            {g for r in reports.values() for g in r["sets"].get(s, {}).get("by_generator", {})}
        )
        if len(gens) < 2:
            continue
        labels = [lb for lb in reports if s in reports[lb]["sets"]]
        lines += [f"| {s}: generator | " + " | ".join(labels) + " |",
                  "|---|" + "---|" * len(labels)]  # fmt: skip
        for g in gens:
            cells = [f"{reports[lb]['sets'][s]['by_generator'].get(g, float('nan')):.3f}"
                     for lb in labels]  # fmt: skip
            lines.append(f"| {g} | " + " | ".join(cells) + " |")
        lines.append("")
    return lines


def _tool_rows(run_dir: Path) -> list[str]:
    """With tools: each tooled model's share of episodes that called one, and its tool errors
    an episode, per set (report.json)."""
    lines = []
    for label in LABELS:
        path = run_dir / "eval" / label / "report.json"
        sets = json.loads(path.read_text())["sets"] if path.exists() else {}
        for s, m in sets.items():
            if "tool_use_rate" in m:
                lines.append(f"| {s} | {label} | {m['tool_use_rate']:.3f} | "
                             f"{m['tool_errors_mean']:.3f} |")  # fmt: skip
    if not lines:
        return []
    return ["| set | model | episodes calling a tool | tool errors an episode |",
            "|---|---|---|---|", *sorted(lines), ""]  # fmt: skip


def _reworded_rows(run_dir: Path) -> list[str]:
    """The out-of-format check: each model on a set and on the same problems in other words
    (`rg:reworded:X` beside `rg:X`), paired problem by problem."""
    from grpo.eval.metrics import format_paired, paired_difference, summarize

    sets = _sets(run_dir)
    pairs = [(s.replace("reworded:", "", 1), s) for s in sets
             if ":reworded:" in s and s.replace("reworded:", "", 1) in sets]  # fmt: skip
    lines = []
    for orig, reworded in pairs:
        lines += [f"| model | {orig} | {reworded} | reworded - original, paired 95% |",
                  "|---|---|---|---|"]  # fmt: skip
        for label in LABELS:
            recs = _jsonl(run_dir / "eval" / label / "samples.jsonl")
            a, b = _by_set(recs, orig), _by_set(recs, reworded)
            if a and b:
                lines.append(f"| {label} | {summarize(a)['accuracy']:.3f} | "
                             f"{summarize(b)['accuracy']:.3f} | "
                             f"{format_paired(paired_difference(a, b))} |")  # fmt: skip
        lines.append("")
    return lines


def _reference_summary(run_dir: Path) -> dict | None:
    """The SFT summary of the reference this run evaluated (eval/reference/report.json names
    it, relative to the directory the pipeline ran in)."""
    report = run_dir / "eval" / "reference" / "report.json"
    if not report.exists():
        return None
    model = Path(json.loads(report.read_text())["model"])
    path = (model if model.is_absolute() else run_dir.parents[2] / model) / "sft_summary.json"
    return json.loads(path.read_text()) if path.exists() else None


def _before_after(run_dir: Path, n: int = 8) -> list[str]:
    samples = {label: {r["id"]: r for r in _jsonl(run_dir / "eval" / label / "samples.jsonl")
                       if r["sample"] == 0}
               for label in ("reference", "grpo", "sft_continued", "rft")}  # fmt: skip
    if not samples["rft"]:  # a run without the RFT control
        del samples["rft"]
    if not all(samples.values()):
        return []
    lines = [
        "| problem | gold | " + " | ".join(samples) + " |",
        "|---|---|" + "---|" * len(samples),
    ]
    clip = lambda t: t.replace("\n", " ").replace("|", "/")[:90]  # noqa: E731
    # the problems where the three disagree first: where RL and SFT differ is what to read
    ids = sorted(samples["grpo"], key=lambda i: (
        len({samples[m][i]["correct"] for m in samples if i in samples[m]}) == 1, i))  # fmt: skip
    for i in ids[:n]:
        g = samples["grpo"][i]
        mark = lambda r: ("✓ " if r["correct"] else "✗ ") + clip(r["completion"])  # noqa: E731
        cells = " | ".join(mark(samples[m][i]) if i in samples[m] else "-" for m in samples)
        lines.append(f"| `{clip(g['prompt'])}` | {g['gold']} | {cells} |")
    return lines


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument(
        "--run-dir",
        action="append",
        required=True,
        help="a pipeline run directory; repeat for several seeds (the first is shown)",
    )
    p.add_argument("--wall", required=True, help="the whole pipeline's wall time, as text")
    p.add_argument("--peak-rss", required=True, help="the largest process's peak RSS, as text")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "REAL_MODEL_RESULT.md"))
    p.add_argument(
        "--curves",
        default="real_model_curves.png",
        help="the curves' file name, in benchmarks/ (one per seed shown)",
    )
    a = p.parse_args()
    runs = [Path(r) for r in a.run_dir]
    run_dir = runs[0]
    rows = _jsonl(run_dir / "grpo" / "metrics.jsonl")
    control = _jsonl(run_dir / "sft_continued_metrics.jsonl")
    _curves(rows, control, ROOT / "benchmarks" / a.curves)
    sel_g = json.loads((run_dir / "grpo" / "selection_summary.json").read_text())
    ctl = json.loads((run_dir / "sft_continued" / "control_summary.json").read_text())
    sft = _reference_summary(run_dir)
    step_times = [r["step_time"] for r in rows if "step_time" in r]
    generators, reworded = _generator_rows(run_dir), _reworded_rows(run_dir)
    tools = _tool_rows(run_dir)
    lines = [
        "## Measured: the run",
        "",
        f"Whole pipeline: {a.wall} wall, peak RSS of the largest process {a.peak_rss}. "
        f"GRPO {len(step_times)} steps, a median {statistics.median(step_times):.1f} s a step; "
        f"the control {ctl['steps']} SFT steps in {ctl['seconds']:.0f} s beside it.",
        "",
        f"Selected: GRPO step {sel_g['selected_step']} of {sel_g['last_step']} "
        f"(selection accuracy {sel_g['selected_accuracy']:.3f}); the control's step "
        f"{ctl['selection']['selected_step']} of {ctl['selection']['last_step']} "
        f"({ctl['selection']['selected_accuracy']:.3f}). Rule: {sel_g['rule']}.",
        "",
        "### Held-out accuracy",
        "",
        *_model_rows(run_dir),
        "",
        "### Paired differences (same problems, 95% normal intervals)",
        "",
        *_paired_rows(run_dir),
        "",
        *(["### Per generator", "", *generators] if generators else []),
        *(["### Out of format", "", *reworded] if reworded else []),
        *(["### Tool use", "", *tools] if tools else []),
        "### Seeds",
        "",
        *_seed_rows(runs),
        "### Curves",
        "",
        f"![curves]({a.curves})",
        "",
        "### The same problems before and after (disagreements first)",
        "",
        *_before_after(run_dir),
    ]
    if sft:
        lines += ["", f"The SFT reference: {sft['steps']} steps, best validation loss "
                  f"{sft['best_val_loss']:.4f}, {sft['lr_cuts']} learning-rate cut(s), "
                  f"{sft['seconds']:.0f} s."]  # fmt: skip
    Path(a.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
