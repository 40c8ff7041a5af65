"""The out-of-format check of a finished reasoning-gym pipeline run: every model it evaluated,
again on the same held-out problems asked in other words (`rg:reworded:<generator>`,
grpo/data/rewording.py), greedy, and paired problem by problem with its own answers to the
original wording.

Reads the run's eval/<model>/report.json (which names each model's directory) and
samples.jsonl; writes eval_reworded/<model>/ beside them and a markdown table.

    python benchmarks/rg_format_check.py --config configs/smollm2-135m-rg.yaml \
        --run-dir runs/smollm2-135m-rg/RUN_ID --per-generator 100 --out /tmp/format.md
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

MODELS = ("reference", "grpo", "sft_continued", "rft")


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.open()]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--config", required=True, help="the run's config")
    p.add_argument("--set", action="append", default=[], help="the run's overrides (seed=1)")
    p.add_argument("--run-dir", required=True, help="the pipeline run's directory")
    p.add_argument("--per-generator", type=int, default=100, help="problems a generator")
    p.add_argument("--out", required=True, help="markdown file for the table")
    a = p.parse_args()

    from grpo.config import load_config
    from grpo.eval.metrics import paired_difference
    from grpo.eval.run import evaluate_model

    cfg = load_config(a.config, a.set)
    run = Path(a.run_dir)
    gens = [g.name for g in cfg.data.generators]
    sets = [f"rg:reworded:{g}" for g in gens]
    lines = [f"Greedy pass@1 (strict), the first {a.per_generator} held-out problems of each "
             f"training generator ({len(gens) * a.per_generator} in all), original wording and "
             "reworded; paired on the same problems.", "",
             "| model | original | reworded | reworded - original, paired 95% |",
             "|---|---|---|---|"]  # fmt: skip
    for label in MODELS:
        report = run / "eval" / label / "report.json"
        if not report.exists():
            continue
        model_dir = json.loads(report.read_text())["model"]
        out = run / "eval_reworded" / label
        evaluate_model(cfg, model_dir, sets, str(out), limit=a.per_generator, pass_k=0)
        reworded = _jsonl(out / "samples.jsonl")
        ids = {r["id"] for r in reworded}
        original = [r for r in _jsonl(run / "eval" / label / "samples.jsonl")
                    if r["set"] == "rg:mix" and r["id"] in ids and r["sample"] == 0]  # fmt: skip
        d = paired_difference(original, reworded)  # reworded - original
        orig = sum(r["correct"] for r in original) / len(original)
        new = sum(r["correct"] for r in reworded) / len(reworded)
        lines.append(f"| {label} | {orig:.3f} | {new:.3f} | {d['diff']:+.3f} "
                     f"[{d['ci_low']:+.3f}, {d['ci_high']:+.3f}] |")  # fmt: skip
    Path(a.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
