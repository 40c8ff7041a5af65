"""Outcome GRPO vs process-supervised GRPO vs SFT continued, from one plateaued SFT reference.

    .venv/bin/python benchmarks/process_vs_outcome.py --reference runs/sft/<key> \
        --variant "outcome=" \
        --variant "process-sum=grpo.advantage_mode=process" \
        --variant "process-mean=grpo.advantage_mode=process;grpo.process_advantage=mean"

The first variant is the baseline the others are compared with (paired, same held-out problems)
and the one whose wall time the SFT-continued control gets. Every variant trains the same number
of steps; their seconds are reported beside them. Writes benchmarks/PROCESS.md (table and
step-reward statistics), benchmarks/process_curves.png (held-out accuracy and reward against
seconds) and runs/process/results.jsonl.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
import bench_env  # noqa: E402

bench_env.prepare()  # the CLI's kernels and threads, before torch loads


SETS = ["synthetic", "synthetic_ood"]


def _samples(path: Path, name: str) -> list[dict]:
    return [r for r in map(json.loads, path.open()) if r["set"] == name]


def _step_stats(run: Path) -> list[tuple[int, float, float]]:
    """(step, share of written column steps that are the problem's own, steps per completion)
    over the logged completions (the first of each group), scored by column_steps."""
    from reward_fns import column_steps

    by_step: dict[int, list[dict]] = {}
    for r in map(json.loads, (run / "completions.jsonl").open()):
        by_step.setdefault(r["step"], []).append(r)
    out = []
    for step, rows in sorted(by_step.items()):
        scored = column_steps([r["completion"] for r in rows], [r["prompt"] for r in rows],
                              [r["answer"] for r in rows])  # fmt: skip
        steps = [x for rewards, _ in scored for x in rewards[:-1]]  # the answer step left out
        share = sum(steps) / len(steps) if steps else float("nan")
        out.append((step, share, len(steps) / len(rows)))
    return out


def main() -> None:
    from grpo.config import load_config
    from grpo.data.sets import training_sets
    from grpo.engine.sft import train_control
    from grpo.eval.run import evaluate_model
    from grpo.launch.runner import run_grpo

    p = argparse.ArgumentParser()
    p.add_argument("--reference", required=True)
    p.add_argument("--variant", action="append", required=True, help="NAME=k=v;k=v")
    p.add_argument("--set", action="append", default=[], help="override for every variant")
    p.add_argument("--out", default=str(ROOT / "runs" / "process"))
    p.add_argument("--no-control", action="store_true")
    p.add_argument("--report-dir", default=str(ROOT / "benchmarks"), help="PROCESS.md, plot")
    a = p.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    common = ["grpo.log_completions_every=10", *a.set]
    base_cfg = load_config(None, common)
    evaluate_model(base_cfg, a.reference, SETS, str(out / "reference"), progress=False)
    ref = {s: _samples(out / "reference" / "samples.jsonl", s) for s in SETS}
    results, baseline = [], None
    for spec in a.variant:
        name, _, rest = spec.partition("=")
        cfg = load_config(None, [*common, *[v for v in rest.split(";") if v]])
        # the trainer's own seconds (start-up of the process left out): the control's budget;
        # a variant already trained in --out is reused (a rerun after an interruption)
        done = out / name / "train_summary.json"
        if done.exists() and (out / name / "policy").is_dir():
            secs = json.loads(done.read_text())["seconds"]
        else:
            secs = run_grpo(cfg, Path(a.reference), out / name, log=lambda s: None)["seconds"]
        evaluate_model(cfg, str(out / name / "policy"), SETS, str(out / name / "eval"),
                       progress=False)  # fmt: skip
        mine = {s: _samples(out / name / "eval" / "samples.jsonl", s) for s in SETS}
        curve = [json.loads(x) for x in (out / name / "metrics.jsonl").open()]
        res = {"name": name, "overrides": rest, "seconds": round(secs, 1),
               "step_time": statistics.median(r["step_time"] for r in curve if "step_time" in r),
               "curve": [(r["step"], r.get("eval/inrun_subset_accuracy"), r.get("reward"))
                         for r in curve],
               "step_stats": _step_stats(out / name)}  # fmt: skip
        res.update(_compare(mine, ref, baseline))
        print(json.dumps({k: v for k, v in res.items() if k not in ("curve", "step_stats")}),
              flush=True)  # fmt: skip
        results.append(res)
        if baseline is None:
            baseline = {"name": name, "samples": mine, "seconds": secs, "cfg": cfg}
    if not a.no_control and baseline is not None:
        ctl = out / "sft_continued"
        if not (ctl / "config.json").exists():  # reused on a rerun, like the variants
            cfg = baseline["cfg"]
            train_control(
                cfg, a.reference, ctl, training_sets(cfg), max_seconds=baseline["seconds"]
            )
        evaluate_model(baseline["cfg"], str(ctl), SETS, str(out / "sft_continued_eval"),
                       progress=False)  # fmt: skip
        mine = {s: _samples(out / "sft_continued_eval" / "samples.jsonl", s) for s in SETS}
        res = {"name": "sft_continued", "overrides": f"SFT for {baseline['seconds']:.0f} s",
               "seconds": round(baseline["seconds"], 1)}  # fmt: skip
        res.update(_compare(mine, ref, baseline))
        print(json.dumps(res), flush=True)
        results.append(res)
    ref_acc = {s: sum(r["correct"] for r in ref[s]) / len(ref[s]) for s in SETS}
    with (out / "results.jsonl").open("w") as f:
        for r in results:
            f.write(json.dumps(r) + "\n")
    _report(results, ref_acc, baseline["name"] if baseline else "", a, out)


def _compare(mine: dict, ref: dict, baseline: dict | None) -> dict:
    """Accuracy per set, and paired differences to the reference and to the baseline."""
    from grpo.eval.metrics import paired_difference

    out: dict = {}
    others = [("ref", ref)] + ([(baseline["name"], baseline["samples"])] if baseline else [])
    for s in SETS:
        out[s] = sum(r["correct"] for r in mine[s]) / len(mine[s])
        for name, samples in others:
            d = paired_difference(samples[s], mine[s])
            out[f"{s}_vs_{name}"] = [d["diff"], d["ci_low"], d["ci_high"]]
    return out


def _ci(v: list[float]) -> str:
    return f"{v[0] * 100:+.1f} [{v[1] * 100:+.1f}, {v[2] * 100:+.1f}]"


def _report(results: list[dict], ref_acc: dict, base: str, a: argparse.Namespace,
            out: Path) -> None:  # fmt: skip
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lines = [
        "# Process vs outcome supervision (benchmarks/process_vs_outcome.py)",
        "",
        "Command: `python benchmarks/process_vs_outcome.py --reference <plateaued SFT reference> "
        + " ".join(f'--variant "{v}"' for v in a.variant)
        + "".join(f" --set {s}" for s in a.set)
        + "`",
        "",
        f"Reference: {a.reference} (synthetic held-out accuracy {ref_acc['synthetic']:.3f}, "
        f"OOD {ref_acc['synthetic_ood']:.3f}). Greedy pass@1 on the 1,000 in-distribution and "
        "500 out-of-distribution held-out problems; differences are paired on the same problems "
        "with 95% intervals, in points. The SFT-continued control trains for the first "
        "variant's wall time.",
        "",
        f"| variant | overrides | seconds | median step s | synthetic | vs reference | vs {base} "
        f"| OOD | OOD vs reference |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        vs = r.get(f"synthetic_vs_{base}")
        lines.append(
            f"| {r['name']} | `{r['overrides'] or 'defaults'}` | {r['seconds']:.0f} | "
            f"{r.get('step_time', float('nan')):.2f} | {r['synthetic']:.3f} | "
            f"{_ci(r['synthetic_vs_ref'])} | {_ci(vs) if vs else '-'} | "
            f"{r['synthetic_ood']:.3f} | {_ci(r['synthetic_ood_vs_ref'])} |"
        )
    lines += [
        "",
        "Column steps written correctly (share of `x+y(+c)=s` steps that are the problem's own, "
        "scored by column_steps over the logged completions: the first of each group every 10 "
        "steps), at the first logged step and over the last 5:",
        "",
        "| variant | step 1 | last 5 logged steps | steps per completion (last 5) |",
        "|---|---|---|---|",
    ]
    for r in results:
        if r.get("step_stats"):
            first, last = r["step_stats"][0], r["step_stats"][-5:]
            share = sum(x[1] for x in last) / len(last)
            per = sum(x[2] for x in last) / len(last)
            lines.append(f"| {r['name']} | {first[1]:.3f} | {share:.3f} | {per:.2f} |")
    report = Path(a.report_dir)
    (report / "PROCESS.md").write_text("\n".join(lines) + "\n")

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for r in results:
        if "curve" not in r:
            ax1.axhline(r["synthetic"], ls="--", color="gray", label=r["name"] + " (end)")
            continue
        steps = [c[0] for c in r["curve"]]
        secs = [s * r["seconds"] / max(steps) for s in steps]
        pts = [(t, c[1]) for t, c in zip(secs, r["curve"]) if c[1] is not None]
        ax1.plot([t for t, _ in pts], [v for _, v in pts], marker="o", label=r["name"])
        reward = [float("nan") if c[2] is None else c[2] for c in r["curve"]]
        ax2.plot(steps, reward, label=r["name"], alpha=0.8)
    ax1.set_xlabel("seconds (steps x mean step time)")
    ax1.set_ylabel("in-run held-out accuracy (greedy)")
    ax1.legend()
    ax2.set_xlabel("step")
    ax2.set_ylabel("weighted outcome reward (training batch)")
    ax2.legend()
    fig.tight_layout()
    fig.savefig(report / "process_curves.png", dpi=110)
    print(f"wrote {report}/PROCESS.md, {report}/process_curves.png, {out / 'results.jsonl'}")


if __name__ == "__main__":
    main()
