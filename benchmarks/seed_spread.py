"""The default run's spread over seeds: what a newcomer should expect on any machine.

Runs the whole pipeline (`grpo pipeline`) once per seed (`seed` drives model initialisation, SFT
order and sampling; the data keep their own seed), each into its own output and MLflow store,
then prints the held-out table of every seed and the mean and min-max of each column. Usage:

    python benchmarks/seed_spread.py --seeds 0 1 2 --work /tmp/seeds --report benchmarks/SEEDS.md
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

COLUMNS = {
    "reference": "reference/eval/{s}/accuracy",
    "grpo": "grpo/eval/{s}/accuracy",
    "sft_continued": "sft_continued/eval/{s}/accuracy",
    "grpo - ref": "grpo/eval/{s}/diff_vs_reference",
    "grpo - sft_continued": "grpo/eval/{s}/diff_vs_sft_continued",
}


def pipeline(seed: int, work: Path, config: str | None, sets: list[str]) -> dict:
    """One pipeline; its parent run's metrics and tags, and its wall seconds."""
    from mlflow import MlflowClient

    out = work / f"seed{seed}"
    out.mkdir(parents=True, exist_ok=True)
    uri = f"sqlite:///{out / 'mlflow.db'}"
    env = {**os.environ, "MLFLOW_TRACKING_URI": uri}
    cmd = [sys.executable, "-m", "cli.main", "pipeline", "--set", f"seed={seed}",
           "--set", f"output_dir={out / 'runs'}"]  # fmt: skip
    cmd += ["--config", config] if config else []
    for s in sets:
        cmd += ["--set", s]
    t = time.time()
    proc = subprocess.run(cmd, env=env, cwd=out, capture_output=True, text=True)
    (out / "pipeline.log").write_text(proc.stdout + proc.stderr)
    if proc.returncode:
        sys.exit(f"seed {seed}: the pipeline failed; see {out / 'pipeline.log'}")
    c = MlflowClient(uri, uri)
    runs = c.search_runs([e.experiment_id for e in c.search_experiments()])
    (parent,) = [r for r in runs if "mlflow.parentRunId" not in r.data.tags]
    return {"seed": seed, "metrics": parent.data.metrics, "tags": parent.data.tags,
            "seconds": time.time() - t}  # fmt: skip


def _cell(name: str, value: float | None) -> str:
    """A difference with its sign, an accuracy without; empty when not measured."""
    if value is None:
        return ""
    return f"{value:+.3f}" if "-" in name else f"{value:.3f}"


def table(results: list[dict], sets: list[str]) -> str:
    head = ["set", "seed", *COLUMNS, "pipeline s"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for s in sets:
        cols = {name: [r["metrics"].get(key.format(s=s)) for r in results]
                for name, key in COLUMNS.items()}  # fmt: skip
        for i, r in enumerate(results):
            cells = [_cell(n, v[i]) for n, v in cols.items()]
            lines.append(f"| {s} | {r['seed']} | " + " | ".join(cells) + f" | {r['seconds']:.0f} |")
        summary = []
        for name, v in cols.items():
            vals = [x for x in v if x is not None]
            fmt = "{:+.3f}" if "-" in name else "{:.3f}"
            summary.append(
                f"**{fmt.format(statistics.mean(vals))}** ({fmt.format(min(vals))} to "
                f"{fmt.format(max(vals))})"
                if vals
                else ""
            )
        secs = [r["seconds"] for r in results]
        lines.append(f"| {s} | mean (min to max) | " + " | ".join(summary)
                     + f" | {statistics.mean(secs):.0f} |")  # fmt: skip
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--work", required=True, help="scratch directory (runs, stores, logs)")
    p.add_argument("--config", help="YAML config (default: the embedded default run)")
    p.add_argument("--set", action="append", default=[], help="config override for every seed")
    p.add_argument("--eval-sets", default="synthetic,synthetic_ood")
    p.add_argument("--report", help="write the markdown table here too")
    a = p.parse_args()
    results = []
    for seed in a.seeds:
        results.append(pipeline(seed, Path(a.work), a.config, a.set))
        print(f"seed {seed}: done in {results[-1]['seconds']:.0f}s", flush=True)
    tags = results[0]["tags"]
    where = (f"{tags.get('host.cpu', '?')}, torch kernels {tags.get('host.cpu_capability', '?')}, "
             f"{tags.get('host.cpu_count', '?')} cores, torch {tags.get('host.torch', '?')}, "
             f"commit {tags.get('mlflow.source.git.commit', '?')[:7]}")  # fmt: skip
    text = f"Machine: {where}\n\n" + table(results, a.eval_sets.split(","))
    print(text)
    if a.report:
        Path(a.report).write_text(text + "\n")


if __name__ == "__main__":
    main()
