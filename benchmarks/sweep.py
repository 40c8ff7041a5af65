"""Sweep GRPO settings from one SFT reference; held-out accuracy with paired differences.

python benchmarks/sweep.py --reference runs/sft/<key> --variant "grpo.lr=1e-4;seed=1" ...
Each --variant is a ';'-separated list of overrides; every model is evaluated on --sets (default:
the config's eval.sets), paired against the reference; results go to OUT/sweep_results.jsonl.
"""

import argparse
import json
import time
from pathlib import Path

import bench_env  # noqa: E402

bench_env.prepare()  # the CLI's kernels and threads, before torch loads


from grpo.config import load_config  # noqa: E402
from grpo.eval.metrics import paired_difference  # noqa: E402
from grpo.eval.run import evaluate_model  # noqa: E402
from grpo.launch.runner import run_grpo  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--reference", required=True)
    p.add_argument("--config", default="configs/tiny.yaml")
    p.add_argument("--variant", action="append", required=True)
    p.add_argument("--out", default="runs/sweep")
    p.add_argument("--control", action="store_true", help="also SFT continued for GRPO's time")
    p.add_argument("--sets", help="comma-separated held-out sets (default: the config's eval.sets)")
    p.add_argument("--limit", type=int, help="the first N problems of each set")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="an override for the reference's evaluation and every variant")  # fmt: skip
    a = p.parse_args()
    out = Path(a.out)
    base = load_config(a.config, a.set)
    sets = a.sets.split(",") if a.sets else base.eval.sets
    ref_eval = evaluate_model(base, a.reference, sets, str(out / "reference"), limit=a.limit,
                              progress=False)  # fmt: skip
    ref_samples = [json.loads(x) for x in (out / "reference" / "samples.jsonl").open()]
    print("reference", {k: round(v["accuracy"], 3) for k, v in ref_eval["sets"].items()})
    for i, variant in enumerate(a.variant):
        overrides = [v for v in variant.split(";") if v]
        cfg = load_config(a.config, [*a.set, *overrides])
        t = time.time()
        run_grpo(cfg, Path(a.reference), out / f"v{i}", log=lambda s: None)
        secs = time.time() - t
        rep = evaluate_model(cfg, str(out / f"v{i}" / "policy"), sets, str(out / f"v{i}" / "eval"),
                             limit=a.limit, progress=False)  # fmt: skip
        samples = [json.loads(x) for x in (out / f"v{i}" / "eval" / "samples.jsonl").open()]
        res = {"variant": overrides, "seconds": round(secs, 1)}
        for s in sets:
            d = paired_difference([r for r in ref_samples if r["set"] == s],
                                  [r for r in samples if r["set"] == s])  # fmt: skip
            res[s] = round(rep["sets"][s]["accuracy"], 4)
            res[f"{s}_diff"] = [round(d["diff"], 4), round(d["ci_low"], 4), round(d["ci_high"], 4)]
        if a.control:
            from grpo.data.sets import training_sets
            from grpo.engine.sft import train_control

            ctl = out / f"v{i}_control"
            train_control(cfg, a.reference, ctl, training_sets(cfg), max_seconds=secs)  # fmt: skip
            crep = evaluate_model(cfg, str(ctl), sets[:1], str(ctl) + "_eval", limit=a.limit,
                                  progress=False)  # fmt: skip
            res[f"control_{sets[0]}"] = round(crep["sets"][sets[0]]["accuracy"], 4)
        curve = [json.loads(x) for x in (out / f"v{i}" / "metrics.jsonl").open()]
        res["curve"] = [(r["step"], round(r["eval/inrun_subset_accuracy"], 3)) for r in curve
                        if "eval/inrun_subset_accuracy" in r]  # fmt: skip
        print(json.dumps(res), flush=True)
        with (out / "sweep_results.jsonl").open("a") as f:
            f.write(json.dumps(res) + "\n")


if __name__ == "__main__":
    main()
